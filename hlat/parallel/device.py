"""The device this process trains on and the process-group backend that goes with it, through torch.accelerator:
CUDA, XPU, or an out-of-tree device (AWS's TorchNeuron registers 'neuron' on trn2) need no code here."""

from __future__ import annotations

import os

import torch
import torch.distributed as dist

from hlat import HlatError


def pick_device(name: str, setting: str = "train.device") -> torch.device:
    """`name` (the value of `setting`, for the error): 'auto' is the current accelerator if one is available, else
    the CPU; 'cpu'; or an accelerator type by name ('cuda', 'xpu', 'neuron', ...), which must be the one
    available."""
    if name == "cpu":
        return torch.device("cpu")
    accelerator = torch.accelerator.current_accelerator(check_available=True)
    if name == "auto":
        return local_device(accelerator.type if accelerator is not None else "cpu")
    if accelerator is None or accelerator.type != name:
        found = f"the available accelerator is {accelerator.type!r}" if accelerator else "no accelerator is available"
        raise HlatError(f"{setting}: {name!r} was asked for but {found}")
    return local_device(name)


def local_device(device_type: str) -> torch.device:
    """This process's device: under torchrun, accelerator number LOCAL_RANK (made the current one)."""
    if device_type == "cpu" or "LOCAL_RANK" not in os.environ:
        return torch.device(device_type)
    index = int(os.environ["LOCAL_RANK"])
    torch.accelerator.set_device_index(index)
    return torch.device(device_type, index)


def backend_for(device: torch.device) -> str:
    """The process-group backend torch registers for the device type (gloo for CPU, nccl for CUDA, xccl for XPU,
    and whatever an out-of-tree device registered for itself)."""
    try:
        return dist.get_default_backend_for_device(device)
    except (ValueError, RuntimeError):
        raise HlatError(
            f"train.device: no torch.distributed backend is registered for {device.type!r} devices; "
            "its PyTorch plugin must register one (torch.distributed.Backend.register_backend)"
        ) from None
