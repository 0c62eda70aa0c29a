"""Every private torch name hlat uses, in this one module: where torch has no public API for what hlat needs, it is
reached here and nowhere else, and tests/test_torch_private.py imports each on the pinned torch and fails naming
what moved.

- dispatch modes (`TorchDispatchMode`): how the rehearsal counts collectives and the bytes kept for backward, and
  how its fake world delivers receives;
- the fake process group (`fake_store`): one rank of a world that is not there (torchtitan's dry run uses it too);
- op overloads matched by identity: autocast's parameter cast (`CAST`), FSDP's parameter all-gather
  (`FSDP_ALL_GATHER`), the functional collectives that DTensor and tensor parallelism issue
  (`FUNCTIONAL_COLLECTIVES`, namespace `FUNCTIONAL_NAMESPACE`), and an op's argument names (`op_arguments`);
- inductor's setting that makes compiled casts round as eager ones (`emulate_precision_casts`);
- the tensor a tensor subclass wraps (`wrapped_tensor`: torchao's FP8 weights under FSDP);
- which file of a DCP checkpoint holds each chunk a load reads (`chunk_files`), and a checkpoint's storage data
  (`storage_data`: where each item lies, as the storage layer that wrote it put it);
- the key of DCP's save-plan cache (`own_plan_cache`, `forget_plans`): kept per process and keyed by the planner's
  class name, it would carry one run's plans into the next run of the same process, of another layout;
- a gloo group of its own, outside the default group and its world (`gloo_group`: replica groups' cross-replica
  and healing groups).
"""

from __future__ import annotations

from datetime import timedelta

import torch
import torch.distributed as dist
from torch.utils._python_dispatch import TorchDispatchMode  # noqa: F401 (re-exported)

CAST = torch.ops.aten._to_copy.default  # what autocast runs to cast a parameter
FSDP_ALL_GATHER = torch.ops.c10d._allgather_base_.default  # what fully_shard gathers parameters with
FUNCTIONAL_NAMESPACE = "_c10d_functional"
# the functional collectives whose outputs selective recomputation keeps, so that none is issued again
FUNCTIONAL_COLLECTIVES = (
    torch.ops._c10d_functional.reduce_scatter_tensor.default,
    torch.ops._c10d_functional.all_gather_into_tensor.default,
    torch.ops._c10d_functional.all_reduce.default,
)


def fake_store():
    """A store for torch's fake process group; importing it registers the "fake" backend."""
    from torch.testing._internal.distributed.fake_pg import FakeStore

    return FakeStore()


def op_arguments(func, args: tuple) -> dict:
    """An op's positional arguments by their names in its schema."""
    return {a.name: v for a, v in zip(func._schema.arguments, args)}


def emulate_precision_casts() -> None:
    """Compiled casts round as eager ones do (pytorch/pytorch#150859: FP8 rowwise)."""
    import torch._inductor.config

    torch._inductor.config.emulate_precision_casts = True


def wrapped_tensor(t: torch.Tensor) -> torch.Tensor | None:
    """The first inner tensor of a tensor subclass that wraps tensors of its own (`__tensor_flatten__`), or None for
    a tensor that wraps none."""
    if type(t) is torch.Tensor or not hasattr(t, "__tensor_flatten__"):
        return None
    return getattr(t, t.__tensor_flatten__()[0][0])


def chunk_files(metadata, plan) -> set[str]:
    """The files of a DCP checkpoint (its `metadata`) that the read items of a load `plan` read: DCP keeps each
    chunk's file in `storage_data[index].relative_path`, which no public API returns."""
    return {storage_data(metadata)[item.storage_index].relative_path for item in plan.items}


def storage_data(metadata) -> dict:
    """{item's index: where it lies} of DCP checkpoint metadata: DCP's file writer keeps there objects of a private
    class (`_StorageInfo`), hlat's raw snapshots their `RawChunk`s; a reader of both tells them apart."""
    return metadata.storage_data


PLAN_CACHES = (
    "_cached_save_plan",
    "_cached_all_plans",
    "_cached_global_plan",
    "_cached_metadata",
    "_cached_final_save_plan",
)


def own_plan_cache(planner, key: str) -> None:
    """Keep `planner`'s cached plans (DCP's `enable_plan_caching`) under `key` instead of its class's name."""
    planner._cached_plans_key = key


def forget_plans(key: str) -> None:
    """Drop the plans DCP cached under `key`."""
    from torch.distributed.checkpoint.planner import SavePlanner

    for cache in PLAN_CACHES:
        getattr(SavePlanner, cache).pop(key, None)


def gloo_group(store: dist.Store, rank: int, size: int, timeout_s: float) -> dist.ProcessGroup:
    """A gloo group of `size` processes meeting in `store`, this one `rank`, outside the default group: torch's
    `ProcessGroupGloo(store, rank, size, timeout)` constructor, which its docs do not name (`dist.new_group` makes
    groups of the default group's ranks only)."""
    return dist.ProcessGroupGloo(store, rank, size, timedelta(seconds=timeout_s))
