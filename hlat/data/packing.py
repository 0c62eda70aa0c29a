"""The training process's side of the data path: rounds (from worker processes, or made in place) cut into rows,
sources mixed by weight, rows mixed in a pool, batches of tensors; and the exactly resumable state of it all.

A row holds seq_len + 1 tokens: inputs are its first seq_len, targets its last seq_len. `concat` rows are cut
from a source's token stream with one shared token (the last target of a row is the first input of the
next), so no token pair is lost at a row boundary; `best_fit` rows come whole from a round, padded with -1,
which becomes EOS in the inputs and -100 (ignored by cross-entropy) in the targets.
"""

from __future__ import annotations

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

from hlat import HlatError
from hlat.data.config import DataConfig
from hlat.data.rounds import ORIGIN, Packing, Position, Round, RoundMaker, SourceSpec, worker_main
from hlat.data.sources import BadLog, Source, make_splits, resolve_sources, shard
from hlat.data.tokenizer import Tokenizer

log = logging.getLogger(__name__)

IGNORE = -100  # target of a padding position: F.cross_entropy's default ignore_index
PREFETCH = 2  # rounds requested ahead per source and worker
STATE_VERSION = 2
# Encoded to tell tokenizers apart in the fingerprint: mixed scripts, digits, whitespace, code.
PROBE = "Hello, wörld! 123 4567\n\tdef f(x): return x**2  # 日本語 Ελληνικά 🙂 <|endoftext|>"


@dataclass
class SourceState:
    """One source's place in its stream and its counters: JSON-able as it is."""

    round: int = 0  # the round rows are being cut from
    start: Position = field(default_factory=lambda: list(ORIGIN))  # where that round starts
    counted: bool = False  # its documents and bad records are in the counters
    used: int = 0  # concat: its tokens already in rows (or carried); best_fit: its rows emitted
    pending: list[int] = field(default_factory=list)  # concat: tokens of earlier rounds not yet in a row
    mid: bool = False  # concat: the next row starts inside a document
    docs: int = 0
    bad: dict[str, int] = field(default_factory=dict)
    docs_epoch: int = 0  # the last epoch a document was read in
    rows: int = 0
    pad: int = 0  # padding targets emitted
    split_docs: int = 0  # documents cut across rows


class _Inline:
    """Rounds made in the training process (data.workers = 0)."""

    procs: list = []

    def __init__(self, specs, packing, tokenizer, starts):
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
    """Worker processes (spawned: safe after CUDA and threads): round k of every source goes to worker
    k % n, which makes its rounds in order; each source keeps PREFETCH rounds per worker requested ahead."""

    def __init__(self, n, specs, packing, tokenizer, starts):
        ctx = mp.get_context("spawn")
        self.n = n
        self.tasks = [ctx.Queue() for _ in range(n)]
        self.results = [ctx.Queue() for _ in range(n)]
        self.procs = [ctx.Process(target=worker_main, args=(specs, packing, tokenizer, starts, t, r), daemon=True,
                                  name=f"hlat-data-{i}") for i, (t, r) in enumerate(zip(self.tasks, self.results))]
        for p in self.procs:
            p.start()
        for q in self.tasks:
            q.cancel_join_thread()  # never block the process's exit on a dead worker's queue
        self.requested = [index for index, _ in starts]
        self.ready: dict[tuple[int, int], Round] = {}
        self._stop = weakref.finalize(self, _stop_workers, self.procs)  # also run at exit

    def get(self, source: int, index: int) -> Round:
        while self.requested[source] < index + PREFETCH * self.n:
            k = self.requested[source]
            self.tasks[k % self.n].put((source, k))
            self.requested[source] += 1
        worker = index % self.n
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


