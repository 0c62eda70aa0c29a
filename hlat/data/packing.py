"""The training process's side of the data path: rounds (from worker processes, or made in place) cut into rows,
sources mixed by weight, rows shuffled in windows, each step's rows exchanged among the ranks, batches of
tensors; and the exactly resumable state of it all (`DataStream` states the contract).

A row holds seq_len + 1 tokens: inputs are its first seq_len, targets its last seq_len. `concat` rows are cut
from a source's token stream with one shared token (the last target of a row is the first input of the
next), so no token pair is lost at a row boundary; `best_fit` rows come whole from a round, padded with -1,
which becomes EOS in the inputs and -100 (ignored by cross-entropy) in the targets.
"""

from __future__ import annotations

import copy
import hashlib
import json
import logging
import multiprocessing as mp
import queue
import random
import time
import weakref
from dataclasses import asdict, dataclass, field
from pathlib import Path

import numpy as np
import torch
import torch.distributed as dist

from hlat import HlatError
from hlat.data.changes import LISTING, fingerprint_changes, split_listing
from hlat.data.config import DataConfig
from hlat.data.exchange import Segment, all_gather, exchange_rows
from hlat.data.rounds import ORIGIN, Packing, Position, Round, RoundInfo, RoundMaker, SourceSpec, worker_main
from hlat.data.sources import BadLog, Source, file_format, make_splits, share_of, token_meta
from hlat.data.tokenizer import Tokenizer, tokenizer_digest

log = logging.getLogger(__name__)

IGNORE = -100  # target of a padding position: F.cross_entropy's default ignore_index
PREFETCH = 2  # rounds requested ahead per source and worker
# Rounds are learnt in blocks of min(ranks, BLOCK): one all-gather per block, but every rank with a round in
# the block must have made it, so at the start a bigger block would make ranks read further into the data.
BLOCK = 64
STATE_VERSION = 3

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


class _Inline:
    """Rounds made in the training process (data.workers = 0)."""

    procs: list = []

    def __init__(self, specs, packing, tokenizer, starts, offset=0, stride=1):
        self.makers = [RoundMaker(s, spec, packing, tokenizer, *starts[s]) for s, spec in enumerate(specs)]

    def get(self, source: int, index: int) -> Round:
        return self.makers[source].make(index)

    def close(self) -> None:
        pass


def _stop_workers(procs) -> None:
    for p in procs:
        p.kill()  # they hold nothing to clean up, ignore SIGTERM, and may be busy with rounds nobody will read
    for p in procs:
        p.join(timeout=5)


