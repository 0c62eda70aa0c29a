"""Device selection through torch.accelerator and the process-group backend of the device type; an out-of-tree
device is simulated the way its plugin would register itself (a renamed PrivateUse1 device and a backend)."""

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from hlat import HlatError
from hlat.models import build_model
from hlat.parallel import parallelize
from hlat.parallel.config import ParallelConfig
from hlat.parallel.device import backend_for, pick_device
from hlat.parallel.mesh import Topology

ROOT = Path(__file__).resolve().parents[1]


def test_cpu_and_auto():
    assert pick_device("cpu") == torch.device("cpu")
    accelerator = torch.accelerator.current_accelerator(check_available=True)
    assert pick_device("auto").type == (accelerator.type if accelerator else "cpu")


@pytest.mark.skipif(torch.cuda.is_available(), reason="needs a machine without CUDA")
def test_missing_accelerator_is_one_line():
    with pytest.raises(HlatError, match="^train.device: 'cuda' was asked for but no accelerator is available$"):
        pick_device("cuda")


@pytest.mark.parametrize("device, backend", [("cpu", "gloo"), ("cuda", "nccl"), ("xpu", "xccl")])
def test_backend_follows_the_device_type(device, backend):
    assert backend_for(torch.device(device)) == backend


OUT_OF_TREE = """
import torch, torch.distributed as dist
from hlat import HlatError
from hlat.parallel.device import backend_for, pick_device

torch.utils.rename_privateuse1_backend("neuron")  # what TorchNeuron does on trn2
dist.Backend.register_backend("neuronccl", lambda *args, **kwargs: None, devices=["neuron"])
torch.accelerator.current_accelerator = lambda check_available=False: torch.device("neuron")
chosen = []
torch.accelerator.set_device_index = chosen.append
assert pick_device("auto") == torch.device("neuron", 3) == pick_device("neuron") and chosen == [3, 3]
assert backend_for(pick_device("auto")) == "neuronccl"
try:
    pick_device("cuda")
except HlatError as e:
    assert str(e) == "train.device: 'cuda' was asked for but the available accelerator is 'neuron'", e
else:
    raise AssertionError("cuda was accepted")
"""


def test_out_of_tree_accelerator_needs_no_code_change():
    env = {**os.environ, "PYTHONPATH": str(ROOT), "LOCAL_RANK": "3"}
    result = subprocess.run([sys.executable, "-c", OUT_OF_TREE], env=env, capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr


def test_compile_backend_reaches_torch_compile():
    from hlat.models.config import model_config

    cfg = ParallelConfig(compile=True, compile_backend="no_such_backend").resolved(1)
    model = build_model(model_config("tiny", n_layers=1, dim=32, n_heads=2, ffn_dim=64, vocab_size=64))
    with pytest.raises(HlatError, match="^parallel.compile_backend: Invalid backend: 'no_such_backend'"):
        parallelize(model, Topology(cfg, None), torch.device("cpu"), seed=0)
    cfg = ParallelConfig(compile=True, compile_backend="eager").resolved(1)
    ((_, part),) = parallelize(
        build_model(model_config("tiny", n_layers=1, dim=32, n_heads=2, ffn_dim=64, vocab_size=64)),
        Topology(cfg, None),
        torch.device("cpu"),
        0,
    )
    tokens = torch.randint(0, 64, (1, 8))
    assert part(tokens).shape == (1, 8, 64)
