"""Where a run starts, decided once for all ranks across both tiers (`decide_start`), and checked once.

Before any process group, each rank found the durable checkpoint to resume from on its own
(`hlat.checkpoint.resume.find_resume_checkpoint`). Once the group exists, the ranks gather what they found and what
their nodes hold of the memory tier, and take the newest of: the durable checkpoint every rank verified, and the
newest memory snapshot that the surviving nodes hold whole and verified. A memory snapshot at least as new as the
durable checkpoint wins (it loads from memory, not shared storage). Every other snapshot of the run's memory tier is
dropped: a fresh start's, those of an explicit `--resume PATH` (which loads that path and nothing else), and the
dead attempt's newer or older ones. Whatever is chosen (or `train.init_from`'s weights) is then checked against the
model and the config, once: `Start.changes` is what the config changes against it.
"""

from __future__ import annotations

import shutil
import uuid
from dataclasses import dataclass, field
from pathlib import Path

from torch import nn

from hlat.checkpoint.memory import METADATA, Node
from hlat.checkpoint.memory_restore import Held, fetch, holdings, newest_complete
from hlat.checkpoint.resume import check_start
from hlat.config.job import Config
from hlat.files import writing
from hlat.groups import gather_objects, side_group
from hlat.parallel import Topology
from hlat.parallel.mesh import continues_run
from hlat.paths import (
    CONFIG_FILE,
    TOKEN_FILE,
    checkpoint_root,
    checkpoint_step,
    snapshot_root,
    step_dirs,
    step_name,
)


@dataclass
class Start:
    path: Path | None  # the checkpoint to load (durable, or this node's copy of a memory snapshot); None: fresh
    tier: str  # "durable", "memory" or "" (fresh)
    token: str  # the run's token: new at a fresh start, which its goodput and memory snapshots carry
    node: Node | None = None
    group: object = None  # the memory tier's CPU process group: its fetches, then its background writes
    held: set[str] = field(default_factory=set)  # the files of the memory snapshot this node holds, verified
    changes: list[str] = field(default_factory=list)  # what the config changes against the checkpoint's
    resuming: bool = False  # the run goes on (`--resume`, or a worker torchrun restarted), rather than starts afresh


def decide_start(cfg: Config, topo: Topology, durable: Path | None, model: nn.Module) -> Start:
    """One start for every rank (see the module's docstring), checked; `durable`: the checkpoint this rank found,
    `model` on the meta device (the chosen checkpoint's tensors must fit it)."""
    start = _choose(cfg, topo, durable)
    start.changes = check_start(cfg, start.path, model)
    start.resuming = resuming(cfg)
    return start


def _choose(cfg: Config, topo: Topology, durable: Path | None) -> Start:
    settings, going_on = cfg.train, resuming(cfg)
    token = gather_objects(run_token(settings.run_dir, going_on) if topo.is_main else None)[0]
    if not settings.snapshot_every:
        return Start(durable, "durable" if durable else "", token)
    node = Node.of_this_process(topo.world_size)
    # the tier's CPU group fails a collective as the training's do: a write to a lost buddy must not outwait it
    group = side_group(settings.collective_timeout_s)
    root = snapshot_root(settings.snapshot_dir, settings.run_dir)
    if not going_on or settings.resume not in ("", "auto"):  # fresh (another run's memory), or the checkpoint named
        keep_only(root, None, node)
        return Start(durable, "durable" if durable else "", token, node, group)
    gathered = gather_objects((holdings(root, token), checkpoint_step(durable) if durable else -1))
    durable = common_durable(settings.run_dir, [d for _, d in gathered])
    step = newest_complete([held for held, _ in gathered])
    if step is None or step < (checkpoint_step(durable) if durable else 0):
        keep_only(root, None, node)
        return Start(durable, "durable" if durable else "", token, node, group)
    target = root / step_name(step)
    keep_only(root, target, node)
    held = gathered[topo.rank][0].get(step, Held(0, set(), False, set())).files
    held, _ = fetch(target, held, {METADATA, CONFIG_FILE}, node, topo.rank, group)  # what the check reads
    return Start(target, "memory", token, node, group, held)


def keep_only(root: Path, kept: Path | None, node: Node) -> None:
    """The node's leader drops the run's snapshots but the one it starts from (`kept`; None: all): they belong to
    another run, or to the abandoned timeline of a dead attempt (a newer snapshot some node lacks, still counted as the
    run's own in the room check, would otherwise hold memory until the run overtook it)."""
    if node.leader:
        for _, path in step_dirs(root):
            if path != kept:
                shutil.rmtree(path, ignore_errors=True)


def resuming(cfg: Config) -> bool:
    """Whether the run goes on rather than starts afresh: `--resume`, or a worker torchrun restarted
    (`hlat.parallel.mesh.continues_run`)."""
    return cfg.train.resume != "" or continues_run()


def common_durable(run_dir: str, steps: list[int]) -> Path | None:
    """The durable checkpoint every rank found good: the oldest of their newest (-1: none)."""
    oldest = min(steps)
    return None if oldest < 0 else checkpoint_root(run_dir) / step_name(oldest)


def run_token(run_dir: str, resuming: bool) -> str:
    """The run's token (rank 0): a fresh start makes a new one, a resume keeps the run's. A refused write is one
    line naming the file."""
    path = checkpoint_root(run_dir) / TOKEN_FILE
    if resuming and path.is_file():
        return path.read_text().strip()
    token = uuid.uuid4().hex
    with writing(path, Path(run_dir)):
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(token + "\n")
    return token
