"""Where a run starts, decided once for all ranks across both tiers (`agree_on_start`).

Before any process group, each rank found the durable checkpoint to resume from on its own
(`hlat.checkpoint.resume.find_resume_checkpoint`). Once the group exists, the ranks gather what they found and what
their nodes hold of the memory tier, and take the newest of: the durable checkpoint every rank verified, and the
newest memory snapshot that the surviving nodes hold whole and verified. A memory snapshot at least as new as the
durable checkpoint wins (it loads from memory, not shared storage). A fresh start clears the run's memory tier;
an explicit `--resume PATH` loads that path and nothing else.
"""

from __future__ import annotations

import shutil
import uuid
from dataclasses import dataclass
from datetime import timedelta
from pathlib import Path

import torch.distributed as dist
from torch import nn

from hlat.checkpoint.memory import METADATA, Held, Node, fetch, holdings, newest_complete, snapshot_root, step_dir
from hlat.checkpoint.resume import check_start
from hlat.config.job import Config
from hlat.parallel import Topology
from hlat.parallel.mesh import continues_run, gather_objects
from hlat.paths import CONFIG_FILE, checkpoint_root, checkpoint_step

TOKEN_FILE = "run_token"  # in <run>/checkpoints: the run's identity, which its memory snapshots carry


@dataclass
class Start:
    path: Path | None  # the checkpoint to load (durable, or this node's copy of a memory snapshot); None: fresh
    tier: str  # "durable", "memory" or "" (fresh)
    token: str = ""  # the run's token (memory tier on)
    node: Node | None = None
    group: object = None  # the memory tier's CPU process group
    held: set[str] | None = None  # the files of the memory snapshot this node holds, verified
    changes: list[str] | None = None  # what the config changes against a memory snapshot's


def agree_on_start(cfg: Config, topo: Topology, durable: Path | None, model: nn.Module) -> Start:
    """One start for every rank (see the module's docstring); `durable`: the checkpoint this rank found, `model` on
    the meta device (a memory snapshot's tensors and config are checked against it, as the durable one's were)."""
    settings = cfg.train
    if not settings.snapshot_every:
        return Start(durable, "durable" if durable else "")
    node = Node.of_this_process(topo.world_size)
    # the tier's CPU group fails a collective as the training's do: a write to a lost buddy must not outwait it
    timeout = timedelta(seconds=settings.collective_timeout_s)
    group = dist.new_group(backend="gloo", timeout=timeout) if dist.is_initialized() else None
    resuming = settings.resume != "" or continues_run()
    token = gather_objects(run_token(settings.run_dir, resuming) if topo.is_main else None)[0]
    root = snapshot_root(settings.snapshot_dir, settings.run_dir)
    if not resuming and node.leader:
        shutil.rmtree(root, ignore_errors=True)  # another run's, at this run directory's path
    if not resuming or settings.resume not in ("", "auto"):  # fresh, or the checkpoint named
        return Start(durable, "durable" if durable else "", token, node, group)
    gathered = gather_objects((holdings(root, token), checkpoint_step(durable) if durable else -1))
    durable = common_durable(settings.run_dir, [d for _, d in gathered])
    step = newest_complete([held for held, _ in gathered])
    if step is None or step < (checkpoint_step(durable) if durable else 0):
        return Start(durable, "durable" if durable else "", token, node, group)
    target = step_dir(root, step)
    held = gathered[topo.rank][0].get(step, Held(0, set(), False, set())).files
    held, _ = fetch(target, held, {METADATA, CONFIG_FILE}, node, topo.rank, group)
    changes = check_start(cfg, target, model)
    return Start(target, "memory", token, node, group, held, changes)


def common_durable(run_dir: str, steps: list[int]) -> Path | None:
    """The durable checkpoint every rank found good: the oldest of their newest (-1: none)."""
    oldest = min(steps)
    return None if oldest < 0 else checkpoint_root(run_dir) / f"step_{oldest:08d}"


def run_token(run_dir: str, resuming: bool) -> str:
    """The run's token (rank 0): a fresh start makes a new one, a resume keeps the run's."""
    path = checkpoint_root(run_dir) / TOKEN_FILE
    if resuming and path.is_file():
        return path.read_text().strip()
    path.parent.mkdir(parents=True, exist_ok=True)
    token = uuid.uuid4().hex
    path.write_text(token + "\n")
    return token
