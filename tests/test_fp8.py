"""FP8 training (`precision.fp8`, torchao's float8 emulated on the CPU): which layers it converts, its loss against
bf16's, every layout against its single-process FP8 run, checkpoints between FP8 and bf16 runs both ways, and the
refusals."""

import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file
from test_parallel import MODELS, job, torchrun, trajectory, write_toml

from hlat import HlatError
from hlat.config.job import build_config
from hlat.models import build_model
from hlat.optim.fp8 import convert_blocks, converted, fp8_support
from hlat.tools.inference import load_trained_model
from hlat.train.loop import train

BF16_ROUNDOFF = 2.0**-8  # unit roundoff of bf16 (8 significant bits)
E4M3_ROUNDOFF = 2.0**-4  # unit roundoff of float8 e4m3 (4 significant bits), what the forward's operands get


def fp8_job(run_dir: Path, recipe: str, mode: str = "bf16_mixed", **train_settings) -> dict:
    data = job(run_dir, "llama", **train_settings)
    data["precision"] = {"mode": mode, "fp8": recipe}
    return data


def test_only_the_blocks_linear_layers_become_fp8():
    model = build_model(build_config(fp8_job(Path("unused"), "tensorwise")).model)
    convert_blocks(model, "tensorwise", emulate=True, fsdp_fp8_all_gather=False)
    linears_per_block = 7  # wq, wk, wv, wo, w1, w2, w3
    assert converted(model) == linears_per_block * MODELS["llama"]["n_layers"]
    assert type(model.output).__name__ == "Linear" and type(model.tok_embeddings).__name__ == "Embedding"
    names = [name for name, _ in model.named_parameters()]
    assert names == [name for name, _ in build_model(model.cfg).named_parameters()]  # checkpoints keep their keys


@pytest.mark.parametrize("recipe", ["tensorwise", "rowwise"])
def test_fp8_loss_stays_within_fp8_rounding_of_bf16(recipe, tmp_path, capsys):
    """From the same weights and data, FP8 matmuls change each operand by up to e4m3's unit roundoff u = 2^-4;
    the loss, a mean over every token of the batch, stays well inside u of the bf16 run's over 10 steps (seen:
    0.6% at most). It must differ at all: an FP8 path that silently ran bf16 would match exactly."""
    runs = {}
    for fp8 in ("none", recipe):
        capsys.readouterr()
        train(build_config(fp8_job(tmp_path / fp8, fp8, steps=10)))
        runs[fp8] = [loss for loss, _ in trajectory(tmp_path / fp8)]
    assert capsys.readouterr().out.startswith("precision.fp8: FP8 matmuls emulated on cpu")  # the run's first line
    for step, (fp8_loss, bf16_loss) in enumerate(zip(runs[recipe], runs["none"]), 1):
        assert abs(fp8_loss - bf16_loss) <= E4M3_ROUNDOFF * bf16_loss, (step, fp8_loss, bf16_loss)
    assert runs[recipe] != runs["none"]
    assert runs[recipe][-1] < runs[recipe][0] - 0.3  # it learns


# (recipe, precision mode, processes, [parallel]): each recipe under each kind of parallelism, and the pure-bf16
# optimizer, at least once; a layout with tensor parallelism costs ~20 CPU-s (torchao's casts through DTensor)
LAYOUTS = [
    ("tensorwise", "bf16_mixed", 2, {"dp_shard": 2, "activation_checkpoint": "full"}),  # FP8 all-gather
    ("tensorwise", "bf16_sr", 2, {"dp_shard": 2}),  # FP8 all-gather under the pure-bf16 optimizer
    ("tensorwise", "bf16_mixed", 2, {"tp": 2, "sequence_parallel": True, "activation_checkpoint": "selective"}),
    ("tensorwise", "bf16_mixed", 4, {"pp": 2, "dp_shard": 2}),  # FP8 all-gather within pipeline stages
    ("rowwise", "bf16_mixed", 2, {"dp_replicate": 2, "dp_shard": 1}),
    ("rowwise", "bf16_mixed", 4, {"tp": 2, "dp_shard": 2}),
]


@pytest.fixture(scope="module")
def single_fp8(tmp_path_factory):
    """Single-process FP8 trajectories, one per (recipe, mode)."""
    root = tmp_path_factory.mktemp("single-fp8")
    runs = {}
    for recipe, mode in sorted({(recipe, mode) for recipe, mode, _, _ in LAYOUTS}):
        train(build_config(fp8_job(root / f"{recipe}-{mode}", recipe, mode)))
        runs[recipe, mode] = trajectory(root / f"{recipe}-{mode}")
    return runs


