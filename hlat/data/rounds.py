"""Rounds: documents read, tokenized and packed together, the unit of work of a tokenizer worker (torch-free,
so worker processes start without importing torch).

A source's records form an endless sequence, epoch after epoch. That sequence is cut into rounds of about
`round_bytes` of raw records (never across an epoch boundary), by sizes alone, so every process cuts it
identically and knows where round k starts without parsing or tokenizing rounds before it. A round's output
depends only on its records; hence the token stream does not depend on which rank or worker makes a round, nor
on how many there are, and a position in it is (round, where the round starts, how far into its tokens).
A round's `info()` is what other processes need to place its rows without its tokens.
"""

from __future__ import annotations

import bisect
import multiprocessing as mp
import os
import signal
import threading
import traceback
from collections import Counter
from collections.abc import Iterator
from dataclasses import dataclass, field
from itertools import chain
from multiprocessing.connection import wait

import numpy as np

from hlat import HlatError
from hlat.data.readers import START, decode, read_split, record_size
from hlat.data.records import Bad, held_out
from hlat.data.splits import Split, epoch_order

Position = list[int]  # [epoch, split index in the epoch's order, offset, line]: where a record starts
ORIGIN: Position = [0, 0, START, 0]  # the first record of epoch 0


@dataclass
class SourceSpec:
    """What a process needs to read one source on one rank."""

    name: str
    weight: float
    splits: list[Split]  # this rank's
    text_field: str = "text"
    max_doc_bytes: int = 100_000_000
    seed: int = 0
    shuffle: bool = True
    holdout: float = 0.0  # documents set aside for validation (eval.holdout) are skipped

    def records(self, position: Position) -> Iterator[tuple[bytes | str | Bad, str, str, Position] | None]:
        """(raw record, format, where, position after it) from `position` on; None marks each epoch's end."""
        epoch, index, offset, line = position
        while True:
            order = epoch_order(self.splits, self.seed, self.name, epoch, self.shuffle)
            seen = False
            for i in range(index, len(order)):
                cursor = (offset, line) if i == index else (START, 0)
                for record, where, (offset_after, line_after) in read_split(
                    order[i], cursor, self.text_field, self.max_doc_bytes
                ):
                    seen = True
                    yield record, order[i].format, where, [epoch, i, offset_after, line_after]
            if not seen and index == 0 and offset == START:
                raise HlatError(f"data source {self.name!r}: no records in its {len(order)} files on this rank")
            epoch, index, offset, line = epoch + 1, 0, START, 0
            yield None

    def check(self, rank_note: str = "") -> None:
        """Raise a clear error, before any training, when no document can be read from this source."""
        bad: Counter[str] = Counter()
        for item in self.records(ORIGIN):
            if item is None:
                counts = ", ".join(f"{n} {reason}" for reason, n in bad.most_common()) or "no records"
                raise HlatError(
                    f"data source {self.name!r}: no documents in its {len(self.splits)} files{rank_note} ({counts})"
                )
            record, fmt, where, _ = item
            doc = decode(record, fmt, self.text_field)
            if not isinstance(doc, Bad):
                return
            bad[doc.reason] += 1


@dataclass
class Packing:
    mode: str  # "concat" | "best_fit"
    seq_len: int
    round_bytes: int
    eos: int

    @property
    def width(self) -> int:
        """Tokens in a row: inputs are its first seq_len, targets its last seq_len."""
        return self.seq_len + 1

    @property
    def stride(self) -> int:
        """Where row i starts in a source's token stream, over i: concat rows share a token with the next,
        best_fit rounds are whole rows already."""
        return self.width if self.mode == "best_fit" else self.seq_len


@dataclass
class Round:
    source: int
    index: int
    start: Position
    end: Position  # where the next round starts
    eos: int
    tokens: np.ndarray  # concat: the documents' tokens, each followed by EOS; best_fit: rows [n, seq_len + 1], -1 pads
    docs: int = 0
    split_docs: int = 0  # best_fit: documents longer than a row, cut into pieces
    bad: list[tuple[Bad, str]] = field(default_factory=list)

    def info(self) -> RoundInfo:
        """What the other ranks need of this round to cut rows and count: its place, size and counters."""
        none = np.zeros(0, dtype=np.int32)
        if self.tokens.ndim == 2:  # best_fit rows
            eos_at, row_padding = none, (self.tokens[:, 1:] < 0).sum(1).astype(np.int32)
        else:
            eos_at, row_padding = np.flatnonzero(self.tokens == self.eos).astype(np.int32), none
        return RoundInfo(
            self.source,
            self.index,
            self.start,
            self.end,
            self.tokens.size,
            eos_at,
            row_padding,
            self.docs,
            self.split_docs,
            self.bad,
        )


