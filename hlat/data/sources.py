"""Where documents come from (torch-free): the default corpus, user paths and named sources, the split of the
files among data-parallel ranks, and the records of a file read from a resumable cursor.

A file is local or an fsspec URL (s3://, gs://, https://, when fsspec and its filesystem are installed).
Formats: text files (.txt/.py/.md: one document each), JSON lines (.jsonl, .jsonl.gz, .jsonl.zst: one
document per line, in `text_field`), Parquet (column `text_field`, read row group by row group), Arrow IPC
(.arrow: file or stream format, column `text_field`, record batch by record batch) and pre-tokenized token
files (.tokens.bin: token ids, with their document index and description beside them; `hlat data tokenize`
writes them).
"""

from __future__ import annotations

import glob
import gzip
import hashlib
import heapq
import io
import json
import logging
import math
import os
import random
import sys
import sysconfig
import zlib
from collections import Counter
from collections.abc import Callable, Collection, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import NamedTuple

import numpy as np

from hlat import HlatError, optional_import
from hlat.data.config import DataConfig

TEXT_SUFFIXES = (".txt", ".py", ".md")
SUFFIXES = (*TEXT_SUFFIXES, ".jsonl", ".jsonl.gz", ".jsonl.zst", ".parquet", ".arrow", ".tokens.bin")
# Uncompressed JSONL files are cut into line-aligned byte ranges of at most SPLIT_BYTES, so that a few big files
# still spread over many ranks and evenly; other files are read whole by one rank. Pieces are no smaller than
# MIN_SPLIT_BYTES: inside a piece that starts mid-file, bad records are named by byte offset, not line.
SPLIT_BYTES = 64 << 20
MIN_SPLIT_BYTES = 1 << 20

log = logging.getLogger(__name__)

File = Path | str  # a local path, or an fsspec URL kept as a string


# --- finding files ---------------------------------------------------------------------------------------


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


def _fs(url: str):
    fsspec = optional_import("fsspec", url, "fsspec (and s3fs for s3://, gcsfs for gs://)")
    try:
        return fsspec.core.url_to_fs(url)
    except (ImportError, ValueError) as e:  # e.g. s3:// without s3fs
        raise HlatError(f"data.paths: cannot open {url!r}: {e}") from None


def file_size(file: File) -> int:
    if is_url(file):
        fs, path = _fs(file)
        return fs.size(path)
    return Path(file).stat().st_size


def open_file(file: File) -> io.BufferedIOBase:
    if is_url(file):
        fs, path = _fs(file)
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


def _token_arrays(file: File):
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
    fs, path = _fs(pattern)
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


# --- splitting among ranks -------------------------------------------------------------------------------


@dataclass(frozen=True)
class Split:
    """A file, or for uncompressed JSONL the lines starting in the byte range [start, stop) of it, or for a
    token file its documents [start, stop)."""

    file: File
    size: int
    start: int = 0
    stop: int = -1  # -1: to the end of the file

    @property
    def format(self) -> str:
        return file_format(str(self.file)) or "text"


def _size_or_zero(file: File) -> int:
    try:
        return file_size(file)
    except OSError:  # gone since it was listed: reading it will count it as unreadable
        return 0


