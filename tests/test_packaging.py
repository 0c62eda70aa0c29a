"""The package as a user installs it: a wheel that carries its recipes and hardware profiles, and config tools
that need no torch."""

import json
import os
import shutil
import subprocess
import sys
import sysconfig
import zipfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
CORPUS = os.path.join(os.path.dirname(json.__file__), "*.py")


def _run(cmd: list, cwd: Path, **env) -> str:
    environment = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"} | env
    result = subprocess.run(
        [str(c) for c in cmd], cwd=cwd, env=environment, capture_output=True, text=True, timeout=600
    )
    assert result.returncode == 0, f"{cmd} failed:\n{result.stdout}\n{result.stderr}"
    return result.stdout


@pytest.mark.slow
def test_wheel_trains_and_plans_in_a_fresh_venv(tmp_path):
    """Build a wheel from a copy of the checkout, install it (not editable) into a fresh virtual environment and
    run it from a directory with no configs/ or hardware/ beside it. Dependencies (torch and the rest) come from
    the test's own environment through a .pth file instead of a second install of torch; PYTHONPATH is dropped
    so nothing is imported from the checkout."""
    src = tmp_path / "src"
    src.mkdir()
    for name in ("pyproject.toml", "README.md"):
        shutil.copy(ROOT / name, src)
    for name in ("hlat", "configs", "hardware"):
        shutil.copytree(ROOT / name, src / name, ignore=shutil.ignore_patterns("__pycache__"))
    _run(
        [sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-q", "-w", tmp_path / "dist", src],
        tmp_path,
    )
    (wheel,) = (tmp_path / "dist").glob("hlat-*.whl")
    shipped = set(zipfile.ZipFile(wheel).namelist())
    in_checkout = {p.relative_to(ROOT).as_posix() for p in (ROOT / "hlat").rglob("*.py")}
    assert in_checkout <= shipped, f"modules left out of the wheel: {sorted(in_checkout - shipped)}"
    for folder in ("configs", "hardware"):
        assert {f"hlat/{folder}/{p.name}" for p in (ROOT / folder).glob("*.toml")} <= shipped

    venv = tmp_path / "venv"
    _run([sys.executable, "-m", "venv", "--without-pip", venv], tmp_path)
    python = venv / "bin" / "python"
    site = _run([python, "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"], tmp_path).strip()
    Path(site, "dependencies.pth").write_text(sysconfig.get_paths()["purelib"] + "\n")
    _run(
        [sys.executable, "-m", "pip", "--python", python, "install", "--no-deps", "--ignore-installed", "-q", wheel],
        tmp_path,
    )
    hlat = venv / "bin" / "hlat"
    work = tmp_path / "elsewhere"
    work.mkdir()
    where = _run([python, "-c", "import hlat.resources as r; print(r.RECIPES_DIR, r.HARDWARE_DIR)"], work)
    assert where.split() == [str(Path(site, "hlat", "configs")), str(Path(site, "hlat", "hardware"))]

    out = _run(
        [
            hlat,
            "train",
            "--config",
            "tiny",
            "--model.dim",
            "64",
            "--model.n_layers",
            "2",
            "--model.n_heads",
            "4",
            "--model.n_kv_heads",
            "2",
            "--model.ffn_dim",
            "128",
            "--train.steps",
            "2",
            "--train.global_batch",
            "2",
            "--train.micro_batch",
            "2",
            "--train.seq_len",
            "32",
            "--train.log_every",
            "1",
            "--data.paths",
            CORPUS,
            "--train.run_dir",
            work / "run",
        ],
        work,
    )
    assert "step      2/2" in out
    assert len((work / "run" / "metrics.jsonl").read_text().splitlines()) == 2
    plan = json.loads(_run([hlat, "plan", "--config", "hlat-7b", "--json"], work))  # a shipped recipe and profile
    assert (plan["hardware"], plan["nodes"], len(plan["plans"])) == ("trn1.32xlarge", 64, 1)
    assert "6,738,415,616" in _run([hlat, "describe", "--config", "hlat-7b"], work)


@pytest.mark.parametrize(
    "command",
    [
        ["describe", "--config", "hlat-70b"],
        ["plan", "--model", "llama2-7b", "--hardware", "p4d.24xlarge", "--nodes", "2"],
    ],
)
def test_describe_and_plan_import_no_torch(command):
    code = (
        "import sys; from hlat.cli import main; assert main(sys.argv[1:]) == 0; "
        "assert 'torch' not in sys.modules, 'torch was imported'"
    )
    _run([sys.executable, "-c", code, *command], ROOT, PYTHONPATH=str(ROOT))


def test_recipe_by_name_and_missing_config(capsys):
    from hlat.cli import main
    from hlat.resources import recipe_names

    assert {"tiny", "hlat-7b", "hlat-70b", "neox-20b", "pythia-6.9b"} <= set(recipe_names())
    assert main(["describe", "--config", "hlat-7b.toml"]) == 0
    assert main(["describe", "--config", "no-such-recipe"]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("hlat: error: config file not found: no-such-recipe (or a recipe name: ") and "\n" not in err
