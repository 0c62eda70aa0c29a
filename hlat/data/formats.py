"""Data files (torch-free): where a file is (a local path, or an fsspec URL: s3://, gs://, https://, when fsspec
and its filesystem are installed; both opened and sized alike), the format its name says, the package each format
needs, and the layout of pre-tokenized token files.

Formats: text files (.txt/.py/.md: one document each), JSON lines (.jsonl, .jsonl.gz, .jsonl.zst: one
document per line, in `text_field`), Parquet (column `text_field`, read row group by row group), Arrow IPC
(.arrow: file or stream format, column `text_field`, record batch by record batch) and pre-tokenized token
files (.tokens.bin: token ids, with their document index and description beside them; `hlat data tokenize`
writes them). readers.py reads each.
"""

from __future__ import annotations

import io
import json
from pathlib import Path

import numpy as np

from hlat import HlatError, optional_import

TEXT_SUFFIXES = (".txt", ".py", ".md")
SUFFIXES = (*TEXT_SUFFIXES, ".jsonl", ".jsonl.gz", ".jsonl.zst", ".parquet", ".arrow", ".tokens.bin")

File = Path | str  # a local path, or an fsspec URL kept as a string


# the package each format needs (dependencies of hlat, imported only when a file of the format is read)
READERS = {"parquet": "pyarrow.parquet", "arrow": "pyarrow.ipc", "jsonl.zst": "zstandard"}


def format_reader(fmt: str, what: str):
    """The module that reads `fmt` files, or one line naming the package to install."""
    return optional_import(READERS[fmt], what, READERS[fmt].split(".")[0])


def file_format(name: str) -> str | None:
    """ "text", "jsonl", "jsonl.gz", "jsonl.zst", "parquet", "arrow" or "tokens"; None for anything else."""
    for suffix in SUFFIXES:
        if name.endswith(suffix):
            return "text" if suffix in TEXT_SUFFIXES else "tokens" if suffix == ".tokens.bin" else suffix[1:]
    return None


def is_url(file: File) -> bool:
    return isinstance(file, str) and "://" in file


def filesystem(url: str):
    """The fsspec filesystem of `url` and the path in it."""
    fsspec = optional_import("fsspec", url, "fsspec (and s3fs for s3://, gcsfs for gs://)")
    try:
        return fsspec.core.url_to_fs(url)
    except (ImportError, ValueError) as e:  # e.g. s3:// without s3fs
        raise HlatError(f"data.paths: cannot open {url!r}: {e}") from None


def file_size(file: File) -> int:
    if is_url(file):
        fs, path = filesystem(file)
        return fs.size(path)
    return Path(file).stat().st_size


def open_file(file: File) -> io.BufferedIOBase:
    if is_url(file):
        fs, path = filesystem(file)
        return fs.open(path, "rb")
    return open(file, "rb")


# --- pre-tokenized token files ---------------------------------------------------------------------------
# NAME.tokens.bin: every document's token ids back to back (uint16, or uint32 for vocabularies over 65,536);
# NAME.tokens.idx.npy: where each document ends (int64, cumulative); NAME.tokens.json: the dtype, counts and
# the tokenizer (digest, as `tokenizer_digest`) that made them. Written last, so a file without it is unfinished.


def token_sidecar(file: File, suffix: str) -> File:
    """NAME.tokens.idx.npy or NAME.tokens.json for NAME.tokens.bin."""
    name = str(file)[: -len(".bin")] + suffix
    return name if is_url(file) else Path(name)


def token_meta(file: File) -> dict:
    """The description of a token file; a clear error when it is missing or unreadable."""
    meta = token_sidecar(file, ".json")
    try:
        with open_file(meta) as f:
            return json.load(f)
    except (OSError, ValueError) as e:
        raise HlatError(
            f"token file {file}: cannot read its description {meta} ({e}); write token files with `hlat data tokenize`"
        ) from None


def token_arrays(file: File):
    """The token ids (memory-mapped when local) and the document ends of a token file."""
    dtype = np.dtype(token_meta(file)["dtype"])
    if is_url(file):
        with open_file(file) as f:
            tokens = np.frombuffer(f.read(), dtype=dtype)
        with open_file(token_sidecar(file, ".idx.npy")) as f:
            ends = np.load(io.BytesIO(f.read()))
    else:
        tokens = np.memmap(file, dtype=dtype, mode="r")
        ends = np.load(token_sidecar(file, ".idx.npy"), mmap_mode="r")
    if len(ends) and ends[-1] != len(tokens):
        raise EOFError(f"its index ends at token {ends[-1]}, the file holds {len(tokens)}")
    return tokens, ends
