"""The training process's side of the data path: rounds (from worker processes, or made in place) cut into rows,
sources mixed by weight, rows shuffled in windows, each step's rows exchanged among the ranks, batches of
tensors; and the exactly resumable state of it all (`DataStream` states the contract).

A row holds seq_len + 1 tokens: inputs are its first seq_len, targets its last seq_len. `concat` rows are cut
from a source's token stream with one shared token (the last target of a row is the first input of the
next), so no token pair is lost at a row boundary; `best_fit` rows come whole from a round, padded with -1,
which becomes EOS in the inputs and -100 (ignored by cross-entropy) in the targets.

Each source's rows are cut by its `SourceStream` (source_stream.py), from rounds made in place or by worker
processes (workers.py); this module holds what the sources share.
"""

from __future__ import annotations

import hashlib
import json
import logging
import random
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import NamedTuple

import numpy as np
import torch

from hlat import HlatError
from hlat.data.changes import LISTING, file_sizes, fingerprint_changes, split_listing
from hlat.data.config import DataConfig
from hlat.data.exchange import Segment, exchange_rows
from hlat.data.formats import file_format, token_meta
from hlat.data.rounds import MakerSetup, Packing, RoundInfo, SourceSpec
from hlat.data.source_stream import SourceStream
from hlat.data.sources import Source
from hlat.data.splits import make_splits, share_of
from hlat.data.tokenizer import Tokenizer, tokenizer_digest
from hlat.data.workers import InPlace, Workers
from hlat.groups import gather_objects, rank_and_world

log = logging.getLogger(__name__)

IGNORE = -100  # target of a padding position: F.cross_entropy's default ignore_index
# Rounds are learnt in blocks of min(ranks, BLOCK): one all-gather per block, but every rank with a round in
# the block must have made it, so at the start a bigger block would make ranks read further into the data.
BLOCK = 64
STATE_VERSION = 3


