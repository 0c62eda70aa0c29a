"""What one rank holds, counted from its tensors (each storage once, at its real size):

- model states: its parameters (their shards, as stored between steps), its gradients as the update reads them,
  and its optimizer states (those shaped like their parameters, not the scalar step counters);
- what a step keeps for backward at its fullest (`KeptForBackward`): every tensor the autograd graph saves, and
  what recomputation holds itself, sampled as each backward pass begins (when the most is kept), less the
  tensors that existed before the step (states, buffers, pipeline receive buffers) and the parameters data
  parallelism gathered for the step (`gathered`, reported on their own: the gathered parameters, their gradients,
  and FSDP's all-gather buffers not yet copied into them); casts of the parameters that autocast made for the
  matmuls are reported on their own too (`parameter_casts`);
- before anything is allocated, the states a rank will hold, from its meta tensors (`meta_elements`)."""

from __future__ import annotations

import gc
import time
from pathlib import Path

import torch
from torch import nn
from torch.multiprocessing.reductions import StorageWeakRef

from hlat.dtensor import held, local
from hlat.torch_private import CAST, FSDP_ALL_GATHER, TorchDispatchMode


def storages(tensors) -> dict[int, int]:
    """{storage address: bytes} of the tensors' (local) storages."""
    out = {}
    for t in tensors:
        if t is not None:
            storage = held(t).untyped_storage()
            out[storage.data_ptr()] = storage.nbytes()
    return out


def storage_address(t: torch.Tensor) -> int:
    """The address of the storage holding this rank's data of `t`; 0 where it has none (a tensor subclass without
    storage, a storage freed to no bytes)."""
    try:
        return held(t).untyped_storage().data_ptr()
    except RuntimeError:
        return 0


def weak_storages(tensors) -> dict[int, StorageWeakRef]:
    """{storage address: weak reference} of the tensors' storages: an address is theirs only while they live."""
    return {held(t).untyped_storage().data_ptr(): StorageWeakRef(held(t).untyped_storage()) for t in tensors}


def still(refs: dict[int, StorageWeakRef], ptr: int) -> bool:
    return ptr in refs and not refs[ptr].expired()


def optimizer_tensors(optimizers: list[torch.optim.Optimizer]) -> list[torch.Tensor]:
    """The optimizers' per-element states (not the scalar step counters)."""
    return [
        t
        for opt in optimizers
        for state in opt.state.values()
        for t in state.values()
        if isinstance(t, torch.Tensor) and t.ndim > 0
    ]


def meta_elements(parts: list[nn.Module]) -> int:
    """Elements of this rank's (still meta) parameters, each counted once."""
    unique = {id(p): local(p) for part in parts for p in part.parameters()}
    return sum(t.numel() for t in unique.values())


def available_bytes(device: torch.device) -> int:
    """Memory free for this process now: the accelerator's free memory, or the host's MemAvailable."""
    if device.type != "cpu":
        return torch.accelerator.get_memory_info(device)[0]
    for line in Path("/proc/meminfo").read_text().splitlines():
        if line.startswith("MemAvailable:"):
            return int(line.split()[1]) * 1024
    raise OSError("no MemAvailable in /proc/meminfo")


def live_tensors() -> list[torch.Tensor]:
    """Every plain tensor Python holds (the saved-tensor hooks below make autograd's saved tensors such), not
    counting those frozen (`gc.freeze`)."""
    return [obj for obj in gc.get_objects() if type(obj) is torch.Tensor]


class KeptForBackward(TorchDispatchMode):
    """While active: the most bytes kept for backward at any backward pass's start, split into activations,
    gathered parameters (and their accumulating gradients, and the buffers of all-gathers over `sharding`, the
    names of the process groups FSDP shards over) and casts of parameters; `seconds` is the time the sampling
    itself took (to take out of the step's time)."""

    def __init__(self, parts: list[nn.Module], sharding: set[str] = frozenset()):
        super().__init__()
        self.parts, self.sharding, self.forward, self.casts, self.buffers = parts, sharding, False, {}, {}
        self.peak = {"activations": 0, "gathered": 0, "parameter_casts": 0}
        self.seconds = 0.0
        self.hooks = torch.autograd.graph.saved_tensors_hooks(self.pack, self.unpack)

    def __enter__(self):
        gc.collect()
        self.before = weak_storages(live_tensors())
        gc.freeze()  # what lived before the step is left out of every later collection and scan (fast samples)
        self.hooks.__enter__()
        return super().__enter__()

    def __exit__(self, *exc):
        self.hooks.__exit__(*exc)
        gc.unfreeze()
        return super().__exit__(*exc)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        if func == CAST and self.is_parameter(args[0]):
            self.casts |= weak_storages([out])
        if func == FSDP_ALL_GATHER and torch.distributed.ProcessGroup.unbox(args[2]).group_name in self.sharding:
            self.buffers |= {
                ptr: (ref, args[0].untyped_storage().nbytes()) for ptr, ref in weak_storages([args[0]]).items()
            }
        return out

    def is_parameter(self, t: torch.Tensor) -> bool:
        """A parameter, or this rank's part of one (a sharded parameter's local tensor, which a mixture of experts
        casts itself)."""
        if isinstance(t, nn.Parameter):
            return True
        ptr = storage_address(t)
        return bool(ptr) and any(storage_address(p) == ptr for part in self.parts for p in part.parameters())

    def pack(self, t: torch.Tensor) -> torch.Tensor:
        self.forward = True
        return t

    def unpack(self, t: torch.Tensor) -> torch.Tensor:
        started = time.perf_counter()
        gathered = self.gathered()  # at every use of a saved tensor: gradients accumulate through backward
        if self.forward:  # a backward pass begins: everything kept for it is still there
            self.forward = False
            self.sample(gathered)
        self.seconds += time.perf_counter() - started
        return t

    def gathered(self) -> dict[int, int]:
        """The parameters registered now that were not stored before the step (FSDP's whole copies while gathered),
        their gradients and the all-gather buffers alive (a gather issued ahead, not yet copied into its
        parameters): their bytes' peak is `gathered`. Returns those and every gradient there is now (the
        sharded ones are the update's), which a sample leaves out."""
        params = [p for part in self.parts for p in part.parameters()]
        whole = [p for p in params if not still(self.before, held(p).untyped_storage().data_ptr())]
        now = storages([*whole, *(p.grad for p in whole)])
        now |= {ptr: nbytes for ptr, (ref, nbytes) in self.buffers.items() if not ref.expired()}
        self.peak["gathered"] = max(self.peak["gathered"], sum(now.values()))
        return now | storages([p.grad for p in params])

    def sample(self, gathered: dict[int, int]) -> None:
        gc.collect()
        kept = {
            ptr: n for ptr, n in storages(live_tensors()).items() if not still(self.before, ptr) and ptr not in gathered
        }
        casts = sum(n for ptr, n in kept.items() if still(self.casts, ptr))
        self.peak["parameter_casts"] = max(self.peak["parameter_casts"], casts)
        self.peak["activations"] = max(self.peak["activations"], sum(kept.values()) - casts)
