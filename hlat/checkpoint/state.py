"""A run's state as one object (`TrainState`): what a checkpoint of either tier holds and what a restore sets.

It is the model parts this rank holds, their optimizers, the data stream's position, the random generators and the
step, with `state_dict` (DCP's form: tensors by parameter name, so that it loads into any layout, and the trainer
state as one JSON string) and `load_state_dict`. The trainer state is one entry for all ranks, or one per rank
when each reads its own files (`state_key`).
"""

from __future__ import annotations

import json
import pickle
from pathlib import Path

import torch
from torch import nn
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_model_state_dict,
    get_optimizer_state_dict,
    set_model_state_dict,
    set_optimizer_state_dict,
)
from torch.distributed.tensor import DTensor

from hlat.checkpoint.durable import read_checkpoint
from hlat.data.packing import DataStream
from hlat.dtensor import local
from hlat.torch_private import wrapped_tensor

_FLAT = StateDictOptions(flatten_optimizer_state_dict=True)  # optimizer states keyed by parameter name
SETTINGS = "optim_settings"  # a packed state dict's optimizer settings, pickled


class TrainState:
    def __init__(
        self,
        parts: list[nn.Module],
        optimizers: list[torch.optim.Optimizer],
        stream: DataStream | None,
        state_key: str = "trainer",
        step: int = 0,
    ):
        self.parts, self.optimizers, self.stream, self.state_key = parts, optimizers, stream, state_key
        self.step = step  # optimizer steps done

    def state_dict(self, packed: bool = False) -> dict:
        """`packed`: the memory tier's form, the optimizer's per-parameter settings (learning rate, betas, ...: a
        dozen small objects a parameter, each a write of its own in DCP) in one entry, so that a snapshot every step
        writes little more than the tensors."""
        trainer = {"step": self.step, "data": self.stream.state_dict() if self.stream else None, "rng": rng_state()}
        optim = optimizer_state(self.parts, self.optimizers)
        state = {"model": model_state(self.parts), "optim": optim, self.state_key: json.dumps(trainer)}
        if packed:
            state["optim"] = {k: v for k, v in optim.items() if isinstance(v, torch.Tensor)}
            state[SETTINGS] = pickle.dumps({k: v for k, v in optim.items() if not isinstance(v, torch.Tensor)})
        return state

    def nbytes(self, optimizer: bool = True) -> dict:
        """Bytes of this rank's state dict (`held`), and its share of what is written (`written_share`): a tensor
        replicated over some mesh dimensions is written once among its holders. Without `optimizer`, the model's
        alone: reading the optimizer's states before its first step would make them (torch takes a step at lr 0,
        which counts in Adam's bias correction)."""
        held = share = 0.0
        for t in tensors_in(self.state_dict() if optimizer else model_state(self.parts)):
            nbytes = local(t).numel() * t.element_size()
            replicas = 1
            if isinstance(t, DTensor):
                for dim, placement in enumerate(t.placements):
                    replicas *= t.device_mesh.size(dim) if placement.is_replicate() else 1
            held, share = held + nbytes, share + nbytes / replicas
        return {"held": held, "written_share": share}

    def load(self, path: Path, data_and_rng: bool = True, packed: bool = False) -> None:
        """Restore checkpoint `path` (of any layout; `packed`: a snapshot of the memory tier) into this state."""
        state = self.state_dict(packed)
        read_checkpoint(path, state)
        self.load_state_dict(state, data_and_rng)

    def load_state_dict(self, state: dict, data_and_rng: bool = True) -> None:
        """Set the weights, optimizer states and step from `state` (as DCP loaded it into `state_dict()`'s form) and,
        unless a rollback asks to keep them going (`data_and_rng` false), the data position and the generators."""
        optim = state["optim"] | (pickle.loads(state[SETTINGS]) if SETTINGS in state else {})
        for part, optimizer in zip(self.parts, self.optimizers):
            set_model_state_dict(part, state["model"], options=StateDictOptions(strict=False))
            set_optimizer_state_dict(part, optimizer, optim, options=_FLAT)
        trainer = json.loads(state[self.state_key])
        if data_and_rng:
            if self.stream is not None:
                self.stream.load_state_dict(trainer["data"])
            set_rng_state(trainer["rng"])
        self.step = trainer["step"]


def tensors_in(state) -> list[torch.Tensor]:
    if isinstance(state, torch.Tensor):
        return [state]
    if isinstance(state, dict):
        return [t for value in state.values() for t in tensors_in(value)]
    return []


def model_state(parts: list[nn.Module]) -> dict:
    """The model's state dict by parameter name, merged over the parts (pipeline stages) this rank holds."""
    return {k: plain_tensor(v) for part in parts for k, v in get_model_state_dict(part).items()}


def optimizer_state(parts: list[nn.Module], optimizers: list[torch.optim.Optimizer]) -> dict:
    """Optimizer states keyed by parameter name (flattened), so they load into any other layout."""
    return {
        k: plain_tensor(v)
        for part, opt in zip(parts, optimizers)
        for k, v in get_optimizer_state_dict(part, opt, options=_FLAT).items()
    }


def load_weights(path: Path, parts: list[nn.Module]) -> None:
    """Load only the model weights of checkpoint `path` into `parts` (train.init_from, the tools)."""
    state = {"model": model_state(parts)}
    read_checkpoint(path, state)
    for part in parts:
        set_model_state_dict(part, state["model"], options=StateDictOptions(strict=False))


@torch.no_grad()
def plain_tensor(value):
    """A state value as a checkpoint keeps it: a tensor subclass that wraps one tensor of its own shape and dtype
    (torchao's FP8 weights under FSDP wrap their bf16 values) becomes that tensor, a view of the same storage, so
    the checkpoint loads without the library that made it (DCP pickles each tensor it writes)."""
    if isinstance(value, DTensor):
        local = value.to_local()
        inner = plain_tensor(local)
        return (
            value
            if inner is local
            else DTensor.from_local(
                inner, value.device_mesh, value.placements, run_check=False, shape=value.shape, stride=value.stride()
            )
        )
    inner = wrapped_tensor(value) if isinstance(value, torch.Tensor) else None
    if inner is not None and inner.shape == value.shape and inner.dtype == value.dtype:
        return inner
    return value


def rng_state() -> dict:
    return {
        "cpu": torch.get_rng_state().tolist(),
        "cuda": [s.tolist() for s in torch.cuda.get_rng_state_all()] if torch.cuda.is_available() else [],
    }


def set_rng_state(state: dict) -> None:
    torch.set_rng_state(torch.tensor(state["cpu"], dtype=torch.uint8))
    if state["cuda"] and torch.cuda.is_available():
        torch.cuda.set_rng_state_all([torch.tensor(s, dtype=torch.uint8) for s in state["cuda"]])