def doc_ids_and_positions(inputs: torch.Tensor, eos: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Per token, the index of its document in the row and its position in that document: a document starts
    at the row's start and after each EOS (a piece continued from the previous row counts as one)."""
    starts = torch.ones_like(inputs, dtype=torch.bool)
    starts[:, 1:] = inputs[:, :-1] == eos
    doc_ids = starts.cumsum(1) - 1
    index = torch.arange(inputs.shape[1]).expand_as(inputs)
    first = torch.where(starts, index, 0).cummax(1).values
    return doc_ids, index - first


def rows_to_batch(rows: torch.Tensor, eos: int, doc_mask: bool) -> dict[str, torch.Tensor]:
    """A micro-batch from rows of seq_len + 1 token ids (-1: padding): inputs are each row's first seq_len, targets
    its last seq_len; padding becomes EOS in the inputs and IGNORE in the targets. With `doc_mask`, the
    "doc_ids" and "positions" of the inputs too."""
    pad = rows < 0
    inputs = torch.where(pad[:, :-1], eos, rows[:, :-1])
    batch = {"inputs": inputs, "targets": torch.where(pad[:, 1:], IGNORE, rows[:, 1:])}
    if doc_mask:
        batch["doc_ids"], batch["positions"] = doc_ids_and_positions(inputs, eos)
    return batch


@dataclass
class Ranks:
    """The ranks a global stream is shared by: `group` (the CPU side group of all ranks; None in a single
    process), and which micro-batches this rank trains on: of each step's `accum` micro-batches, those whose
    index is `dp_rank` modulo `dp` (tensor- and pipeline-parallel peers have the same dp_rank)."""

    group: object = None
    dp_rank: int = 0
    dp: int = 1
    accum: int = 1


class Window(NamedTuple):
    """A shuffle window of the global row sequence: its number, and its rows in shuffled order."""

    index: int
    rows: list[list[Segment]]


class DataStream:
    """Endless micro-batches {"inputs", "targets"} (LongTensor [batch_size, seq_len]), plus "positions" and
    "doc_ids" with doc_mask.

    The global row sequence: each source's rounds (rounds.py) are numbered globally, and round k is made by
    rank k mod world (its worker processes tokenize and pack it). Every rank learns every round's size (not its
    tokens), so every rank cuts the same rows, row i of a source being tokens [i * stride, i * stride +
    seq_len + 1) of that source's token stream; mixes sources by weight, and shuffles rows within windows of
    data.shuffle_rows by a permutation seeded with (seed, window): all by counting, never reading tokens. Each
    step (accum micro-batches) one all-to-all sends each row's tokens from the ranks that made them to the
    ranks that train on it. None of this depends on the number of ranks or workers; `state_dict()` between
    steps (the start of the current window, and the rows taken since) is small, the same on every rank, and
    restores the stream at any number of ranks.

    `sources` (a SourceStream each) cut the rows; the stream holds what they share: the rows taken, the current
    window, the rounds learnt but not yet placed, this rank's rounds' tokens and its micro-batches left of the
    step."""

    def __init__(
        self,
        cfg: DataConfig,
        tokenizer: Tokenizer,
        specs: list[SourceSpec],
        seq_len: int,
        batch_size: int,
        fingerprint: dict,
        doc_mask: bool = False,
        ranks: Ranks | None = None,
        shard: tuple[int, int] | None = None,
    ):
        if seq_len < 2 or batch_size < 1:
            raise HlatError(f"data: seq_len must be >= 2 and batch_size >= 1, got {seq_len} and {batch_size}")
        self.cfg, self.tokenizer, self.specs = cfg, tokenizer, specs
        self.seq_len, self.batch_size, self.doc_mask = seq_len, batch_size, doc_mask
        self.fingerprint, self.shard = fingerprint, shard
        self.packing = Packing(cfg.packing, seq_len, cfg.round_bytes, tokenizer.eos_id)
        self.window_size = max(cfg.shuffle_rows, 1)
        total = sum(spec.weight for spec in specs)
        self.weights = [spec.weight / total for spec in specs]
        self.ranks = ranks = ranks or Ranks()
        if ranks.accum % ranks.dp:
            raise HlatError(f"data: {ranks.accum} micro-batches per step cannot be shared by {ranks.dp} ranks")
        self.rank, self.world = rank_and_world(ranks.group)
        dp_ranks = gather_objects(ranks.dp_rank, ranks.group)
        # the ranks that take each data-parallel rank's micro-batches
        self.takers = [{rank for rank, dp_rank in enumerate(dp_ranks) if dp_rank == i} for i in range(ranks.dp)]
        self.wait_time_s = 0.0  # time spent inside __next__: the training loop waiting for data
        self.exchanged_bytes = 0  # token ids received from other ranks
        self.tokenized = 0  # tokens this rank's workers made (padding not counted)
        self._fetcher: InPlace | Workers | None = None
        self._reset()

    def _reset(self) -> None:
        self.close()
        # every rank counts the same bad records: rank 0 warns of them
        self.sources = [
            SourceStream(index, spec, self.packing, self.cfg.max_bad_fraction, warn=self.rank == 0)
            for index, spec in enumerate(self.specs)
        ]
        self.rows_taken = 0  # rows of the global sequence taken (by all ranks together)
        self.taken = [0] * len(self.sources)  # of those, each source's
        self._window: Window | None = None
        self._learnt: dict[tuple[int, int], RoundInfo] = {}  # rounds learnt, not yet placed, by (source, round)
        self._my_tokens: dict[tuple[int, int], np.ndarray] = {}  # the tokens of this rank's rounds in use
        self._batches_left: list[dict[str, torch.Tensor]] = []  # this rank's micro-batches of the step not yet given

    # --- rounds ----------------------------------------------------------------------------------------------

    def _learn(self, source: int, index: int) -> RoundInfo:
        """Round `index` of a source: the ranks that make the rounds of its block make them, and all tell each
        other."""
        if (source, index) not in self._learnt:
            if self._fetcher is None:
                self._start_fetcher()
            block_size = min(self.world, BLOCK)
            block = index - index % block_size
            mine = block + (self.rank - block) % self.world  # this rank's round in the block, if it has one
            made = self._fetcher.get(source, mine) if self._first_rounds[source] <= mine < block + block_size else None
            if made is not None:
                self._my_tokens[source, mine] = made.tokens.reshape(-1)
                self.tokenized += int((made.tokens >= 0).sum())
            for info in gather_objects(made and made.info(), self.ranks.group):
                if info is not None:
                    self._learnt[source, info.index] = info
        return self._learnt.pop((source, index))

    def _start_fetcher(self) -> None:
        """Start making this rank's rounds, from the first round of each source that is neither placed nor learnt
        (its state's round, unless rounds were handed over: `adopt`)."""
        starts = []
        for source in self.sources:
            last = source.rounds[-1].info if source.rounds else None
            index, start = (last.index + 1, last.end) if last else (source.state.round, source.state.start)
            while (source.index, index) in self._learnt:
                index, start = index + 1, self._learnt[source.index, index].end
            starts.append((index, start))
        self._first_rounds = [index for index, _ in starts]  # the fetcher makes none before these
        setup = MakerSetup(self.specs, self.packing, self.tokenizer, starts)
        self._fetcher = Workers(self.cfg.workers, setup, self.rank, self.world) if self.cfg.workers else InPlace(setup)

    # --- rows ------------------------------------------------------------------------------------------------

    def _next_row(self, source: SourceStream) -> list[Segment]:
        """A source's next row, the rounds it needs learnt first."""
        while source.needs_round():
            source.place(self._learn(source.index, source.next_round()))
        return source.cut_row()

    def _mixed_row(self) -> list[Segment]:
        """The next row of the source furthest behind its weight: exact proportions, by counting alone."""
        total = sum(source.state.rows for source in self.sources) + 1
        behind = max(
            self.sources, key=lambda source: (self.weights[source.index] * total - source.state.rows, -source.index)
        )
        return self._next_row(behind)

    def _start_window(self) -> None:
        for source in self.sources:
            source.start_window()

    def _cut_window(self, index: int) -> None:
        """Window `index`: its rows cut, then put in a seeded order that depends only on (seed, index)."""
        self._start_window()
        rows = [self._mixed_row() for _ in range(self.window_size)]
        if self.cfg.shuffle_rows:
            random.Random(f"{self.cfg.seed}:{index}").shuffle(rows)
        self._window = Window(index, rows)

    def _row_at(self, position: int) -> list[Segment]:
        """Row `position` of the global sequence: from the current window, or from the next, cut here."""
        window, offset = divmod(position, self.window_size)
        if self._window is None or self._window.index != window:
            self._cut_window(window)
        return self._window.rows[offset]

    def _step(self) -> None:
        """The next step's rows, exchanged: this rank's micro-batches of it into self._batches_left."""
        ranks, first = self.ranks, self.rows_taken
        rows = [self._row_at(position) for position in range(first, first + ranks.accum * self.batch_size)]
        takers = [self.takers[i // self.batch_size % ranks.dp] for i in range(len(rows))]  # by micro-batch
        mine, received = exchange_rows(rows, takers, self._maker, self._my_tokens, ranks.group)
        self.rows_taken += len(rows)
        for row in rows:  # a row is cut from one source's token stream
            self.taken[row[0].source] += 1
        self.exchanged_bytes += received
        self._forget_tokens()
        for i in range(0, len(mine), self.batch_size):
            batch_rows = torch.from_numpy(np.stack(mine[i : i + self.batch_size])).long()
            self._batches_left.append(rows_to_batch(batch_rows, self.packing.eos, self.doc_mask))

    def _maker(self, segment: Segment) -> int:
        """The rank that made a segment's round, and holds its tokens."""
        return segment.round % self.world

    def _forget_tokens(self) -> None:
        """Drop the tokens of this rank's rounds that are neither in use nor learnt to be placed."""
        in_use = {(source.index, placed.info.index) for source in self.sources for placed in source.rounds}
        keep = in_use | self._learnt.keys()
        self._my_tokens = {key: tokens for key, tokens in self._my_tokens.items() if key in keep}

    def __iter__(self) -> DataStream:
        return self

    def __next__(self) -> dict[str, torch.Tensor]:
        began = time.perf_counter()
        if not self._batches_left:
            self._step()
        self.wait_time_s += time.perf_counter() - began
        return self._batches_left.pop(0)

    # --- state ---------------------------------------------------------------------------------------------

    def state_dict(self) -> dict:
        """The stream's position between steps: where the current window starts and how many rows were taken."""
        if self._batches_left:
            raise RuntimeError("data: state_dict() in the middle of a step (this rank has micro-batches left)")
        if self._window is None or self._window.index != self.rows_taken // self.window_size:
            self._start_window()  # the next step starts a window: its state is the present one
        state = {
            "version": STATE_VERSION,
            "fingerprint": self.fingerprint,
            "rows": self.rows_taken,
            "sources": [asdict(source.window_start) for source in self.sources],
            "taken": list(self.taken),
        }
        return {**state, "shard": list(self.shard)} if self.shard else state

    def load_state_dict(self, state: dict) -> None:
        problem = self._mismatch(state)
        self._reset()
        if problem and self.cfg.force_resume:
            log.warning("data: %s; data.force_resume is set, so the data stream starts afresh", problem)
            return
        if problem:
            raise HlatError(
                f"data: {problem}; resume with the same data settings, or set data.force_resume = true "
                "to start the data stream afresh"
            )
        for source, saved in zip(self.sources, state["sources"]):
            source.restore(saved)
        self.rows_taken = state["rows"]
        self.taken = list(state.get("taken", self.taken))  # a checkpoint from before it counts from this resume

    def rounds_in_hand(self) -> dict:
        """The rounds this stream has learnt and not yet forgotten, and the tokens of those this rank made: what a
        stream of the same ranks that starts at this one's position takes instead of making them again (`adopt`)."""
        infos = {(source.index, placed.info.index): placed.info for source in self.sources for placed in source.rounds}
        return {"infos": infos | self._learnt, "tokens": dict(self._my_tokens)}

    def adopt(self, state: dict, rounds: dict) -> None:
        """Start at `state` (as `load_state_dict`) holding `rounds` (a peer's `rounds_in_hand`, the same rank of a
        stream of as many ranks, at the same position): no round it holds is made again. A source whose first
        round needed is not among them takes none, and makes its rounds from there. Every rank of the stream's
        group adopts its own peer's rounds at once (the peers learnt the same rounds)."""
        self.load_state_dict(state)
        for source in self.sources:
            if (source.index, source.state.round) in rounds["infos"]:
                ours = {
                    key: info
                    for key, info in rounds["infos"].items()
                    if key[0] == source.index and key[1] >= source.state.round
                }
                self._learnt.update(ours)
                self._my_tokens.update({key: t for key, t in rounds["tokens"].items() if key in ours})

    def _mismatch(self, state: dict) -> str:
        if state.get("version") != STATE_VERSION:
            return f"the saved data state has format version {state.get('version')}, this hlat reads {STATE_VERSION}"
        saved = tuple(state.get("shard") or ())
        if saved != (self.shard or ()):
            return (
                f"the checkpoint holds a position in {_stream_of(saved)}, and this run reads "
                f"{_stream_of(self.shard or ())}"
            )
        changed = fingerprint_changes(state["fingerprint"], self.fingerprint)
        return f"the data settings changed since the checkpoint: {'; '.join(changed)}" if changed else ""

    # --- metrics and shutdown ------------------------------------------------------------------------------

    @property
    def worker_pids(self) -> list[int]:
        """Process ids of the running tokenizer workers, for monitoring (none before the first batch)."""
        return [proc.pid for proc in self._fetcher.procs] if self._fetcher else []

    @property
    def epoch(self) -> int:
        """The lowest epoch being read among the sources."""
        return min(source.state.start[0] for source in self.sources)

    def mix(self) -> dict[str, tuple[float, int]]:
        """{source: (its weight's share, the token positions of its rows taken so far)}: every row is seq_len
        positions, padding included (tokens_seen's unit; data_padding_fraction says how much is padding). The same
        on every rank of the global stream; with data_sharding = "files", this rank's own rows."""
        return {
            spec.name: (weight, rows * self.seq_len) for spec, weight, rows in zip(self.specs, self.weights, self.taken)
        }

    def stats(self) -> dict[str, float]:
        """Counters of the rows cut so far (up to a shuffle window ahead of those taken), for inspecting a stream;
        the training metrics do not record them."""
        out: dict[str, float] = {"data_wait_s": round(self.wait_time_s, 4), "data_epoch": self.epoch}
        totals = dict.fromkeys(("docs", "bad", "rows", "pad", "split_docs"), 0)
        for source in self.sources:
            counts = source.counters()
            for name, count in counts.items():
                totals[name] += count
            if len(self.sources) > 1:
                out.update({f"data_{source.spec.name}_{name}": count for name, count in counts.items()})
        out.update({f"data_{name}": count for name, count in totals.items()})
        out["data_padding_fraction"] = totals["pad"] / max(totals["rows"] * self.seq_len, 1)
        out["data_split_fraction"] = totals["split_docs"] / max(totals["docs"], 1)
        return out

    def close(self) -> None:
        """Stop the worker processes (also done at exit); iterating again restarts them."""
        if self._fetcher is not None:
            self._fetcher.close()
            self._fetcher = None


def _stream_of(shard: tuple) -> str:
    """What a stream reads: a data-parallel rank's files (`shard` = (rank, world_size)) or the global stream."""
    return f"the files of data-parallel rank {shard[0]} of {shard[1]}" if shard else "the global stream"


def check_token_files(tokenizer: Tokenizer, digest: str, files: list[Path | str]) -> None:
    """Pre-tokenized files must have been made by the run's tokenizer (`digest`): their ids mean nothing to
    another."""
    for file in files:
        if file_format(str(file)) == "tokens" and (meta := token_meta(file))["tokenizer"] != digest:
            raise HlatError(
                f"token file {file}: written by another tokenizer ({meta['tokenizer_kind']}, vocabulary "
                f"{meta['vocab_size']:,}) than this run's ({tokenizer.kind}, vocabulary "
                f"{tokenizer.vocab_size:,}); set data.tokenizer to the one it was written with"
            )


def build_stream(
    cfg: DataConfig,
    tokenizer: Tokenizer,
    sources: list[Source],
    seq_len: int,
    batch_size: int,
    ranks: Ranks | None = None,
    shard: tuple[int, int] | None = None,
    doc_mask: bool = False,
    holdout: float = 0.0,
) -> DataStream:
    """The configured stream over `sources` (`resolve_sources`: data.sources, or data.paths or the default corpus as
    one source); documents held out for validation (a `holdout` fraction, by hash) are skipped. The global
    stream, shared by `ranks` (a single process when None); or, with `shard` = (rank, world_size),
    data-parallel `rank`'s own stream of its share of the files (data_sharding = "files"). Checks, before any
    training, that every source has a readable document (in this rank's share)."""
    rank, world_size = shard or (0, 1)
    if not 0 <= rank < world_size:
        raise HlatError(f"data: rank {rank} is outside world_size {world_size}")
    specs, fingerprint = [], {"sources": {}, LISTING: {}}
    for source in sources:
        splits = make_splits(source.files, world_size)
        fingerprint[LISTING][source.name] = file_sizes(splits)  # to say which files change
        digest = hashlib.sha256(json.dumps(split_listing(splits)).encode()).hexdigest()[:16]
        fingerprint["sources"][source.name] = {"weight": source.weight, "files": digest}
        mine = share_of(splits, rank, world_size, f"data source {source.name!r}")
        specs.append(
            SourceSpec(
                source.name,
                source.weight,
                mine,
                cfg.text_field,
                cfg.max_doc_bytes,
                cfg.seed,
                cfg.shuffle_files,
                holdout,
            )
        )
    if holdout:  # absent when 0, so checkpoints from before eval.holdout existed still resume
        fingerprint["holdout"] = holdout
    fingerprint.update(
        tokenizer=tokenizer_digest(tokenizer),
        seq_len=seq_len,
        **{
            name: getattr(cfg, name)
            for name in (
                "packing",
                "round_bytes",
                "text_field",
                "max_doc_bytes",
                "seed",
                "shuffle_files",
                "shuffle_rows",
            )
        },
    )
    check_token_files(tokenizer, fingerprint["tokenizer"], [file for source in sources for file in source.files])
    for spec in specs:
        spec.check(f" on data-parallel rank {rank}" if world_size > 1 else "")
    return DataStream(cfg, tokenizer, specs, seq_len, batch_size, fingerprint, doc_mask, ranks, shard)
