"""The planner's activation bytes per layer against what hlat's model really keeps for backward: every tensor the
autograd graph saves (saved-tensor hooks) plus what activation checkpointing holds itself (its inputs, and under
selective recomputation the cached matmul and collective outputs), per block, deduplicated by storage. For no,
selective and full recomputation; in one process, and under torchrun with tensor parallelism 2 with and without
sequence parallelism; for a dense block and a mixture-of-experts one. Parameter, gradient and optimizer bytes
are checked exactly against the real model's parameters for every precision mode and sharding."""

from __future__ import annotations

import gc
import json
import time

import pytest
import torch

from hlat.models import build_model, materialize
from hlat.models.config import model_config
from hlat.optim.modes import MODES
from hlat.parallel.recompute import apply_recomputation
from hlat.planner.layout import Layout, Workload
from hlat.planner.memory import layer_activation_bytes, memory, stage_params
from hlat.profiles import load_profile

MODEL = dict(n_layers=3, dim=128, n_heads=4, ffn_dim=352, vocab_size=512, max_seq_len=256)
MOE = dict(MODEL, preset="tiny-moe", n_experts=8, experts_per_token=2)  # each token through 2 of 8 experts
SEQ, MB = 256, 2  # large enough that checkpointing's saved RNG state (5 KB per block on CPU) is noise
MODES_ = ("none", "selective", "full")
SETTLE_S = 0.2


def _storage(t: torch.Tensor) -> tuple[int, int]:
    from torch.distributed.tensor import DTensor

    if isinstance(t, DTensor):
        t = t.to_local()
    s = t.untyped_storage()
    return s.data_ptr(), s.nbytes()


def _live_tensors() -> dict[int, int]:
    """Storages of the plain tensors Python holds (checkpointing keeps its caches in Python objects)."""
    out = {}
    for obj in gc.get_objects():
        if type(obj) is torch.Tensor:
            ptr, nbytes = _storage(obj)
            out[ptr] = nbytes
    return out


def block_bytes(model: torch.nn.Module, tokens: torch.Tensor, name: str, **inputs) -> int:
    """Bytes block `name` keeps for backward after the model's forward pass: the tensors saved while it ran
    (saved-tensor hooks) and the tensors created while it ran that are still alive (checkpointing's caches),
    without the parameters, the buffers, the block's output (the next block's input) and what every block is
    given alike (`planner.memory.mask_bytes` counts the mask once). `inputs`: the model's other inputs
    (positions...)."""
    block = model.layers[name]
    state: dict = {"running": False, "saved": {}}

    def pack(t):
        if state["running"]:
            ptr, nbytes = _storage(t)
            state["saved"][ptr] = nbytes
        return t

    def enter(module, args):
        gc.collect()
        state["before"], state["running"] = _live_tensors(), True
        # what every block is given alike (rows of the rotary table, the mask): made once per forward pass
        state["shared"] = [_storage(t)[0] for t in args[1:] if isinstance(t, torch.Tensor)]

    def leave(module, args, output):
        gc.collect()
        state["running"] = False
        state["held"] = {p: n for p, n in _live_tensors().items() if p not in state["before"]}
        if torch.distributed.is_initialized():
            # a finished collective's output can stay referenced a moment longer by its work until the process
            # group's thread next runs (the likely source of one block input's bytes more, seen in loaded full
            # runs): keep only what is still alive after it had time to
            time.sleep(SETTLE_S)
            gc.collect()
            still = _live_tensors()
            state["held"] = {p: n for p, n in state["held"].items() if p in still}
        state["output"] = _storage(output)[0]

    handles = [block.register_forward_pre_hook(enter), block.register_forward_hook(leave)]
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        logits = model(tokens, **inputs)
    for h in handles:
        h.remove()
    kept = {**state["saved"], **state["held"]}
    for t in [*model.parameters(), *model.buffers()]:
        kept.pop(_storage(t)[0], None)
    for ptr in [state["output"], *state["shared"]]:
        kept.pop(ptr, None)
    del logits
    return sum(kept.values())


def measure(tp_mesh=None, sequence_parallel: bool = False, cp_mesh=None, fields: dict = MODEL) -> dict[str, float]:
    """Bytes the middle block keeps, for each recomputation mode (fp32 activations): the least of three forward
    passes. The error is one-sided: a tensor made while the block ran and still referenced from outside it when
    it ends (likely a collective's output that its pending work still holds) is counted though the block does not
    keep it. Under tensor parallelism with full recomputation, loaded full runs measured one block input's bytes more:
    the leave hook looks again after a pause and keeps what is still alive. Under
    context parallelism (`cp_mesh`) each rank runs its part of the sequences."""
    from hlat.parallel.context import apply_context_parallel, split_batch
    from hlat.parallel.tensor import apply_tensor_parallel

    cfg = model_config(**{"preset": "tiny", **fields})
    tokens = torch.randint(0, cfg.vocab_size, (MB, SEQ), generator=torch.Generator().manual_seed(0))
    batch = {"inputs": tokens}
    if cp_mesh is not None:
        batch = split_batch(batch, cp_mesh.size(), cp_mesh.get_local_rank())
    result = {}
    gc.freeze()  # what exists now is no block's: the scans for the tensors a block left skip it (the file: 57 ->
    # 24 CPU-s in the session's torchrun launch, whose workers hold every module hlat imports)
    try:
        for mode in MODES_:
            model = build_model(cfg)
            if tp_mesh is not None:
                apply_tensor_parallel(model, tp_mesh, sequence_parallel)
            if cp_mesh is not None:
                apply_context_parallel(model, cp_mesh)
            apply_recomputation(model, mode)
            materialize(model, torch.device("cpu"), 0)
            inputs = {k: t for k, t in batch.items() if k != "inputs"}
            result[mode] = min(block_bytes(model, batch["inputs"], "1", **inputs) for _ in range(3))
    finally:
        gc.unfreeze()
    return result


