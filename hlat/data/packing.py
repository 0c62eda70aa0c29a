"""Pack documents into fixed-length training rows, with an exactly resumable position.

The stream is one endless token sequence: the rank's files in a per-epoch seeded order, each document
followed by EOS, documents never truncated or padded. Row r of the stream is tokens[r*S : r*S + S + 1]
(S = seq_len): consecutive rows share exactly one token, the last target of one row being the first input
of the next, so every token after the first is predicted exactly once and no token pair is lost at a row
boundary.
"""

from __future__ import annotations

import itertools
import random
from collections.abc import Iterator
from pathlib import Path

import torch

from hlat import HlatError
from hlat.data.config import DataConfig
from hlat.data.sources import iter_documents
from hlat.data.tokenizer import Tokenizer

DOCS_PER_ENCODE = 64
CHARS_PER_TOKEN = 4  # rough, only sizes each read-ahead to about what the next batch still needs


class PackedStream:
    """Endless batches {"inputs", "targets"} of LongTensors [batch_size, seq_len]; targets = inputs shifted by 1.

    `state_dict()` after k batches restores a stream whose next batch is batch k+1 of the uninterrupted
    stream. The state holds the epoch, the next document's position (file index in the epoch's order,
    document index in the file) and the tokens already encoded but not yet emitted; restoring skips the
    documents before that position in the current file but never re-reads earlier files.
    """

    def __init__(
        self,
        files: list[Path],
        tokenizer: Tokenizer,
        seq_len: int,
        batch_size: int,
        text_field: str = "text",
        seed: int = 0,
        shuffle_files: bool = True,
        rank: int = 0,
        world_size: int = 1,
    ):
        if seq_len < 1 or batch_size < 1:
            raise HlatError(f"data: seq_len and batch_size must be positive, got {seq_len} and {batch_size}")
        if not 0 <= rank < world_size:
            raise HlatError(f"data: rank {rank} is outside world_size {world_size}")
        if len(files) < world_size:
            raise HlatError(
                f"data: {len(files)} files cannot be shared among {world_size} ranks (each rank reads whole "
                "files, so it needs at least one): split the data into more files"
            )
        self.tokenizer = tokenizer
        self.seq_len, self.batch_size = seq_len, batch_size
        self.text_field, self.seed, self.shuffle_files = text_field, seed, shuffle_files
        self.world_size = world_size
        self._files = list(files)[rank::world_size]  # round-robin over the sorted corpus
        self.load_state_dict(self._state(epoch=0, file_index=0, doc_index=0, buffer=[]))

    def _state(self, epoch: int, file_index: int, doc_index: int, buffer: list[int]) -> dict:
        return {
            "epoch": epoch,
            "file_index": file_index,
            "doc_index": doc_index,
            "buffer": buffer,
            "num_files": len(self._files),
            "world_size": self.world_size,
        }

    def state_dict(self) -> dict:
        return self._state(self.epoch, self._file_index, self._doc_index, list(self._buffer))

    def load_state_dict(self, state: dict) -> None:
        saved = (state["num_files"], state["world_size"])
        if saved != (len(self._files), self.world_size):
            raise HlatError(
                f"data: the saved data position is for {saved[0]} files per rank on {saved[1]} ranks, "
                f"this run has {len(self._files)} files per rank on {self.world_size}: "
                "the corpus or the world size changed"
            )
        self._set_epoch(state["epoch"])
        self._file_index, self._doc_index = state["file_index"], state["doc_index"]
        self._buffer = list(state["buffer"])
        self._docs: Iterator[str] | None = None  # the open document iterator of the current file

    def _set_epoch(self, epoch: int) -> None:
        self.epoch = epoch
        self._order = list(self._files)
        if self.shuffle_files:
            random.Random(f"{self.seed}:{epoch}").shuffle(self._order)

    def _read_documents(self, max_chars: int) -> list[str]:
        docs: list[str] = []
        chars = rollovers_since_doc = 0
        while len(docs) < DOCS_PER_ENCODE and chars < max_chars:
            if self._docs is None:
                path = self._order[self._file_index]
                self._docs = itertools.islice(iter_documents(path, self.text_field), self._doc_index, None)
            doc = next(self._docs, None)
            if doc is not None:
                docs.append(doc)
                chars += len(doc)
                self._doc_index += 1
                rollovers_since_doc = 0
                continue
            self._docs, self._file_index, self._doc_index = None, self._file_index + 1, 0
            if self._file_index == len(self._order):
                rollovers_since_doc += 1
                if rollovers_since_doc == 2:  # a whole epoch went by without one document
                    raise HlatError(f"data: no documents in the {len(self._order)} files of this rank")
                self._file_index = 0
                self._set_epoch(self.epoch + 1)
        return docs

    def __iter__(self) -> "PackedStream":
        return self

    def __next__(self) -> dict[str, torch.Tensor]:
        B, S = self.batch_size, self.seq_len
        while len(self._buffer) < B * S + 1:
            missing = B * S + 1 - len(self._buffer)
            docs = self._read_documents(max_chars=missing * CHARS_PER_TOKEN)
            for ids in self.tokenizer.encode_batch(docs):
                self._buffer.extend(ids)
                self._buffer.append(self.tokenizer.eos_id)
        chunk = torch.tensor(self._buffer[: B * S + 1], dtype=torch.long)
        del self._buffer[: B * S]  # keep the shared token: it starts the next row
        # targets get their own storage, so masking them in place cannot change the inputs
        return {"inputs": chunk[:-1].view(B, S), "targets": chunk[1:].view(B, S).clone()}


