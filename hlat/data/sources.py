"""Where documents come from: the default corpus, user paths, and the documents inside a file (torch-free)."""

from __future__ import annotations

import glob
import json
import logging
import sysconfig
from collections import Counter
from collections.abc import Iterator
from pathlib import Path

from hlat import HlatError

SUFFIXES = (".txt", ".py", ".md", ".jsonl")

log = logging.getLogger(__name__)

# Documents skipped since the process started, by reason ("malformed JSON", "invalid UTF-8", ...).
skipped: Counter[str] = Counter()


def default_corpus() -> list[Path]:
    """Every .py file of the Python standard library: ~30 MB of real text present on every machine.

    Installed packages (site-packages, dist-packages) are excluded so that the corpus does not depend on
    what happens to be installed. `test/` and `idlelib/` stay in: they are ordinary Python source (the test
    suite is more than half of the corpus), and the few deliberately mis-encoded test files are skipped
    like any other invalid UTF-8.
    """
    stdlib = Path(sysconfig.get_paths()["stdlib"])
    installed = {"site-packages", "dist-packages"}
    files = sorted(
        p for p in stdlib.rglob("*.py") if not installed & set(p.relative_to(stdlib).parts) and p.is_file()
    )
    if not files:
        raise HlatError(f"the default corpus is empty: no .py files under {stdlib}; set data.paths")
    return files


def _expand(pattern: str) -> list[Path]:
    expanded = Path(pattern).expanduser()
    is_glob = any(c in pattern for c in "*?[")
    if is_glob:
        matches = [Path(m) for m in glob.glob(str(expanded), recursive=True)]
    else:
        matches = [expanded] if expanded.exists() else []
    files: list[Path] = []
    for match in matches:
        if match.is_dir():
            files.extend(p for p in match.rglob("*") if p.suffix in SUFFIXES and p.is_file())
        elif match.suffix in SUFFIXES:
            files.append(match)
        elif not is_glob:  # named explicitly, so not silently dropped
            raise HlatError(f"data.paths: unsupported file type {pattern!r} (supported: {', '.join(SUFFIXES)})")
    if not files:
        raise HlatError(f"data.paths: no files match {pattern!r} (supported: {', '.join(SUFFIXES)})")
    return files


def resolve_paths(patterns: list[str]) -> list[Path]:
    """Expand files, directories (recursively) and globs into a sorted, deduplicated list of files."""
    files = sorted({p.resolve() for pattern in patterns for p in _expand(pattern)})
    if not files or all(p.stat().st_size == 0 for p in files):
        raise HlatError(f"data.paths: the corpus is empty ({len(files)} files, 0 bytes)")
    return files


def _skip(path: Path, where: str, reason: str) -> None:
    skipped[reason] += 1
    count = skipped[reason]
    if str(count).rstrip("0") == "1":  # warn at the 1st, 10th, 100th, ... occurrence of each reason
        log.warning(
            "skipped a document (%s) at %s%s; %d skipped for this reason so far", reason, path, where, count
        )


def iter_documents(path: str | Path, text_field: str = "text") -> Iterator[str]:
    """Yield the documents of one file: a whole text file is one document; a JSONL line holds one.

    Malformed JSON, invalid UTF-8 and empty documents are skipped and counted in `skipped`; blank JSONL
    lines are not documents at all and are ignored.
    """
    path = Path(path)
    try:
        if path.suffix != ".jsonl":
            try:
                text = path.read_bytes().decode("utf-8")
            except UnicodeDecodeError:
                _skip(path, "", "invalid UTF-8")
                return
            if text.strip():
                yield text
            else:
                _skip(path, "", "empty document")
            return
        with path.open("rb") as f:
            for lineno, line in enumerate(f, 1):
                if not line.strip():
                    continue
                try:
                    record = json.loads(line.decode("utf-8"))
                except UnicodeDecodeError:
                    _skip(path, f":{lineno}", "invalid UTF-8")
                    continue
                except ValueError:
                    _skip(path, f":{lineno}", "malformed JSON")
                    continue
                doc = record.get(text_field) if isinstance(record, dict) else None
                if not isinstance(doc, str):
                    _skip(path, f":{lineno}", f"no string field {text_field!r}")
                elif not doc.strip():
                    _skip(path, f":{lineno}", "empty document")
                else:
                    yield doc
    except OSError as e:
        raise HlatError(f"{path}: cannot read: {e.strerror or e}") from None