class _Workers:
    """Worker processes (spawned: safe after CUDA and threads). This rank makes rounds offset, offset + stride,
    ... of every source; the j-th of them goes to worker j % n, which makes its rounds in order. Each source
    keeps PREFETCH rounds per worker requested ahead."""

    def __init__(self, n, specs, packing, tokenizer, starts, offset=0, stride=1):
        ctx = mp.get_context("spawn")
        self.n, self.offset, self.stride = n, offset, stride
        self.tasks = [ctx.Queue() for _ in range(n)]
        self.results = [ctx.Queue() for _ in range(n)]
        self.procs = [ctx.Process(target=worker_main, args=(specs, packing, tokenizer, starts, t, r), daemon=True,
                                  name=f"hlat-data-{i}") for i, (t, r) in enumerate(zip(self.tasks, self.results))]
        for p in self.procs:
            p.start()
        for q in self.tasks:
            q.cancel_join_thread()  # never block the process's exit on a dead worker's queue
        self.requested = [max(0, -((offset - index) // stride)) for index, _ in starts]  # this rank's next, per source
        self.ready: dict[tuple[int, int], Round] = {}
        self._stop = weakref.finalize(self, _stop_workers, self.procs)  # also run at exit

    def get(self, source: int, index: int) -> Round:
        j = (index - self.offset) // self.stride
        while self.requested[source] < j + PREFETCH * self.n:
            k = self.requested[source]
            self.tasks[k % self.n].put((source, self.offset + k * self.stride))
            self.requested[source] += 1
        worker = j % self.n
        while (source, index) not in self.ready:
            try:
                result = self.results[worker].get(timeout=1.0)
            except queue.Empty:
                if not self.procs[worker].is_alive():
                    raise HlatError(f"data worker {worker} died (exit code {self.procs[worker].exitcode})") from None
                continue
            if isinstance(result, BaseException):
                raise result
            self.ready[result.source, result.index] = result
        return self.ready.pop((source, index))

    def close(self) -> None:
        self._stop()


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
    restores the stream at any number of ranks."""

    def __init__(self, cfg: DataConfig, tokenizer: Tokenizer, specs: list[SourceSpec], seq_len: int,
                 batch_size: int, fingerprint: dict, doc_mask: bool = False, ranks: Ranks | None = None,
                 shard: tuple[int, int] | None = None):
        if seq_len < 2 or batch_size < 1:
            raise HlatError(f"data: seq_len must be >= 2 and batch_size >= 1, got {seq_len} and {batch_size}")
        self.cfg, self.tokenizer, self.specs = cfg, tokenizer, specs
        self.seq_len, self.batch_size, self.doc_mask = seq_len, batch_size, doc_mask
        self.fingerprint, self.shard = fingerprint, shard
        self.packing = Packing(cfg.packing, seq_len, cfg.round_bytes, tokenizer.eos_id)
        self.width = seq_len + 1
        self.stride = self.width if cfg.packing == "best_fit" else seq_len  # concat rows share a token
        self.window = max(cfg.shuffle_rows, 1)
        total = sum(spec.weight for spec in specs)
        self.weights = [spec.weight / total for spec in specs]
        self.ranks = ranks = ranks or Ranks()
        if ranks.accum % ranks.dp:
            raise HlatError(f"data: {ranks.accum} micro-batches per step cannot be shared by {ranks.dp} ranks")
        group = ranks.group
        self.rank, self.world = (dist.get_rank(group), dist.get_world_size(group)) if group else (0, 1)
        dp_ranks = all_gather(ranks.dp_rank, group)
        self.takers = [{r for r, d in enumerate(dp_ranks) if d == i} for i in range(ranks.dp)]
        self.wait_time_s = 0.0  # time spent inside __next__: the training loop waiting for data
        self.exchanged_bytes = 0  # token ids received from other ranks
        self.tokenized = 0  # tokens this rank's workers made (padding not counted)
        self._fetcher: _Inline | _Workers | None = None
        self._reset()

    def _reset(self) -> None:
        self.close()
        self.state = [SourceState() for _ in self.specs]
        self.bad = [BadLog(spec.name, warn=self.rank == 0) for spec in self.specs]  # all ranks count the same
        self.emitted = 0  # rows of the global sequence taken (by all ranks together)
        self._snapshot = copy.deepcopy(self.state)  # the state where the current window starts
        self._window: tuple[int, list] | None = None  # (index, its rows' segments in shuffled order)
        self._tables: list[list[tuple[int, RoundInfo]]] = [[] for _ in self.specs]  # (at, round) per source
        self._infos: dict[tuple[int, int], RoundInfo] = {}  # rounds learnt, not yet in a table
        self._tokens: dict[tuple[int, int], np.ndarray] = {}  # the tokens of this rank's rounds in use
        self._batches: list[dict[str, torch.Tensor]] = []  # this rank's micro-batches of the step not yet given

    # --- rounds ----------------------------------------------------------------------------------------------

    def _learn(self, s: int, k: int) -> RoundInfo:
        """Round k of source s: the ranks that make the rounds of k's block make them, and all tell each other."""
        if (s, k) not in self._infos:
            if self._fetcher is None:
                starts = [(st.round, st.start) for st in self.state]
                self._first = [st.round for st in self.state]  # the first rounds the fetcher can make
                args = (self.specs, self.packing, self.tokenizer, starts, self.rank, self.world)
                self._fetcher = _Workers(self.cfg.workers, *args) if self.cfg.workers else _Inline(*args)
            size = min(self.world, BLOCK)
            first = k - k % size
            mine = first + (self.rank - first) % self.world  # this rank's round in the block, if it has one
            made = self._fetcher.get(s, mine) if self._first[s] <= mine < first + size else None
            if made is not None:
                self._tokens[s, mine] = made.tokens.reshape(-1)
                self.tokenized += int((made.tokens >= 0).sum())
            for info in all_gather(made and made.info(), self.ranks.group):
                if info is not None:
                    self._infos[s, info.index] = info
        return self._infos.pop((s, k))

    def _extend(self, s: int) -> None:
        """Append source s's next round to its table (and count it, the first time)."""
        st, table = self.state[s], self._tables[s]
        k, at = (table[-1][1].index + 1, table[-1][0] + table[-1][1].size) if table else (st.round, st.at)
        info = self._learn(s, k)
        table.append((at, info))
        if k >= st.counted:
            st.counted = k + 1
            self._count(s, info)

    def _count(self, s: int, r: RoundInfo) -> None:
        st, spec, bad = self.state[s], self.specs[s], self.bad[s]
        st.docs += r.docs
        st.split_docs += r.split_docs
        for b, where in r.bad:
            bad.add(b, where)
        st.bad = dict(bad.counts)
        if r.docs:
            st.docs_epoch = r.start[0]
        elif r.end[0] >= st.docs_epoch + 2:
            raise HlatError(f"data source {spec.name!r}: a whole epoch went by without a readable document")
        n_bad = sum(st.bad.values())
        records = st.docs + n_bad
        if n_bad > self.cfg.max_bad_fraction * records and (records >= 100 or r.start[0] > 0):
            reasons = ", ".join(f"{n} {reason}" for reason, n in bad.counts.most_common())
            raise HlatError(f"data source {spec.name!r}: {n_bad} of {records} records are bad ({reasons}), more "
                            f"than data.max_bad_fraction = {self.cfg.max_bad_fraction}")

    def _eos(self, s: int, a: int, b: int) -> int:
        """How many EOS tokens (concat) source s's stream has in [a, b)."""
        return sum(int(np.searchsorted(info.marks, b - at) - np.searchsorted(info.marks, a - at))
                   for at, info in self._tables[s] if at < b and a < at + info.size)

    # --- rows ------------------------------------------------------------------------------------------------

    def _row(self, s: int) -> list[Segment]:
        """Source s's next row, as the slices of rounds it is made of; counts its padding and split documents."""
        st, width = self.state[s], self.width
        p = st.rows * self.stride
        table = self._tables[s]
        while not table or table[-1][0] + table[-1][1].size < p + width:
            self._extend(s)
        segments = [(s, info.index, max(p, at) - at, min(p + width, at + info.size) - at)
                    for at, info in table if at < p + width and p < at + info.size]
        if self.packing.mode == "best_fit":
            at, info = next((at, info) for at, info in table if at <= p < at + info.size)
            st.pad += int(info.marks[(p - at) // width])
        else:
            starts_mid, st.mid = st.mid, not self._eos(s, p + width - 2, p + width - 1)
            # the document running into the next row began in this one: count it as split once
            if st.mid and (not starts_mid or self._eos(s, p, p + width - 2)):
                st.split_docs += 1
        st.rows += 1
        return segments

    def _mixed_row(self) -> list[Segment]:
        """The next row of the source furthest behind its weight: exact proportions, by counting alone."""
        total = sum(st.rows for st in self.state) + 1
        s = max(range(len(self.specs)), key=lambda i: (self.weights[i] * total - self.state[i].rows, -i))
        return self._row(s)

    def _trim(self) -> None:
        """Forget the rounds before every source's next row; the state then starts at the first round needed."""
        for st, table in zip(self.state, self._tables):
            p = st.rows * self.stride
            while table and table[0][0] + table[0][1].size <= p:
                at, info = table.pop(0)
                st.round, st.start, st.at = info.index + 1, info.end, at + info.size
            if table:
                st.round, st.start, st.at = table[0][1].index, table[0][1].start, table[0][0]

    def _cut_window(self, w: int) -> None:
        """Window w: its rows cut, then put in a seeded order that depends only on (seed, w)."""
        self._trim()
        self._snapshot = copy.deepcopy(self.state)
        rows = [self._mixed_row() for _ in range(self.window)]
        if self.cfg.shuffle_rows:
            random.Random(f"{self.cfg.seed}:{w}").shuffle(rows)
        self._window = (w, rows)

    def _step(self) -> None:
        """The next step's rows, exchanged: this rank's micro-batches of it into self._batches."""
        r = self.ranks
        rows = []
        for t in range(self.emitted, self.emitted + r.accum * self.batch_size):
            w, i = divmod(t, self.window)
            if self._window is None or self._window[0] != w:
                self._cut_window(w)
            rows.append(self._window[1][i])
        takers = [self.takers[q // self.batch_size % r.dp] for q in range(len(rows))]
        mine, received = exchange_rows(rows, takers, lambda seg: seg[1] % self.world, self._tokens, self.rank,
                                       self.world, r.group)
        self.emitted += len(rows)
        self.exchanged_bytes += received
        live = {(s, info.index) for s, table in enumerate(self._tables) for _, info in table} | self._infos.keys()
        self._tokens = {key: tokens for key, tokens in self._tokens.items() if key in live}
        for i in range(0, len(mine), self.batch_size):
            rows = torch.from_numpy(np.stack(mine[i : i + self.batch_size])).long()
            self._batches.append(rows_to_batch(rows, self.packing.eos, self.doc_mask))

    def __iter__(self) -> "DataStream":
        return self

    def __next__(self) -> dict[str, torch.Tensor]:
        began = time.perf_counter()
        if not self._batches:
            self._step()
        self.wait_time_s += time.perf_counter() - began
        return self._batches.pop(0)

    # --- state ---------------------------------------------------------------------------------------------

    def state_dict(self) -> dict:
        """The stream's position between steps: where the current window starts and how many rows were taken."""
        if self._batches:
            raise RuntimeError("data: state_dict() in the middle of a step (this rank has micro-batches left)")
        if self._window is None or self._window[0] != self.emitted // self.window:
            self._trim()  # the next step starts a window: its state is the present one
            self._snapshot = copy.deepcopy(self.state)
        state = {"version": STATE_VERSION, "fingerprint": self.fingerprint, "rows": self.emitted,
                 "sources": [asdict(st) for st in self._snapshot]}
        return {**state, "shard": list(self.shard)} if self.shard else state

    def load_state_dict(self, state: dict) -> None:
        problem = self._mismatch(state)
        self._reset()
        if problem and self.cfg.force_resume:
            log.warning("data: %s; data.force_resume is set, so the data stream starts afresh", problem)
            return
        if problem:
            raise HlatError(f"data: {problem}; resume with the same data settings, or set data.force_resume = true "
                            "to start the data stream afresh")
        self.state = [SourceState(**st) for st in state["sources"]]
        self._snapshot = copy.deepcopy(self.state)
        for st, bad in zip(self.state, self.bad):
            bad.counts.update(st.bad)
        self.emitted = state["rows"]

    def _mismatch(self, state: dict) -> str:
        if state.get("version") != STATE_VERSION:
            return f"the saved data state has format version {state.get('version')}, this hlat reads {STATE_VERSION}"
        saved = tuple(state.get("shard") or ())
        if saved != (self.shard or ()):
            def name(shard: tuple) -> str:
                return f"the files of data-parallel rank {shard[0]} of {shard[1]}" if shard else "the global stream"

            return f"the checkpoint holds a position in {name(saved)}, and this run reads {name(self.shard or ())}"
        changed = fingerprint_changes(state["fingerprint"], self.fingerprint)
        return f"the data settings changed since the checkpoint: {'; '.join(changed)}" if changed else ""

    # --- metrics and shutdown ------------------------------------------------------------------------------

    @property
    def worker_pids(self) -> list[int]:
        """Process ids of the running tokenizer workers, for monitoring (none before the first batch)."""
        return [p.pid for p in self._fetcher.procs] if self._fetcher else []

    @property
    def epoch(self) -> int:
        """The lowest epoch being read among the sources."""
        return min(st.start[0] for st in self.state)

    def stats(self) -> dict[str, float]:
        """Counters of the rows cut so far (up to a shuffle window ahead of those taken), for the metrics log."""
        out: dict[str, float] = {"data_wait_s": round(self.wait_time_s, 4), "data_epoch": self.epoch}
        totals = {"docs": 0, "bad": 0, "rows": 0, "pad": 0, "split_docs": 0}
        for spec, st in zip(self.specs, self.state):
            counts = {"docs": st.docs, "bad": sum(st.bad.values()), "rows": st.rows, "pad": st.pad,
                      "split_docs": st.split_docs}
            for k, v in counts.items():
                totals[k] += v
            if len(self.specs) > 1:
                out.update({f"data_{spec.name}_{k}": v for k, v in counts.items()})
        out.update({f"data_{k}": v for k, v in totals.items()})
        out["data_padding_fraction"] = totals["pad"] / max(totals["rows"] * self.seq_len, 1)
        out["data_split_fraction"] = totals["split_docs"] / max(totals["docs"], 1)
        return out

    def close(self) -> None:
        """Stop the worker processes (also done at exit); iterating again restarts them."""
        if self._fetcher is not None:
            self._fetcher.close()
            self._fetcher = None


def check_token_files(tokenizer: Tokenizer, digest: str, files: list[Path | str]) -> None:
    """Pre-tokenized files must have been made by the run's tokenizer (`digest`): their ids mean nothing to
    another."""
    for f in files:
        if file_format(str(f)) == "tokens" and (meta := token_meta(f))["tokenizer"] != digest:
            raise HlatError(f"token file {f}: written by another tokenizer ({meta['tokenizer_kind']}, vocabulary "
                            f"{meta['vocab_size']:,}) than this run's ({tokenizer.kind}, vocabulary "
                            f"{tokenizer.vocab_size:,}); set data.tokenizer to the one it was written with")


def build_stream(cfg: DataConfig, tokenizer: Tokenizer, sources: list[Source], seq_len: int, batch_size: int,
                 ranks: Ranks | None = None, shard: tuple[int, int] | None = None, doc_mask: bool = False,
                 holdout: float = 0.0) -> DataStream:
    """The configured stream over `sources` (`resolve_sources`: data.sources, or data.paths or the default corpus as
    one source); documents held out for validation (a `holdout` fraction, by hash) are skipped. The global stream, shared by `ranks` (a single process when None); or, with `shard` = (rank,
    world_size), data-parallel `rank`'s own stream of its share of the files (data_sharding = "files"). Checks,
    before any training, that every source has a readable document (in this rank's share)."""
    rank, world_size = shard or (0, 1)
    if not 0 <= rank < world_size:
        raise HlatError(f"data: rank {rank} is outside world_size {world_size}")
    specs, fingerprint = [], {"sources": {}, LISTING: {}}
    for source in sources:
        splits = make_splits(source.files, world_size)
        listing = fingerprint[LISTING][source.name] = split_listing(splits)  # to say which files change
        digest = hashlib.sha256(json.dumps(listing).encode()).hexdigest()[:16]
        fingerprint["sources"][source.name] = {"weight": source.weight, "files": digest}
        mine = share_of(splits, rank, world_size, f"data source {source.name!r}")
        specs.append(SourceSpec(source.name, source.weight, mine, cfg.text_field, cfg.max_doc_bytes, cfg.seed,
                                cfg.shuffle_files, holdout))
    if holdout:  # absent when 0, so checkpoints from before eval.holdout existed still resume
        fingerprint["holdout"] = holdout
    fingerprint.update(tokenizer=tokenizer_digest(tokenizer), seq_len=seq_len,
                       **{k: getattr(cfg, k) for k in ("packing", "round_bytes", "text_field", "max_doc_bytes",
                                                       "seed", "shuffle_files", "shuffle_rows")})
    check_token_files(tokenizer, fingerprint["tokenizer"], [f for source in sources for f in source.files])
    for spec in specs:
        spec.check(f" on data-parallel rank {rank}" if world_size > 1 else "")
    return DataStream(cfg, tokenizer, specs, seq_len, batch_size, fingerprint, doc_mask, ranks, shard)
