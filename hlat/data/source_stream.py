"""One source's part of the global row stream: its rows cut by counting from the rounds placed (the same on every
rank), its state where the current shuffle window starts (what a checkpoint holds), and its counters of documents,
bad records, padding and split documents.
"""

from __future__ import annotations

import copy
from dataclasses import dataclass, field
from typing import NamedTuple

import numpy as np

from hlat import HlatError
from hlat.data.exchange import Segment
from hlat.data.records import BadLog
from hlat.data.rounds import ORIGIN, Packing, Position, RoundInfo, SourceSpec


@dataclass
class SourceState:
    """A source where the current shuffle window starts (the first round the window's rows need) and its
    counters: JSON-able as it is, and the same on every rank."""

    round: int = 0  # the first round the rows from here on need
    start: Position = field(default_factory=lambda: list(ORIGIN))  # where that round's records start
    at: int = 0  # where its tokens start in the source's token stream
    rows: int = 0  # rows cut so far: row i is the stream's tokens [i * stride, i * stride + seq_len + 1)
    counted: int = 0  # rounds whose documents and bad records are in the counters
    mid: bool = False  # concat: the next row starts inside a document
    docs: int = 0
    bad: dict[str, int] = field(default_factory=dict)
    docs_epoch: int = 0  # the last epoch a document was read in
    pad: int = 0  # padding targets in the rows cut
    split_docs: int = 0  # documents cut across rows


class PlacedRound(NamedTuple):
    """A round a source's next rows are cut from, and where its tokens start in the source's token stream."""

    at: int
    info: RoundInfo

    @property
    def end(self) -> int:
        return self.at + self.info.size

    def overlaps(self, first: int, end: int) -> bool:
        """Whether tokens [first, end) of the source's token stream include some of this round's."""
        return self.at < end and first < self.end


class SourceStream:
    """One source's part of the stream: its spec, its `state` (and `window_start`, that state where the current
    shuffle window starts: what a checkpoint holds), its bad-record log, and `rounds`, the rounds in use (back
    to back in its token stream, the next row's first). Rows are cut by counting, the same on every rank;
    the DataStream learns the rounds a row needs (`needs_round`, `next_round`) and places them here."""

    def __init__(self, index: int, spec: SourceSpec, packing: Packing, max_bad_fraction: float, warn: bool):
        self.index, self.spec, self.packing, self.max_bad_fraction = index, spec, packing, max_bad_fraction
        self.state = SourceState()
        self.window_start = copy.deepcopy(self.state)
        self.bad_log = BadLog(spec.name, warn)
        self.rounds: list[PlacedRound] = []

    def restore(self, saved: dict) -> None:
        """Resume where a checkpoint's window started (`saved`: a SourceState as a dict)."""
        self.state = SourceState(**saved)
        self.window_start = copy.deepcopy(self.state)
        self.bad_log.counts.update(self.state.bad)

    def start_window(self) -> None:
        """Forget the rounds before the next row, so that the state starts at the first round still needed; that
        is where the current window starts."""
        state = self.state
        while self.rounds and self.rounds[0].end <= self._row_start():
            done = self.rounds.pop(0)
            state.round, state.start, state.at = done.info.index + 1, done.info.end, done.end
        if self.rounds:
            first = self.rounds[0]
            state.round, state.start, state.at = first.info.index, first.info.start, first.at
        self.window_start = copy.deepcopy(state)

    # --- rounds ----------------------------------------------------------------------------------------------

    def needs_round(self) -> bool:
        """Whether the next row runs past the rounds placed."""
        return not self.rounds or self.rounds[-1].end < self._row_start() + self.packing.width

    def next_round(self) -> int:
        """The number of the round to place next."""
        return self.rounds[-1].info.index + 1 if self.rounds else self.state.round

    def place(self, info: RoundInfo) -> None:
        """Append round `next_round()` to the rounds in use, and count it the first time."""
        at = self.rounds[-1].end if self.rounds else self.state.at
        self.rounds.append(PlacedRound(at, info))
        if info.index >= self.state.counted:
            self.state.counted = info.index + 1
            self._count(info)

    def _count(self, info: RoundInfo) -> None:
        """Add a round's documents and bad records to the counters; a whole epoch without a document is an
        error, and so are too many bad records."""
        state = self.state
        state.docs += info.docs
        state.split_docs += info.split_docs
        for bad, where in info.bad:
            self.bad_log.add(bad, where)
        state.bad = dict(self.bad_log.counts)
        if info.docs:
            state.docs_epoch = info.start[0]
        elif info.end[0] >= state.docs_epoch + 2:
            raise HlatError(f"data source {self.spec.name!r}: a whole epoch went by without a readable document")
        self._check_bad_fraction(epoch=info.start[0])

    def _check_bad_fraction(self, epoch: int) -> None:
        """From 100 records on, or after the first epoch: at most data.max_bad_fraction of them may be bad."""
        n_bad = sum(self.state.bad.values())
        records = self.state.docs + n_bad
        if n_bad > self.max_bad_fraction * records and (records >= 100 or epoch > 0):
            reasons = ", ".join(f"{count} {reason}" for reason, count in self.bad_log.counts.most_common())
            raise HlatError(
                f"data source {self.spec.name!r}: {n_bad} of {records} records are bad ({reasons}), "
                f"more than data.max_bad_fraction = {self.max_bad_fraction}"
            )

    # --- rows ------------------------------------------------------------------------------------------------

    def _row_start(self) -> int:
        """Where the next row starts in the token stream."""
        return self.state.rows * self.packing.stride

    def cut_row(self) -> list[Segment]:
        """The next row (its rounds placed), as the slices of rounds it is made of; counts its padding and split
        documents."""
        first = self._row_start()
        end = first + self.packing.width
        segments = [
            Segment(self.index, placed.info.index, max(first, placed.at) - placed.at, min(end, placed.end) - placed.at)
            for placed in self.rounds
            if placed.overlaps(first, end)
        ]
        if self.packing.mode == "best_fit":
            placed = next(placed for placed in self.rounds if placed.at <= first < placed.end)
            self.state.pad += int(placed.info.row_padding[(first - placed.at) // self.packing.width])
        else:
            self._count_split(first, end)
        self.state.rows += 1
        return segments

    def _count_split(self, first: int, end: int) -> None:
        """concat: note whether the row [first, end) ends inside a document, and count that document as split
        (once)."""
        state = self.state
        starts_inside, state.mid = state.mid, not self._eos_count(end - 2, end - 1)
        # the document running into the next row began in this one: count it as split once
        if state.mid and (not starts_inside or self._eos_count(first, end - 2)):
            state.split_docs += 1

    def _eos_count(self, first: int, end: int) -> int:
        """How many EOS tokens (concat) the token stream has in [first, end)."""
        return sum(
            int(
                np.searchsorted(placed.info.eos_at, end - placed.at)
                - np.searchsorted(placed.info.eos_at, first - placed.at)
            )
            for placed in self.rounds
            if placed.overlaps(first, end)
        )

    def counters(self) -> dict[str, int]:
        """Counters of the rows cut so far, for DataStream.stats()."""
        state = self.state
        return {
            "docs": state.docs,
            "bad": sum(state.bad.values()),
            "rows": state.rows,
            "pad": state.pad,
            "split_docs": state.split_docs,
        }
