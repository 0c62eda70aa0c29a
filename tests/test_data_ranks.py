"""The global data stream shared by several ranks (gloo, one process per rank, no model): each rank tokenizes
about its share, the ranks train on the single process's rows, and the state, the same on every rank, resumes
the stream at another number of ranks."""

import json

import torch
import torch.distributed as dist
from test_data import CharTokenizer, jsonl, same, take

from hlat.data import packing as packing_module
from hlat.data.config import DataConfig
from hlat.data.packing import Ranks, build_stream
from hlat.data.sources import one_source
from hlat.groups import side_group

WORLD, ACCUM, SEQ, MICRO = 4, 4, 12, 2  # 4 ranks; steps of 4 micro-batches of 2 rows of 12 tokens
PACKINGS = ("concat", "best_fit")


def _cfg(packing: str) -> DataConfig:
    return DataConfig(packing=packing, round_bytes=60, shuffle_rows=5, seed=2, workers=0)


def rank_main(tmp: str, files: list[str]) -> None:  # one rank of a job of tests/warm_torchrun.py
    rank, states, block = dist.get_rank(), torch.load(f"{tmp}/states.pt"), packing_module.BLOCK
    group = side_group()
    out = {}
    try:
        for packing in PACKINGS:
            # best_fit learns rounds in blocks of 3, fewer than the ranks: which rank has a round in a block varies
            packing_module.BLOCK = 3 if packing == "best_fit" else 64
            ranks = Ranks(group, dp_rank=rank, dp=WORLD, accum=ACCUM)
            s = build_stream(_cfg(packing), CharTokenizer(), one_source(files), SEQ, MICRO, ranks=ranks)
            fresh = take(s, 3 * ACCUM // WORLD)  # 3 steps
            resumed = build_stream(_cfg(packing), CharTokenizer(), one_source(files), SEQ, MICRO, ranks=ranks)
            resumed.load_state_dict(states[packing])
            out[packing] = {
                "fresh": fresh,
                "state": s.state_dict(),
                "tokenized": s.tokenized,
                "received": s.exchanged_bytes,
                "resumed": take(resumed, 2 * ACCUM // WORLD),
            }
    finally:
        packing_module.BLOCK = block  # the process runs other jobs after this one
    torch.save(out, f"{tmp}/rank{rank}.pt")


def test_ranks_share_the_work_and_train_on_the_single_process_rows(tmp_path, warm_torchrun):
    files = [
        jsonl(tmp_path / f"{i}.jsonl", [f"doc {i}.{j} " + "xyz"[j % 3] * (j * 7 % 23) for j in range(12)])
        for i in range(3)
    ]
    reference, states, tokenized = {}, {}, {}
    for packing in PACKINGS:
        single = build_stream(
            _cfg(packing), CharTokenizer(), one_source(files), SEQ, MICRO
        )  # one micro-batch at a time
        reference[packing] = take(single, ACCUM)
        states[packing] = single.state_dict()  # after one step
        reference[packing] += take(single, 2 * ACCUM)
        tokenized[packing] = single.tokenized  # after three steps
        reference[packing] += take(single, 2 * ACCUM)
    torch.save(states, tmp_path / "states.pt")
    done = warm_torchrun.call(WORLD, "test_data_ranks:rank_main", str(tmp_path), [str(f) for f in files])
    assert done.returncode == 0, done.stderr[-3000:]
    got = [torch.load(tmp_path / f"rank{r}.pt") for r in range(WORLD)]
    for packing in PACKINGS:
        ref = reference[packing]
        for r in range(WORLD):
            run = got[r][packing]
            mine = [ref[step * ACCUM + j] for step in range(3) for j in range(r, ACCUM, WORLD)]
            assert same(run["fresh"], mine), (packing, r)
            # a state of one process, resumed by 4: the same next steps
            after = [ref[(1 + step) * ACCUM + j] for step in range(2) for j in range(r, ACCUM, WORLD)]
            assert same(run["resumed"], after), (packing, r)
            # rank r received the rows of its micro-batches that other ranks made: at most all their tokens
            assert 0 < run["received"] <= 4 * len(run["fresh"]) * MICRO * (SEQ + 1)
        # the state is the same on every rank and is the single process's; it resumes one process
        state = got[0][packing]["state"]
        assert all(json.dumps(g[packing]["state"]) == json.dumps(state) for g in got)
        single = build_stream(_cfg(packing), CharTokenizer(), one_source(files), SEQ, MICRO)
        take(single, 3 * ACCUM)
        assert single.state_dict() == state
        resumed = build_stream(_cfg(packing), CharTokenizer(), one_source(files), SEQ, MICRO)
        resumed.load_state_dict(state)
        assert same(take(resumed, 2 * ACCUM), ref[3 * ACCUM : 5 * ACCUM])
        # rounds are made round robin: together the ranks tokenized what one process did (and the rest of the
        # last block of 4 rounds), each a share, none more than about twice its 1/4
        shares = [g[packing]["tokenized"] for g in got]
        assert sum(shares) >= tokenized[packing] and all(0 < n < sum(shares) / 2 for n in shares), shares


def test_files_sharding_gives_each_data_parallel_rank_its_own_files(tmp_path):
    """parallel.data_sharding = "files", as the trainer opens it: each data-parallel rank reads only its share of
    the files, takes its micro-batches of each step from its own stream, and keeps its own data state."""
    from hlat.config.job import build_config
    from hlat.parallel.config import ParallelConfig
    from hlat.parallel.mesh import Topology
    from hlat.train.loop import open_stream
    from hlat.train.step import Batches

    files = [jsonl(tmp_path / f"{letter}.jsonl", [letter * 30] * 4) for letter in "abcd"]
    cfg = build_config(
        {"data": {"workers": 0, "shuffle_rows": 0}, "train": {"global_batch": 4, "micro_batch": 1, "seq_len": 8}}
    )
    letters, keys = [], []
    for rank in (0, 1):
        topo = Topology(ParallelConfig(dp_shard=2, data_sharding="files"), None, rank=rank, dp_rank=rank)
        per_rank = topo.cfg.microbatches(cfg.train.global_batch, cfg.train.micro_batch)
        batches = Batches(open_stream(cfg, topo, CharTokenizer(), one_source(files)), topo, per_rank)
        seen = set()
        for _ in range(8):  # a few epochs of its share
            micro = batches.next_step(torch.device("cpu"))
            assert len(micro) == 2  # 4 micro-batches a step, 2 per data-parallel rank
            seen |= {chr(t - 1) for b in micro for t in b["inputs"].flatten().tolist() if t}
        letters.append(seen)
        keys.append(batches.state_key)
        assert batches.stream.state_dict()["shard"] == [rank, 2]
    assert len(letters[0]) == len(letters[1]) == 2 and not letters[0] & letters[1]
    assert keys == ["trainer_rank0", "trainer_rank1"]