@pytest.mark.parametrize("recipe, mode, nproc, parallel", LAYOUTS)
def test_fp8_layouts_match_the_single_process(recipe, mode, nproc, parallel, single_fp8, tmp_path, warm_torchrun):
    """A split layout sums in another order: bf16 rounding differences of up to u = 2^-8, which the FP8 casts pass
    on whole when a value crosses a float8 rounding boundary. The loss, a mean over all the tokens, stays within
    u of the single process (seen: 2.7e-4 at most, tp 2); the gradient norm is compared while the weights are
    still nearly the same, over the first two steps, within 4u (seen: 6.2e-3 at most, tp 2), as for bf16."""
    config = write_toml(tmp_path / "job.toml", fp8_job(tmp_path / "run", recipe, mode))
    torchrun(warm_torchrun, nproc, config, parallel)
    got, expected = trajectory(tmp_path / "run"), single_fp8[recipe, mode]
    assert len(got) == len(expected) == 4
    for step, ((loss, norm), (ref_loss, ref_norm)) in enumerate(zip(got, expected), 1):
        assert abs(loss - ref_loss) <= BF16_ROUNDOFF * ref_loss, (step, loss, ref_loss)
        if step <= 2:
            assert abs(norm - ref_norm) <= 4 * BF16_ROUNDOFF * ref_norm, (step, norm, ref_norm)


@pytest.mark.slow
def test_compiled_fp8_blocks_follow_the_eager_ones(tmp_path):
    """torch.compile fuses the FP8 casts (on a GPU, what makes FP8 fast): the same numbers up to the order of
    bf16 roundings, the loss within u = 2^-8 of the eager run's (seen: 4e-4 at most over 4 steps). It is also the
    suite's compiled run without torchrun: the blocks' kernels fill the configured cache."""
    runs, cache = {}, tmp_path / "compile-cache"
    for compiled in (False, True):
        data = fp8_job(tmp_path / str(compiled), "tensorwise")
        data["parallel"] = {"compile": compiled, "compile_cache_dir": str(cache)}
        train(build_config(data))
        runs[compiled] = [loss for loss, _ in trajectory(tmp_path / str(compiled))]
    assert cache.is_dir() and any(cache.iterdir())
    for step, (compiled, eager) in enumerate(zip(runs[True], runs[False]), 1):
        assert abs(compiled - eager) <= BF16_ROUNDOFF * eager, (step, compiled, eager)


def test_checkpoints_move_between_fp8_and_bf16_runs(tmp_path, warm_torchrun):
    """An FP8 run under FSDP (weights all-gathered in FP8) saves plain weights: they load, in a process that never
    imports torchao, into a model without FP8 and export to transformers, and they resume a bf16 run; a bf16 run's
    checkpoint resumes an FP8 run."""
    fp8_run, bf16_run = tmp_path / "fp8", tmp_path / "bf16"
    config = write_toml(tmp_path / "fp8.toml", fp8_job(fp8_run, "tensorwise", steps=2))
    torchrun(warm_torchrun, 2, config, {"dp_shard": 2})
    train(build_config(fp8_job(bf16_run, "none", steps=2)))
    without_torchao = (
        "import sys; from hlat.tools.interop import export_hf; export_hf(sys.argv[1], sys.argv[2]); "
        "assert 'torchao' not in sys.modules"
    )
    done = subprocess.run(
        [sys.executable, "-c", without_torchao, str(fp8_run), str(tmp_path / "hf")], capture_output=True, text=True
    )
    assert done.returncode == 0, done.stderr[-3000:]
    exported = load_file(tmp_path / "hf" / "model.safetensors")
    (_, _, from_fp8), (_, _, from_bf16) = load_trained_model(fp8_run), load_trained_model(bf16_run)
    fp8_state, bf16_state = from_fp8.state_dict(), from_bf16.state_dict()
    assert converted(from_fp8) == 0 and fp8_state.keys() == bf16_state.keys()
    assert all(type(t) is torch.Tensor and t.dtype == bf16_state[k].dtype for k, t in fp8_state.items())
    assert torch.equal(exported["model.embed_tokens.weight"], fp8_state["tok_embeddings.weight"])
    assert torch.equal(exported["model.layers.0.self_attn.q_proj.weight"], fp8_state["layers.0.attention.wq.weight"])

    for run, other in ((fp8_run, "none"), (bf16_run, "rowwise")):
        train(build_config(fp8_job(run, other, steps=4), ["--train.resume", "auto"]))
        losses = [loss for loss, _ in trajectory(run)]
        assert len(losses) == 4 and all(loss == loss for loss in losses)


def test_fp8_is_refused_where_it_cannot_run(monkeypatch):
    assert fp8_support("none", torch.device("meta")) == "native"
    assert fp8_support("rowwise", torch.device("cpu")) == "emulated"
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (8, 0))
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: "NVIDIA A100-SXM4-80GB")
    with pytest.raises(HlatError, match=r"NVIDIA A100-SXM4-80GB \(compute capability 8.0\) has no FP8 tensor cores"):
        fp8_support("tensorwise", torch.device("cuda"))
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (9, 0))
    assert fp8_support("tensorwise", torch.device("cuda")) == "native"
    with pytest.raises(HlatError, match="xpu has no FP8 tensor cores"):
        fp8_support("tensorwise", torch.device("xpu"))
    monkeypatch.setitem(sys.modules, "torchao.float8", None)  # as if torchao were not installed
    with pytest.raises(HlatError, match=r"needs torchao: pip install 'hlat\[fp8\]'"):
        fp8_support("tensorwise", torch.device("cpu"))


def test_fp8_over_fp32_is_refused_in_one_line(tmp_path):
    from hlat.fields import ConfigError

    data = fp8_job(tmp_path, "rowwise", mode="fp32")
    with pytest.raises(ConfigError, match="precision.fp8: FP8 matmuls need a bf16 mode"):
        build_config(data)
