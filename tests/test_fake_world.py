"""torch's fake process group, an internal torch module (`torch.testing._internal.distributed.fake_pg`), as
`hlat.measure.fake_world` relies on it: this fails loudly if a torch release changes what `hlat rehearse` needs.
One process becomes rank 5 of 4,096 with no peer anywhere; the trainer's mesh builds on it; a collective
completes at once and leaves the local data as it was (an all-reduce the value, an all-gather the local shard
repeated); a receive writes nothing, which `Deliveries` turns into ones; and the collectives recorder names the
mesh dimension of each group."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

SCRIPT = r"""
import torch, torch.distributed as dist
from torch.testing._internal.distributed import fake_pg
assert hasattr(fake_pg, "FakeStore"), "torch moved or renamed FakeStore"

from hlat.measure.fake_world import Deliveries, join_fake_world
from hlat.measure.traffic import Collectives, group_names
from hlat.parallel import ParallelConfig, init_topology

join_fake_world(5, 4096)
assert dist.get_backend() == "fake", dist.get_backend()
assert (dist.get_rank(), dist.get_world_size()) == (5, 4096)
topo = init_topology(ParallelConfig(tp=8, pp=8, dp_replicate=16, dp_shard=4).resolved(4096), torch.device("cpu"))
assert topo.world_size == 4096 and (topo.pp_rank, topo.dp_rank, topo.tp_rank) == (0, 0, 5), topo

x = torch.arange(4.0)
with Collectives(group_names(topo)) as recorded:
    dist.all_reduce(x, group=topo.group("tp"))
    gathered = torch.zeros(16)
    dist.all_gather_into_tensor(gathered, x, group=topo.group("dp_shard"))
    received = torch.full((3,), 7.0)
    dist.recv(received, group=topo.group("pp"), group_src=1)
    assert received.tolist() == [7.0] * 3, "a fake receive wrote its buffer"
    with Deliveries():
        dist.recv(received, group=topo.group("pp"), group_src=1)
assert x.tolist() == [0.0, 1.0, 2.0, 3.0], x
assert gathered.tolist() == [0.0, 1.0, 2.0, 3.0] * 4, gathered
assert received.tolist() == [1.0] * 3, received
rows = {(r["kind"], r["dim"]): (r["count"], r["bytes"]) for r in recorded.rows()}
assert rows == {("all_reduce", "tp"): (1, 16), ("all_gather", "dp_shard"): (1, 64), ("recv", "pp"): (2, 24)}, rows
dist.destroy_process_group()
print("ok")
"""


def test_the_fake_process_group_behaves_as_the_rehearsal_needs():
    done = subprocess.run(
        [sys.executable, "-c", SCRIPT],
        capture_output=True,
        text=True,
        timeout=300,
        env={**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"},
    )
    assert done.returncode == 0 and done.stdout.strip() == "ok", done.stderr[-3000:]