class DataStream:
    """Endless batches {"inputs", "targets"} (LongTensor [batch_size, seq_len]), plus "positions" and "doc_ids"
    with doc_mask; `state_dict()` after k batches restores a stream whose next batch is batch k + 1."""

    def __init__(self, cfg: DataConfig, tokenizer: Tokenizer, specs: list[SourceSpec], seq_len: int,
                 batch_size: int, fingerprint: dict, rank: int = 0, world_size: int = 1, doc_mask: bool = False):
        if seq_len < 2 or batch_size < 1:
            raise HlatError(f"data: seq_len must be >= 2 and batch_size >= 1, got {seq_len} and {batch_size}")
        self.cfg, self.tokenizer, self.specs = cfg, tokenizer, specs
        self.seq_len, self.batch_size, self.doc_mask = seq_len, batch_size, doc_mask
        self.rank, self.world_size, self.fingerprint = rank, world_size, fingerprint
        self.packing = Packing(cfg.packing, seq_len, cfg.round_bytes, tokenizer.eos_id)
        total = sum(spec.weight for spec in specs)
        self.weights = [spec.weight / total for spec in specs]
        self.wait_time_s = 0.0  # time spent inside __next__: the training loop waiting for data
        self._fetcher: _Inline | _Workers | None = None
        self._reset()

    def _reset(self) -> None:
        self.close()
        self.state = [SourceState() for _ in self.specs]
        self.bad = [BadLog(spec.name) for spec in self.specs]
        self._rounds: list[Round | None] = [None] * len(self.specs)
        self._pool: list[np.ndarray] = []
        self._rng = random.Random(self.cfg.seed)

    # --- rounds to rows ------------------------------------------------------------------------------------

    def _round(self, s: int) -> Round:
        if self._rounds[s] is None:
            if self._fetcher is None:
                starts = [(st.round, st.start) for st in self.state]
                args = (self.specs, self.packing, self.tokenizer, starts)
                self._fetcher = _Workers(self.cfg.workers, *args) if self.cfg.workers else _Inline(*args)
            st = self.state[s]
            r = self._rounds[s] = self._fetcher.get(s, st.round)
            if not st.counted:
                self._count(s, r)
        return self._rounds[s]

    def _count(self, s: int, r: Round) -> None:
        st, spec, bad = self.state[s], self.specs[s], self.bad[s]
        st.counted = True
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

    def _next_round(self, s: int) -> None:
        st, r = self.state[s], self._round(s)
        st.round, st.start, st.counted, st.used = r.index + 1, r.end, False, 0
        self._rounds[s] = None

    def _row(self, s: int) -> np.ndarray:
        st, width = self.state[s], self.seq_len + 1
        if self.packing.mode == "best_fit":
            while st.used == len(self._round(s).tokens):
                self._next_round(s)
            row = self._round(s).tokens[st.used]
            st.used += 1
            st.pad += int((row[1:] < 0).sum())
        else:
            while len(st.pending) + len(self._round(s).tokens) - st.used < width:
                st.pending += self._round(s).tokens[st.used :].tolist()
                self._next_round(s)
            take = width - len(st.pending)
            fresh = self._round(s).tokens[st.used : st.used + take]
            row = np.concatenate([np.asarray(st.pending, dtype=np.int32), fresh])
            st.used += take - 1  # the row's last token is also the next row's first
            st.pending = []
            eos = self.packing.eos
            starts_mid, st.mid = st.mid, bool(row[-2] != eos)
            # the document running into the next row began in this one: count it as split once
            if st.mid and (not starts_mid or bool((row[:-2] == eos).any())):
                st.split_docs += 1
        st.rows += 1
        return row

    def _mixed_row(self) -> np.ndarray:
        """The next row of the source furthest behind its weight: exact proportions, deterministically."""
        total = sum(st.rows for st in self.state) + 1
        s = max(range(len(self.specs)), key=lambda i: (self.weights[i] * total - self.state[i].rows, -i))
        return self._row(s)

    def _rows(self) -> np.ndarray:
        pool_size = self.cfg.shuffle_rows
        if not pool_size:
            return np.stack([self._mixed_row() for _ in range(self.batch_size)])
        while len(self._pool) < pool_size:
            self._pool.append(self._mixed_row())
        rows = []
        for _ in range(self.batch_size):
            i = self._rng.randrange(pool_size)
            rows.append(self._pool[i])
            self._pool[i] = self._mixed_row()
        return np.stack(rows)

    def __iter__(self) -> "DataStream":
        return self

    def __next__(self) -> dict[str, torch.Tensor]:
        began = time.perf_counter()
        rows = torch.from_numpy(self._rows()).long()
        pad = rows < 0
        inputs = torch.where(pad[:, :-1], self.packing.eos, rows[:, :-1])
        batch = {"inputs": inputs, "targets": torch.where(pad[:, 1:], IGNORE, rows[:, 1:])}
        if self.doc_mask:
            batch["doc_ids"], batch["positions"] = doc_ids_and_positions(inputs, self.packing.eos)
        self.wait_time_s += time.perf_counter() - began
        return batch

    # --- state ---------------------------------------------------------------------------------------------

    def state_dict(self) -> dict:
        version, internal, gauss = self._rng.getstate()
        return {"version": STATE_VERSION, "rank": self.rank, "world_size": self.world_size,
                "fingerprint": self.fingerprint, "sources": [asdict(st) for st in self.state],
                "pool": [row.tolist() for row in self._pool], "rng": [version, list(internal), gauss]}

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
        for st, bad in zip(self.state, self.bad):
            bad.counts.update(st.bad)
        self._pool = [np.asarray(row, dtype=np.int32) for row in state["pool"]]
        version, internal, gauss = state["rng"]
        self._rng.setstate((version, tuple(internal), gauss))

    def _mismatch(self, state: dict) -> str:
        if state.get("version") != STATE_VERSION:
            return f"the saved data state has format version {state.get('version')}, this hlat reads {STATE_VERSION}"
        if state["world_size"] != self.world_size:
            return (f"the checkpoint was written with {state['world_size']} data-parallel ranks and this run has "
                    f"{self.world_size}: each rank's data position is only valid for the same number of ranks")
        if state["rank"] != self.rank:
            return f"data-parallel rank {self.rank} was given the data state of rank {state['rank']}"
        old, new = _flatten(state["fingerprint"]), _flatten(self.fingerprint)
        changed = [f"{k} {old.get(k)!r} -> {new.get(k)!r}" for k in sorted(old.keys() | new.keys())
                   if old.get(k) != new.get(k)]
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
        """Counters of the rows emitted so far, for the metrics log."""
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
            self._rounds = [None] * len(self.specs)