def planned(tp: int, sequence_parallel: bool, cp: int = 1, model: dict = MODEL) -> dict[str, float]:
    cfg = model_config(**{"preset": "tiny", **model})
    layout = Layout.of(tp=tp, cp=cp, micro_batch=MB, sequence_parallel=sequence_parallel)
    return {mode: layer_activation_bytes(cfg, SEQ, layout, mode, 4, flash=True) for mode in MODES_}


def _check(measured: dict, plan: dict) -> None:
    for mode in MODES_:
        assert plan[mode] == pytest.approx(measured[mode], rel=0.10), (mode, measured, plan)


@pytest.mark.parametrize("model", [MODEL, MOE], ids=["dense", "moe"])
def test_activation_bytes_match_the_saved_tensors_in_one_process(model):
    """A mixture-of-experts block keeps per choice its token and the four ffn_dim-wide tensors of its expert's
    SwiGLU, and its expert's output (hlat.planner.memory.experts_bytes): twice a dense SwiGLU's here."""
    torch.manual_seed(0)
    _check(measure(fields=model), planned(1, False, model=model))


@pytest.mark.parametrize("model", [MODEL, MOE], ids=["dense", "moe"])
def test_activation_bytes_match_under_tensor_and_sequence_parallelism(model, tmp_path, warm_torchrun):
    done = warm_torchrun.call(
        2,
        "test_activation_memory:measure_under_tensor_parallelism",
        str(tmp_path / "measured.json"),
        model,
        timeout=300,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    measured = json.loads((tmp_path / "measured.json").read_text())
    for sp in (False, True):
        _check(measured[str(sp)], planned(2, sp, model=model))


def test_activation_bytes_match_under_context_parallelism(tmp_path, warm_torchrun):
    """cp 2: each rank's queries are half of every sequence, and attention keeps both ranks' keys and values."""
    done = warm_torchrun.call(
        2, "test_activation_memory:measure_under_context_parallelism", str(tmp_path / "measured.json"), timeout=300
    )
    assert done.returncode == 0, done.stderr[-3000:]
    _check(json.loads((tmp_path / "measured.json").read_text()), planned(1, False, cp=2))


@pytest.mark.parametrize("precision", sorted(MODES))
def test_model_state_bytes_are_exact_for_every_precision_and_sharding(precision):
    cfg = model_config("tiny", **MODEL)
    params = sum(p.numel() for p in build_model(cfg).parameters())
    work, hw = Workload(cfg, SEQ, 8, precision), load_profile("cpu")
    mode = MODES[precision]
    assert stage_params(cfg, Layout.of()) == params
    for layout, shard, opt_shard in (
        (Layout.of(dp_replicate=4), 1, 1),
        (Layout.of(dp_shard=4), 4, 4),
        (Layout.of(dp_shard=4, zero1=True), 1, 4),
        (Layout.of(dp_replicate=2, dp_shard=2), 2, 2),
        (Layout.of(cp=4), 4, 4),  # the context-parallel ranks share the sharding
        (Layout.of(cp=2, dp_shard=2, zero1=True), 1, 4),
    ):
        m = memory(work, layout, hw)
        assert (m.weights, m.grads, m.optimizer) == (
            params * mode.weight_bytes / shard,
            params * mode.grad_bytes / shard,
            params * mode.optimizer_bytes / opt_shard,
        )


def measure_under_tensor_parallelism(path: str, model: dict) -> None:
    """On each rank of a 2-rank job (tests/warm_torchrun.py): tensor parallelism 2, with and without sequence
    parallelism (a mixture of experts' experts split over tp too)."""
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh

    mesh = init_device_mesh("cpu", (2,), mesh_dim_names=("tp",))
    out = {str(sp): measure(mesh, sp, fields=model) for sp in (False, True)}
    if dist.get_rank() == 0:
        with open(path, "w") as f:
            json.dump(out, f)


def measure_under_context_parallelism(path: str) -> None:
    """On each rank of a 2-rank job (tests/warm_torchrun.py): context parallelism 2."""
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh

    out = measure(cp_mesh=init_device_mesh("cpu", (2,), mesh_dim_names=("cp",)))
    if dist.get_rank() == 0:
        with open(path, "w") as f:
            json.dump(out, f)
