"""Where documents come from (torch-free): the default corpus, user paths and named sources, resolved into the
files they name (files, directories, globs and URLs; formats.py says which files are data).
"""

from __future__ import annotations

import glob
import os
import sysconfig
from collections.abc import Callable, Collection
from dataclasses import dataclass
from pathlib import Path

from hlat import HlatError
from hlat.data.config import DataConfig
from hlat.data.formats import SUFFIXES, File, file_format, file_size, filesystem, is_url


def default_corpus() -> list[Path]:
    """Every .py file of the Python standard library: ~30 MB of real text present on every machine.

    Installed packages (site-packages, dist-packages) are excluded so that the corpus does not depend on
    what happens to be installed. `test/` and `idlelib/` stay in: they are ordinary Python source (the test
    suite is more than half of the corpus), and the few deliberately mis-encoded test files are skipped
    like any other invalid UTF-8.
    """
    stdlib = Path(sysconfig.get_paths()["stdlib"])
    files = sorted(files_under(stdlib, lambda name: name.endswith(".py"), skip={"site-packages", "dist-packages"}))
    if not files:
        raise HlatError(f"the default corpus is empty: no .py files under {stdlib}; set data.paths")
    return files


def files_under(folder: Path, wanted: Callable[[str], object], skip: Collection[str] = ()) -> list[Path]:
    """The files below `folder` whose names `wanted(name)` accepts, in folders not named in `skip`; symlinked
    folders are not entered (as Path.rglob, in a tenth of its time: every rank pays it at every start)."""
    found = []
    for parent, dirs, names in os.walk(folder):
        dirs[:] = [d for d in dirs if d not in skip]
        found += [path for name in names if wanted(name) and (path := Path(parent, name)).is_file()]
    return found


def _expand_url(pattern: str) -> list[str]:
    fs, path = filesystem(pattern)
    if any(c in path for c in "*?["):
        matches = fs.glob(path)
    elif fs.isdir(path):
        matches = fs.find(path)
    else:
        matches = [path] if fs.exists(path) else []
    return [fs.unstrip_protocol(m) for m in matches if file_format(m) and not fs.isdir(m)]


def _expand(pattern: str) -> list[File]:
    if is_url(pattern):
        files: list[File] = list(_expand_url(pattern))
    else:
        expanded = Path(pattern).expanduser()
        is_glob = any(c in pattern for c in "*?[")
        if is_glob:
            matches = [Path(m) for m in glob.glob(str(expanded), recursive=True)]
        else:
            matches = [expanded] if expanded.exists() else []
        files = []
        for match in matches:
            if match.is_dir():
                files.extend(files_under(match, file_format))
            elif file_format(match.name):
                files.append(match)
            elif not is_glob:  # named explicitly, so not silently dropped
                raise HlatError(f"data.paths: unsupported file type {pattern!r} (supported: {', '.join(SUFFIXES)})")
    if not files:
        raise HlatError(f"data.paths: no files match {pattern!r} (supported: {', '.join(SUFFIXES)})")
    return files


def resolve_paths(patterns: list[str]) -> list[File]:
    """Expand files, directories (recursively), globs and URLs into a sorted, deduplicated list of files."""
    found = {p if is_url(p) else p.resolve() for pattern in patterns for p in _expand(pattern)}
    files = sorted(found, key=str)
    if not files or all(file_size(p) == 0 for p in files):
        raise HlatError(f"data.paths: the corpus is empty ({len(files)} files, 0 bytes)")
    return files


@dataclass(frozen=True)
class Source:
    name: str
    weight: float
    files: list[File]


def one_source(files: list[File]) -> list[Source]:
    """`files` as the one source "default"."""
    return [Source("default", 1.0, list(files))]


def resolve_sources(cfg: DataConfig) -> list[Source]:
    """The named sources of `data.sources`, or one source "default" of `data.paths` or the default corpus."""
    if not cfg.sources:
        return one_source(resolve_paths(cfg.paths) if cfg.paths else default_corpus())
    sources = []
    for name, (weight, patterns) in cfg.source_patterns().items():
        try:
            sources.append(Source(name, weight, resolve_paths(patterns)))
        except HlatError as e:
            raise HlatError(f"data source {name!r}: {e}") from None
    return sources


def source_files(sources: list[Source]) -> list[File]:
    """Every file of the sources, sorted (what a trained tokenizer samples from)."""
    return sorted({f for source in sources for f in source.files}, key=str)


def resolve_data_files(cfg: DataConfig) -> list[File]:
    """Every file of the run's data, sorted."""
    return source_files(resolve_sources(cfg))