def _flatten(d: dict, prefix: str = "") -> dict:
    out = {}
    for k, v in d.items():
        out.update(_flatten(v, f"{prefix}{k}.") if isinstance(v, dict) else {f"{prefix}{k}": v})
    return out


def tokenizer_digest(tokenizer: Tokenizer) -> str:
    (ids,) = tokenizer.encode_batch([PROBE])
    key = json.dumps([tokenizer.kind, tokenizer.vocab_size, tokenizer.eos_id, ids])
    return hashlib.sha256(key.encode()).hexdigest()[:16]


def build_stream(
    cfg: DataConfig,
    tokenizer: Tokenizer,
    files: list[Path | str],
    seq_len: int,
    batch_size: int,
    rank: int = 0,
    world_size: int = 1,
    doc_mask: bool = False,
    holdout: float = 0.0,
) -> DataStream:
    """The configured stream for data-parallel `rank` of `world_size`: `files` are the one source of data.paths
    (or the default corpus); named data.sources resolve their own; documents held out for validation (a
    `holdout` fraction, by hash) are skipped. Checks, before any training, that every source has a readable
    document on this rank."""
    if not 0 <= rank < world_size:
        raise HlatError(f"data: rank {rank} is outside world_size {world_size}")
    sources = resolve_sources(cfg) if cfg.sources else [Source("default", 1.0, list(files))]
    specs, fingerprint = [], {"sources": {}}
    for source in sources:
        splits = make_splits(source.files, world_size)
        listing = json.dumps([[str(s.file), s.start, s.size] for s in splits])
        fingerprint["sources"][source.name] = {"weight": source.weight,
                                               "files": hashlib.sha256(listing.encode()).hexdigest()[:16]}
        mine = shard(splits, rank, world_size, f"data source {source.name!r}")
        specs.append(SourceSpec(source.name, source.weight, mine, cfg.text_field, cfg.max_doc_bytes, cfg.seed,
                                cfg.shuffle_files, holdout))
    if holdout:  # absent when 0, so checkpoints from before eval.holdout existed still resume
        fingerprint["holdout"] = holdout
    fingerprint.update(tokenizer=tokenizer_digest(tokenizer), seq_len=seq_len, batch_size=batch_size,
                       **{k: getattr(cfg, k) for k in ("packing", "round_bytes", "text_field", "max_doc_bytes",
                                                       "seed", "shuffle_files", "shuffle_rows")})
    for spec in specs:
        spec.check(f" on data-parallel rank {rank}" if world_size > 1 else "")
    return DataStream(cfg, tokenizer, specs, seq_len, batch_size, fingerprint, rank, world_size, doc_mask)