class RowShuffle:
    """Draws rows at random from a pool of `pool_rows` packed rows, refilling each drawn slot from the stream.

    A packed stream emits a long file as many consecutive rows; without mixing, whole batches (and their loss)
    come from one file. The pool, the RNG state and the inner stream's position make up the resumable state.
    """

    def __init__(self, rows: PackedStream, pool_rows: int, batch_size: int, seed: int = 0):
        if rows.batch_size != 1:
            raise ValueError("RowShuffle reads its stream one row at a time (batch_size 1)")
        self.rows, self.pool_rows, self.batch_size, self.seed = rows, pool_rows, batch_size, seed
        self._pool: list[torch.Tensor] = []
        self._rng = random.Random(seed)

    def state_dict(self) -> dict:
        version, internal, gauss = self._rng.getstate()
        return {"rows": self.rows.state_dict(), "pool": [row.tolist() for row in self._pool],
                "rng": [version, list(internal), gauss]}

    def load_state_dict(self, state: dict) -> None:
        self.rows.load_state_dict(state["rows"])
        self._pool = [torch.tensor(row, dtype=torch.long) for row in state["pool"]]
        version, internal, gauss = state["rng"]
        self._rng.setstate((version, tuple(internal), gauss))

    def _next_row(self) -> torch.Tensor:
        batch = next(self.rows)
        return torch.cat([batch["inputs"][0], batch["targets"][0, -1:]])

    def __iter__(self) -> "RowShuffle":
        return self

    def __next__(self) -> dict[str, torch.Tensor]:
        while len(self._pool) < self.pool_rows:
            self._pool.append(self._next_row())
        batch = []
        for _ in range(self.batch_size):
            i = self._rng.randrange(self.pool_rows)
            batch.append(self._pool[i])
            self._pool[i] = self._next_row()
        rows = torch.stack(batch)
        return {"inputs": rows[:, :-1], "targets": rows[:, 1:]}


def build_stream(
    cfg: DataConfig,
    tokenizer: Tokenizer,
    files: list[Path],
    seq_len: int,
    batch_size: int,
    rank: int = 0,
    world_size: int = 1,
) -> PackedStream | RowShuffle:
    """The configured stream of {"inputs", "targets"} batches: packed rows, mixed in a pool unless shuffle_rows is 0."""
    rows = PackedStream(
        files,
        tokenizer,
        seq_len,
        1 if cfg.shuffle_rows else batch_size,
        text_field=cfg.text_field,
        seed=cfg.seed,
        shuffle_files=cfg.shuffle_files,
        rank=rank,
        world_size=world_size,
    )
    return RowShuffle(rows, cfg.shuffle_rows, batch_size, seed=cfg.seed) if cfg.shuffle_rows else rows