@dataclass
class RoundInfo:
    """A round without its tokens: what every rank needs to cut rows from it and count them."""

    source: int
    index: int
    start: Position
    end: Position
    size: int  # its length in the source's token stream (best_fit: rows x (seq_len + 1))
    eos_at: np.ndarray  # concat: where in it the EOS tokens are, ascending (best_fit: empty)
    row_padding: np.ndarray  # best_fit: each row's padding targets (concat: empty)
    docs: int
    split_docs: int
    bad: list[tuple[Bad, str]]


def concat(ids: list[list[int]], eos: int) -> np.ndarray:
    lengths = np.fromiter(map(len, ids), dtype=np.int64, count=len(ids))
    flat = np.fromiter(chain.from_iterable(ids), dtype=np.int32, count=int(lengths.sum()))
    return np.insert(flat, np.cumsum(lengths), eos)


MAX_PIECE_CHARS = 1 << 20  # longer documents are tokenized in pieces of at most this many characters


def text_pieces(text: str) -> Iterator[str]:
    """`text` in pieces of at most MAX_PIECE_CHARS, each cut just before a single space between two words
    where there is one: the pre-tokenizers split there anyway and the space stays with the word after it, so
    the tokens are those of the whole text (a cut inside a run of whitespace would change them)."""
    start = 0
    while start < len(text):
        end = min(start + MAX_PIECE_CHARS, len(text))
        if end < len(text):
            low = start + MAX_PIECE_CHARS // 2
            space = text.rfind(" ", low, end)
            while space > low and (text[space - 1].isspace() or text[space + 1].isspace()):
                space = text.rfind(" ", low, space)
            end = space if space > low else end
        yield text[start:end]
        start = end


def encode_bounded(tokenizer, docs: list[str]) -> list:
    """Token ids of each document; one longer than MAX_PIECE_CHARS is tokenized piece by piece into an int32
    array, so the tokenizer's working memory (and Python's lists of ids) stay bounded whatever its length."""
    ids, short = [], []
    for doc in docs:
        if len(doc) <= MAX_PIECE_CHARS:
            short.append(doc)
            continue
        ids.extend(tokenizer.encode_batch(short) if short else [])
        short = []
        ids.append(
            np.concatenate(
                [np.asarray(tokenizer.encode_batch([piece])[0], dtype=np.int32) for piece in text_pieces(doc)]
            )
        )
    return ids + (tokenizer.encode_batch(short) if short else [])


def best_fit(ids: list[list[int]], eos: int, capacity: int) -> tuple[np.ndarray, int]:
    """Best-fit decreasing: documents (with EOS) longest first, each into the row with the least room that
    still holds it, else a new row. Only documents longer than a row are cut, into row-sized pieces.
    Returns rows [n, capacity] padded with -1 and the number of documents cut."""
    pieces, cut = [], 0
    for doc in ids:
        # a long document is cut into views of one array rather than a Python list of its tokens
        doc = np.append(np.asarray(doc, dtype=np.int32), eos) if len(doc) >= capacity else [*doc, eos]
        cut += len(doc) > capacity
        pieces.extend(doc[i : i + capacity] for i in range(0, len(doc), capacity))
    pieces.sort(key=len, reverse=True)  # stable: equal lengths keep document order
    rooms: list[tuple[int, int]] = []  # (room left, row) of the rows not yet full, sorted
    rows: list[list[list[int]]] = []
    for piece in pieces:
        i = bisect.bisect_left(rooms, (len(piece), -1))
        if i == len(rooms):
            room, row = capacity, len(rows)
            rows.append([])
        else:
            room, row = rooms.pop(i)
        rows[row].append(piece)
        if room > len(piece):
            bisect.insort(rooms, (room - len(piece), row))
    out = np.full((len(rows), capacity), -1, dtype=np.int32)
    for row, row_pieces in enumerate(rows):
        flat = list(chain.from_iterable(row_pieces))
        out[row, : len(flat)] = flat
    return out, cut


