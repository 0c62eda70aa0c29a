"""The records of a split, read from a resumable cursor (torch-free): one reader for each format of formats.py,
and the document each record holds, or why it holds none.
"""

from __future__ import annotations

import gzip
import io
import json
import sys
import zlib
from collections.abc import Iterator

import numpy as np

from hlat.data.formats import File, format_reader, open_file, token_arrays
from hlat.data.records import Bad, BadLog, skipped
from hlat.data.splits import Split

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
    tokens, ends = token_arrays(split.file)
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
