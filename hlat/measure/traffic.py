"""The collectives a rank issues, as it issues them: a dispatch mode over torch's process-group ops (c10d) and
functional collectives (what DTensor and tensor parallelism use), recording each one's kind, the mesh dimension
of its group, and its bytes.

Bytes are the whole buffer of the collective on one rank, as nccl-tests count them and the planner prices them:
the tensor of an all-reduce, a broadcast or a send/receive, the gathered output of an all-gather, the input of a
reduce-scatter or an all-to-all."""

from __future__ import annotations

from collections import Counter

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor

from hlat.torch_private import FUNCTIONAL_NAMESPACE, TorchDispatchMode, op_arguments

# op name -> (kind, the argument holding the whole buffer); functional all-gathers are given their input, times
# the group's size
C10D = {
    "allreduce_": ("all_reduce", "tensors"),
    "allreduce_coalesced_": ("all_reduce", "tensors"),
    "_allgather_base_": ("all_gather", "output_tensor"),
    "allgather_": ("all_gather", "output_tensors"),
    "allgather_coalesced_": ("all_gather", "output_lists"),
    "allgather_into_tensor_coalesced_": ("all_gather", "outputs"),
    "_reduce_scatter_base_": ("reduce_scatter", "input_tensor"),
    "reduce_scatter_": ("reduce_scatter", "input_tensors"),
    "reduce_scatter_tensor_coalesced_": ("reduce_scatter", "inputs"),
    "broadcast_": ("broadcast", "tensors"),
    "reduce_": ("reduce", "tensors"),
    "alltoall_base_": ("all_to_all", "input"),
    "alltoall_": ("all_to_all", "input_tensors"),
    "gather_": ("gather", "input_tensors"),
    "scatter_": ("scatter", "output_tensors"),
    "send": ("send", "tensors"),
    "recv_": ("recv", "tensors"),
    "recv_any_source_": ("recv", "tensors"),
    "barrier": ("barrier", None),
    "monitored_barrier_": ("barrier", None),
}
FUNCTIONAL = {
    "all_reduce": ("all_reduce", "input"),
    "all_reduce_": ("all_reduce", "input"),
    "all_reduce_coalesced": ("all_reduce", "inputs"),
    "all_reduce_coalesced_": ("all_reduce", "inputs"),
    "all_gather_into_tensor": ("all_gather", "input"),
    "all_gather_into_tensor_out": ("all_gather", "input"),
    "all_gather_into_tensor_coalesced": ("all_gather", "inputs"),
    "reduce_scatter_tensor": ("reduce_scatter", "input"),
    "reduce_scatter_tensor_out": ("reduce_scatter", "input"),
    "reduce_scatter_tensor_coalesced": ("reduce_scatter", "inputs"),
    "broadcast": ("broadcast", "input"),
    "broadcast_": ("broadcast", "input"),
    "all_to_all_single": ("all_to_all", "input"),
    "isend": ("send", "tensor"),
    "irecv": ("recv", "tensor"),
}


def tensor_bytes(value) -> int:
    """Bytes of a tensor or of the tensors in (nested) lists of them."""
    if isinstance(value, torch.Tensor):
        return value.numel() * value.element_size()
    return sum(tensor_bytes(v) for v in value) if isinstance(value, (list, tuple)) else 0


def group_names(topo) -> dict[str, str]:
    """{process group name: mesh dimension} of the dimensions of a topology's meshes
    (`hlat.parallel.mesh.Topology`), and the default group as "world"."""
    names = {dist.group.WORLD.group_name: "world"}
    if topo.mesh is not None:
        names |= {group.group_name: dim for dim, group in topo.dim_groups().items()}
    return names


class Collectives(TorchDispatchMode):
    """Records the count and bytes of every collective issued while active, by (kind, mesh dimension)."""

    def __init__(self, dims: dict[str, str]):
        super().__init__()
        self.dims = dims  # group_names()
        self.issued: Counter = Counter()
        self.volume: Counter = Counter()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if any(issubclass(t, DTensor) for t in types):  # DTensor runs its op with this mode active: the collectives
            return NotImplemented  # it issues inside (an implicit redistribution) are recorded too
        table = {"c10d": C10D, FUNCTIONAL_NAMESPACE: FUNCTIONAL}.get(func.namespace, {})
        entry = table.get(func.overloadpacket.__name__)
        if entry is not None:
            self.record(func, entry, op_arguments(func, args) | (kwargs or {}))
        return func(*args, **(kwargs or {}))

    def record(self, func, entry: tuple[str, str | None], named: dict) -> None:
        kind, buffer = entry
        if "process_group" in named:
            group = dist.ProcessGroup.unbox(named["process_group"]).group_name
        else:
            group = str(named["group_name"])
        nbytes = tensor_bytes(named[buffer]) if buffer else 0
        if func.namespace == FUNCTIONAL_NAMESPACE and kind == "all_gather":
            nbytes *= named["group_size"]
        key = (kind, self.dims.get(group, f"group {group}"))
        self.issued[key] += 1
        self.volume[key] += nbytes

    def rows(self) -> list[dict]:
        """[{kind, dim, count, bytes}] of what was recorded, largest volume first."""
        return [
            {"kind": kind, "dim": dim, "count": self.issued[kind, dim], "bytes": self.volume[kind, dim]}
            for kind, dim in sorted(self.issued, key=lambda k: -self.volume[k])
        ]