def encode(tokenizer, docs: list) -> list:
    """Token ids of each document: texts encoded in one batch, pre-tokenized documents as they are."""
    texts = [doc for doc in docs if isinstance(doc, str)]
    encoded = iter(encode_bounded(tokenizer, texts))
    return [next(encoded) if isinstance(doc, str) else doc for doc in docs]


class RoundMaker:
    """Produces the rounds of one source, in increasing order, skipping those asked of other workers."""

    def __init__(
        self, source: int, spec: SourceSpec, packing: Packing, tokenizer, index: int = 0, position: Position = ORIGIN
    ):
        self.source, self.spec, self.packing, self.tokenizer = source, spec, packing, tokenizer
        self.index, self.position = index, list(position)
        self._records = spec.records(self.position)

    def _take(self) -> tuple[Position, list]:
        """The next round's raw records: at least round_bytes of them, or to the end of the epoch."""
        start, taken, size = self.position, [], 0
        while size < self.packing.round_bytes:
            item = next(self._records)
            if item is None:  # the epoch ended: so does the round, or an empty one starts in the next epoch
                self.position = [self.position[0] + 1, 0, START, 0]
                if taken:
                    break
                start = self.position
                continue
            record, fmt, where, self.position = item
            taken.append((record, fmt, where))
            size += record_size(record)
        self.index += 1
        return start, taken

    def make(self, index: int) -> Round:
        if index < self.index:
            raise RuntimeError(f"round {index} of source {self.spec.name} was asked for after round {self.index}")
        while self.index < index:
            self._take()
        start, records = self._take()
        docs, bad = [], []
        for record, fmt, where in records:
            doc = decode(record, fmt, self.spec.text_field)
            if isinstance(doc, Bad):
                bad.append((doc, where))
            elif not (self.spec.holdout and held_out(doc, self.spec.holdout)):
                docs.append(doc)
        ids = encode(self.tokenizer, docs)
        packing = self.packing
        if packing.mode == "best_fit":
            tokens, cut = best_fit(ids, packing.eos, packing.width)
        else:
            tokens, cut = concat(ids, packing.eos), 0
        return Round(self.source, index, start, list(self.position), packing.eos, tokens, len(docs), cut, bad)


@dataclass
class MakerSetup:
    """What a process (a worker, or the trainer itself) needs to make the rounds of every source: from round
    starts[source] = (its number, where its records start) on."""

    specs: list[SourceSpec]
    packing: Packing
    tokenizer: object
    starts: list[tuple[int, Position]]

    def makers(self) -> list[RoundMaker]:
        return [
            RoundMaker(source, spec, self.packing, self.tokenizer, *self.starts[source])
            for source, spec in enumerate(self.specs)
        ]


def _exit_with_parent(parent) -> None:
    """End this worker as soon as the trainer is gone, however it died (kill -9 included). Checking between
    tasks is not enough: a worker whose results nobody reads blocks for good in its queue's feeder thread."""
    wait([parent.sentinel])
    os._exit(0)


def worker_main(setup: MakerSetup, tasks, results) -> None:
    """A tokenizer worker: answers (source, round) requests in order until it is terminated, or its parent is
    gone. An error is sent back (HlatError as itself, anything else with its traceback) and ends the worker."""
    # Ctrl-C, and the SIGTERM a scheduler sends every process of the job, are for the trainer: it finishes its
    # step (which may need this worker), checkpoints and then stops the workers itself
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    os.environ["TOKENIZERS_PARALLELISM"] = "false"  # one core per worker; scale with more workers
    parent = mp.parent_process()
    if parent is not None:
        threading.Thread(target=_exit_with_parent, args=(parent,), daemon=True).start()
    makers = setup.makers()
    while True:
        source, index = tasks.get()
        try:
            results.put(makers[source].make(index))
        except HlatError as e:
            results.put(e)
            return
        except Exception:
            results.put(RuntimeError(f"data worker failed:\n{traceback.format_exc()}"))
            return
