"""Where hlat finds the files it ships: recipes (`configs/`) and hardware profiles (`hardware/`).

A wheel installs them inside the package (`hlat/configs`, `hlat/hardware`: see `package-dir` in pyproject.toml);
a source checkout (an editable install, or PYTHONPATH) keeps them at the repository root. Torch-free.
"""

from __future__ import annotations

from pathlib import Path

from hlat.fields import ConfigError

PACKAGE_DIR = Path(__file__).resolve().parent


def shipped_dir(name: str) -> Path:
    """The installed copy of a shipped folder if there is one, else the checkout's."""
    installed = PACKAGE_DIR / name
    return installed if installed.is_dir() else PACKAGE_DIR.parent / name


RECIPES_DIR = shipped_dir("configs")
HARDWARE_DIR = shipped_dir("hardware")


def recipe_names() -> list[str]:
    return sorted(p.stem for p in RECIPES_DIR.glob("*.toml"))


def config_path(name_or_path: str | Path) -> Path:
    """A config file: a path that exists, or the name of a shipped recipe (`hlat-7b` or `hlat-7b.toml`)."""
    path = Path(name_or_path)
    if path.is_file():
        return path
    if path.parent == Path("."):
        recipe = RECIPES_DIR / (path.name if path.suffix == ".toml" else f"{path.name}.toml")
        if recipe.is_file():
            return recipe
    raise ConfigError(f"config file not found: {name_or_path} (or a recipe name: {', '.join(recipe_names())})")
