"""A source's files split among data-parallel ranks (torch-free): big uncompressed JSONL files cut at lines and big
token files at documents, the pieces dealt out in shares of nearly equal bytes, and each epoch's order of a rank's
share.
"""

from __future__ import annotations

import heapq
import math
import random
from dataclasses import dataclass

import numpy as np

from hlat import HlatError
from hlat.data.formats import READERS, File, file_format, file_size, format_reader, token_arrays

# Uncompressed JSONL files are cut into line-aligned byte ranges of at most SPLIT_BYTES, so that a few big files
# still spread over many ranks and evenly; other files are read whole by one rank. Pieces are no smaller than
# MIN_SPLIT_BYTES: inside a piece that starts mid-file, bad records are named by byte offset, not line.
SPLIT_BYTES = 64 << 20
MIN_SPLIT_BYTES = 1 << 20


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
    _, ends = token_arrays(file)
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


def epoch_order(splits: list[Split], seed: int, name: str, epoch: int, shuffle: bool) -> list[Split]:
    order = list(splits)
    if shuffle:
        random.Random(f"{seed}:{name}:{epoch}").shuffle(order)
    return order
