"""The memory tier's restore side: what each node holds of the run's snapshots (`holdings`, only files that match
the records of the ranks that wrote them), the newest snapshot the surviving nodes hold whole between them
(`newest_complete`), and the files a rank's part of the state reads (`files_to_read`), fetched from the nodes that
hold them (`fetch`). A snapshot loads through DCP like any checkpoint, resharding to a smaller or larger world.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from pathlib import Path

import torch.distributed as dist
import torch.distributed.checkpoint as dcp

from hlat.checkpoint.durable import digests
from hlat.checkpoint.memory import METADATA, Node
from hlat.groups import gather_objects, recv_object, send_object
from hlat.paths import step_dirs
from hlat.torch_private import chunk_files

_RANK_FILE = re.compile(r"^__(\d+)_\d+\.distcp$")


@dataclass
class Held:
    """What one node holds of the snapshot of a step, verified against the ranks' records."""

    world: int
    ranks: set[int]  # the ranks whose files it holds
    metadata: bool
    files: set[str]


def holdings(root: Path, token: str) -> dict[int, Held]:
    """{step: what this node holds of it}, counting only files that match the records of the ranks that wrote
    them, for this run (`token`). A damaged or partial file is left out, so a snapshot it belongs to is complete
    only where another node holds a good copy."""
    found = {}
    for step, target in step_dirs(root):
        held = None
        for marker in sorted(target.glob("rank_*.json")):
            try:
                record = json.loads(marker.read_text())
            except (OSError, ValueError):
                continue
            if record.get("token") != token or record.get("step") != step:
                continue
            held = held or Held(record["world"], set(), False, set())
            for name, (size, crc) in record["files"].items():
                if held.world == record["world"] and verified(target / name, size, crc):
                    held.files.add(name)
                    held.metadata |= name == METADATA
                    if m := _RANK_FILE.match(name):
                        held.ranks.add(int(m.group(1)))
        if held is not None:
            found[step] = held
    return found


def verified(path: Path, size: int, crc: int) -> bool:
    try:
        return path.stat().st_size == size and digests(path.parent, [path.name])[path.name][1] == crc
    except OSError:
        return False


def newest_complete(gathered: list[dict[int, Held]]) -> int | None:
    """The newest step whose snapshot the nodes hold between them whole (every rank of its world, and the
    metadata), from every rank's `holdings` (ranks of one node report the same)."""
    steps = sorted({s for held in gathered for s in held}, reverse=True)
    for step in steps:
        parts = [held[step] for held in gathered if step in held]
        world = parts[0].world
        ranks = set().union(*(p.ranks for p in parts if p.world == world))
        if ranks == set(range(world)) and any(p.metadata for p in parts):
            return step
    return None


def files_to_read(path: Path, state: dict) -> set[str]:
    """The files of the DCP checkpoint `path` that loading `state` (this rank's state dict) reads. DCP keeps each
    tensor chunk's file in its metadata, which no public API returns (`hlat.torch_private.chunk_files`)."""
    metadata = dcp.FileSystemReader(path).read_metadata()
    planner = dcp.DefaultLoadPlanner()
    planner.set_up_planner(state, metadata, is_coordinator=False)
    return chunk_files(metadata, planner.create_local_plan())


def fetch(target: Path, held: set[str], wanted: set[str], node: Node, rank: int, group) -> tuple[set[str], int]:
    """Make this node's copy of a snapshot (`target`, of which it holds the verified files `held`) hold the files in
    `wanted` (this rank's wish; every rank calls it, a collective over the CPU `group`): each file a node lacks is
    sent by the lowest rank of a node that holds it to the lowest rank of the node that wants it. Returns what the
    node holds now, and the bytes this rank received."""
    gathered = gather_objects((rank, node.index, held, wanted), group)
    holders: dict[str, int] = {}
    for other, _, files, _ in gathered:
        for name in files:
            holders.setdefault(name, other)
    node_files: dict[int, set[str]] = {}
    for _, index, files, _ in gathered:
        node_files.setdefault(index, set()).update(files)
    transfers, claimed = [], set()
    for other, index, _, wants in gathered:
        for name in sorted(wants - node_files[index]):
            if (index, name) not in claimed and name in holders:
                claimed.add((index, name))
                transfers.append((holders[name], other, name))
    received, now = (
        0,
        node_files[node.index] | {name for _, receiver, name in transfers if gathered[receiver][1] == node.index},
    )
    for sender, receiver, name in transfers:
        if rank == sender:
            for request in send_object((target / name).read_bytes(), receiver, group):
                request.wait()
        elif rank == receiver:
            data = recv_object(sender, group)
            target.mkdir(parents=True, exist_ok=True)
            (target / name).write_bytes(data)
            received += len(data)
    if group is not None:
        dist.barrier(group=group)
    return now, received