def make_splits(files: list[File], world_size: int) -> list[Split]:
    """Files as splits, uncompressed JSONL (at lines) and token files (at documents) cut into pieces of at most
    SPLIT_BYTES, and smaller ones (down to MIN_SPLIT_BYTES) when the data would not otherwise give every rank a
    couple of them."""
    sizes = {file: _size_or_zero(file) for file in files}
    for fmt in {file_format(str(file)) for file in files} & READERS.keys():
        format_reader(fmt, f"reading .{fmt} files")
    piece = min(SPLIT_BYTES, max(MIN_SPLIT_BYTES, sum(sizes.values()) // (2 * world_size)))
    splits = []
    for file, size in sizes.items():
        fmt = file_format(str(file))
        if fmt not in ("jsonl", "tokens") or size <= piece:
            splits.append(Split(file, size))
            continue
        cuts = list(range(0, size, math.ceil(size / math.ceil(size / piece)))) + [size]  # byte offsets
        if fmt == "tokens":
            splits.extend(_token_file_splits(file, size, cuts))
        else:
            splits.extend(Split(file, stop - start, start, stop) for start, stop in zip(cuts, cuts[1:]))
    return splits


def _token_file_splits(file: File, size: int, cuts: list[int]) -> list[Split]:
    """A token file cut near the byte offsets `cuts` (0 and `size` first and last): pieces of whole documents,
    each cut at the first document that ends past the offset."""
    _, ends = _token_arrays(file)
    itemsize = size // max(int(ends[-1]), 1) if len(ends) else 1
    firsts = np.searchsorted(ends, [cut // itemsize for cut in cuts[1:-1]], "right").tolist()  # ints, not numpy's
    docs = sorted({0, len(ends), *firsts})
    offsets = [int(ends[doc - 1]) * itemsize if doc else 0 for doc in docs]  # where each of those starts
    return [
        Split(file, stop_byte - start_byte, first, stop)
        for first, stop, start_byte, stop_byte in zip(docs, docs[1:], offsets, offsets[1:])
        if stop > first
    ]


def share_of(splits: list[Split], rank: int, world_size: int, what: str) -> list[Split]:
    """The splits of `rank`: largest first to the least loaded rank, so ranks get disjoint shares of nearly
    equal bytes; in file order."""
    if len(splits) < world_size:
        raise HlatError(
            f"{what}: {len(splits)} files cannot be shared among {world_size} data-parallel ranks "
            "(only uncompressed JSONL files are split; others are read whole by one rank): split the data "
            "into more files"
        )
    loads = [(0, owner) for owner in range(world_size)]
    mine = []
    for split in sorted(splits, key=lambda s: (-s.size, str(s.file), s.start)):
        load, owner = heapq.heappop(loads)
        heapq.heappush(loads, (load + split.size, owner))
        if owner == rank:
            mine.append(split)
    return sorted(mine, key=lambda s: (str(s.file), s.start))


# --- records ---------------------------------------------------------------------------------------------


class Bad(NamedTuple):
    """A record that is not a document; `reason` is counted, `detail` only shown."""

    reason: str
    detail: str = ""


Cursor = tuple[int, int]  # within a split: (offset, line); offset START = not yet read, END = nothing left
START, END = -1, -2


def where(split: Split, offset: int, line: int) -> str:
    """file:line, or file and byte offset inside a split whose line numbers are not known."""
    if split.format in ("parquet", "arrow"):
        return f"{split.file} row {line}"
    if split.format == "tokens":
        return f"{split.file} document {offset}"
    return f"{split.file}:{line}" if line else f"{split.file} byte {offset}"


class _ZstdReader(io.RawIOBase):
    """A zstd stream as a file (any number of frames) that raises EOFError if the data stops inside a frame:
    zstandard's own stream reader silently ends a truncated file."""

    def __init__(self, raw: io.BufferedIOBase):
        self._zstd = format_reader("jsonl.zst", "reading .jsonl.zst files")
        self._raw, self._out = raw, b""
        self._decompressor = self._zstd.ZstdDecompressor().decompressobj()

    def readable(self) -> bool:
        return True

    def readinto(self, buffer) -> int:
        while not self._out:
            chunk = self._decompressor.unused_data or self._raw.read(1 << 20)
            if not chunk:
                if not self._decompressor.eof:
                    raise EOFError("zstd data ends inside a frame")
                return 0
            if self._decompressor.eof:  # the next frame
                self._decompressor = self._zstd.ZstdDecompressor().decompressobj()
            self._out = self._decompressor.decompress(chunk)
        n = min(len(buffer), len(self._out))
        buffer[:n], self._out = self._out[:n], self._out[n:]
        return n

    def close(self) -> None:
        self._raw.close()
        super().close()


def _corrupt_errors() -> tuple[type[BaseException], ...]:
    """What reading a damaged file raises; evaluated only when something was raised, so the optional
    packages are looked up only if they were loaded to read the file."""
    errors: tuple[type[BaseException], ...] = (EOFError, OSError, zlib.error)
    for module, name in (("zstandard", "ZstdError"), ("pyarrow", "ArrowException")):
        loaded = sys.modules.get(module)
        if loaded is not None:  # None: never loaded, blocked, or torn down at exit (a generator closed then)
            errors += (getattr(loaded, name),)
    return errors


def _rest_of_line(f: io.BufferedIOBase) -> int:
    """Skip to the start of the next line, never holding a long line whole; the number of bytes skipped."""
    n = 0
    while chunk := f.readline(1 << 20):
        n += len(chunk)
        if chunk.endswith(b"\n"):
            break
    return n


def _skip(f: io.BufferedIOBase, n: int) -> None:
    if f.seekable():
        f.seek(n)  # gzip decompresses up to it; nothing is parsed
    else:
        while n > 0 and (chunk := f.read(min(n, 1 << 20))):
            n -= len(chunk)


def _jsonl_lines(split: Split, f: io.BufferedIOBase, cursor: Cursor, max_bytes: int):
    offset, line = cursor
    if offset == START:  # its first line is the first that starts at or after `split.start`
        offset, line = split.start, int(split.start == 0)
        if offset:
            _skip(f, offset - 1)
            offset += _rest_of_line(f) - 1
    elif offset:
        _skip(f, offset)
    while split.stop < 0 or offset < split.stop:
        data = f.readline(max_bytes + 1)
        if not data:
            return
        start, start_line = offset, line
        offset += len(data)
        line += bool(line)
        if len(data) > max_bytes and not data.endswith(b"\n"):
            offset += _rest_of_line(f)
            data = Bad(f"document over {max_bytes} bytes")
        elif not data.strip():
            continue  # a blank line is no record at all
        yield data, where(split, start, start_line), (offset, line)


def _column_rows(split: Split, schema, chunks, cursor: Cursor, text_field: str):
    """The `text_field` values of a table read in chunks: (rows, load) for each, load() giving the column."""
    pa = sys.modules["pyarrow"]
    kind = "Parquet" if split.format == "parquet" else "Arrow"
    field = schema.field(text_field) if text_field in schema.names else None
    if field is None:
        yield Bad(f"{kind} file with no column {text_field!r}"), str(split.file), (END, 0)
        return
    if not (pa.types.is_string(field.type) or pa.types.is_large_string(field.type)):
        yield Bad(f"{kind} column {text_field!r} is not text", str(field.type)), str(split.file), (END, 0)
        return
    first = max(cursor[0], 0)
    row = 0
    for n, load in chunks:
        if row + n > first:
            values = load().to_pylist()
            for i in range(max(first - row, 0), n):
                value = values[i]
                record = value if value is not None else Bad(f"no string field {text_field!r}")
                yield record, where(split, 0, row + i + 1), (row + i + 1, 0)
        row += n


def _parquet_rows(split: Split, f: io.BufferedIOBase, cursor: Cursor, text_field: str):
    pq = format_reader("parquet", f"Parquet file {split.file}")
    pf = pq.ParquetFile(f)
    chunks = (
        (pf.metadata.row_group(g).num_rows, lambda g=g: pf.read_row_group(g, columns=[text_field]).column(0))
        for g in range(pf.num_row_groups)
    )
    yield from _column_rows(split, pf.schema_arrow, chunks, cursor, text_field)


def _arrow_rows(split: Split, f: io.BufferedIOBase, cursor: Cursor, text_field: str):
    """An Arrow IPC file (random access: batches before the cursor are not read) or stream (as written by HF
    datasets: read through)."""
    ipc = format_reader("arrow", f"Arrow file {split.file}")
    pa = sys.modules["pyarrow"]
    try:
        reader = ipc.open_file(f)
        batches = (reader.get_batch(i) for i in range(reader.num_record_batches))
    except pa.ArrowInvalid:  # not the file format: the stream format
        f.seek(0)
        reader = ipc.open_stream(f)
        batches = iter(reader)
    chunks = ((b.num_rows, lambda b=b: b.column(text_field)) for b in batches)
    yield from _column_rows(split, reader.schema, chunks, cursor, text_field)


def _token_docs(split: Split, f: io.BufferedIOBase, cursor: Cursor, text_field: str):
    tokens, ends = _token_arrays(split.file)
    stop = len(ends) if split.stop < 0 else split.stop
    for i in range(max(cursor[0], split.start), stop):
        first = int(ends[i - 1]) if i else 0
        yield np.array(tokens[first : ends[i]], dtype=np.int32), where(split, i, 0), (i + 1, 0)


_TABLES = {"parquet": _parquet_rows, "arrow": _arrow_rows, "tokens": _token_docs}  # records by row or document


def read_split(split: Split, cursor: Cursor, text_field: str, max_bytes: int):
    """The records of a split from `cursor`: (raw record, where, cursor after it). A raw record is the bytes of
    a text file or JSON line, the str of a Parquet or Arrow value, the token ids (int32) of a pre-tokenized
    document, or a Bad. An unreadable, truncated or corrupt
    file ends with a Bad record whose cursor is END, so that reading on from any cursor meets the same
    records as reading through."""
    fmt = split.format
    if cursor[0] == END:
        return
    try:
        f = open_file(split.file)
    except OSError as e:
        yield Bad("unreadable file", e.strerror or str(e)), str(split.file), (END, 0)
        return
    at = cursor
    try:
        with f:
            if fmt == "text":
                too_big = f.seek(0, io.SEEK_END) > max_bytes
                f.seek(0)
                yield (Bad(f"document over {max_bytes} bytes") if too_big else f.read()), str(split.file), (END, 0)
            elif fmt in _TABLES:
                for record in _TABLES[fmt](split, f, cursor, text_field):
                    at = record[2]
                    yield record
            else:
                stream = {
                    "jsonl": lambda: f,
                    "jsonl.gz": lambda: gzip.GzipFile(fileobj=f),
                    "jsonl.zst": lambda: io.BufferedReader(_ZstdReader(f)),
                }[fmt]()
                for record in _jsonl_lines(split, stream, cursor, max_bytes):
                    at = record[2]
                    yield record
    except _corrupt_errors() as e:
        place = where(split, *at) if at[0] >= 0 else str(split.file)
        yield Bad("truncated or corrupt file", str(e)), place, (END, 0)


def decode(record: bytes | str | np.ndarray | Bad, fmt: str, text_field: str) -> str | np.ndarray | Bad:
    """The document of a raw record (text, or the token ids of a pre-tokenized one), or why it is not one."""
    if isinstance(record, Bad):
        return record
    if isinstance(record, np.ndarray):
        return record if len(record) else Bad("empty document")
    if isinstance(record, bytes):
        try:
            text = record.decode("utf-8")
        except UnicodeDecodeError:
            return Bad("invalid UTF-8")
        if fmt != "text":
            try:
                obj = json.loads(text)
            except ValueError:
                return Bad("malformed JSON")
            text = obj.get(text_field) if isinstance(obj, dict) else None
            if not isinstance(text, str):
                return Bad(f"no string field {text_field!r}")
    else:
        text = record
    return text if text.strip() else Bad("empty document")


class BadLog:
    """Counts bad records by reason and logs a warning naming the place at the 1st, 10th, 100th... of each
    (unless `warn` is off: where another process warns of the same records)."""

    def __init__(self, name: str = "", warn: bool = True):
        self.counts: Counter[str] = Counter()
        self.prefix = f"data source {name!r}: " if name else ""
        self.warn = warn

    def add(self, bad: Bad, place: str) -> None:
        self.counts[bad.reason] += 1
        n = self.counts[bad.reason]
        if self.warn and str(n).rstrip("0") == "1":
            detail = f" ({bad.detail})" if bad.detail else ""
            log.warning(
                "%sskipped a bad record (%s%s) at %s; %d skipped for this reason so far",
                self.prefix,
                bad.reason,
                detail,
                place,
                n,
            )


# Bad records met by iter_documents since the process started (tokenizer sampling, `hlat data inspect`).
skipped = BadLog()


def record_size(record: bytes | str | np.ndarray | Bad) -> int:
    """What a record counts towards data.round_bytes: its bytes (characters of a Parquet or Arrow value, 4 per
    token of a pre-tokenized document, about what its text took), 1 for a bad record."""
    return 1 if isinstance(record, Bad) else 4 * len(record) if isinstance(record, np.ndarray) else len(record)


def iter_documents(
    file: File, text_field: str = "text", max_bytes: int = 100_000_000, bad: BadLog = skipped
) -> Iterator[str | np.ndarray]:
    """The documents of one file; bad records are skipped and counted in `bad`."""
    split = Split(file, 0)
    for record, place, _ in read_split(split, (START, 0), text_field, max_bytes):
        doc = decode(record, split.format, text_field)
        if isinstance(doc, Bad):
            bad.add(doc, place)
        else:
            yield doc


def held_out(doc, fraction: float) -> bool:
    """Whether a document (text, or a token file's ids) belongs to the validation split (eval.holdout): decided by
    a hash of its content alone, so the split is the same on every rank, in every run and whatever the file
    order."""
    data = doc.encode("utf-8", "surrogatepass") if isinstance(doc, str) else doc.tobytes()  # or token ids
    digest = hashlib.blake2b(data, digest_size=8).digest()
    return int.from_bytes(digest, "big") < fraction * 2**64


def epoch_order(splits: list[Split], seed: int, name: str, epoch: int, shuffle: bool) -> list[Split]:
    order = list(splits)
    if shuffle:
        random.Random(f"{seed}:{name}:{epoch}").shuffle(order)
    return order
