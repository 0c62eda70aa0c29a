"""`hlat preflight` under torchrun with 4 CPU ranks (gloo): the measured profile drives the planner; a rank whose
collectives are delayed is named as a straggler, one whose numerics differ is named. Small sizes, two repeats."""

from __future__ import annotations

import json
import subprocess
from dataclasses import replace

import pytest
from warm_torchrun import WarmTorchrun

from hlat.models.config import model_config
from hlat.planner.costs import block_shape, dp_block_shape, optimizer_bytes
from hlat.planner.layout import Layout, Workload
from hlat.planner.timing import step_time
from hlat.profiles import load_profile


def preflight(runner: WarmTorchrun, tmp_path, *extra: str) -> subprocess.CompletedProcess:
    """On 4 ranks of one thread each."""
    return runner.run(
        4,
        [
            "preflight",
            "--model",
            "tiny",
            "--train.seq_len",
            "32",
            "--train.micro_batch",
            "1",
            "--repeats",
            "2",
            "--sizes",
            "4096,65536",
            "--dtypes",
            "fp32",
            *extra,
        ],
        cwd=tmp_path,
        timeout=300,
    )


def test_preflight_writes_a_profile_the_planner_uses(tmp_path, warm_torchrun):
    # a threshold of 5% fails only a rank 20x slower than the median: load on a shared machine does not
    done = preflight(
        warm_torchrun,
        tmp_path,
        "--threshold",
        "0.05",
        "--json",
        "--tp",
        "1,2",
        "--out",
        str(tmp_path / "measured.toml"),
    )
    assert done.returncode == 0, done.stderr[-2000:]
    report = json.loads(done.stdout[done.stdout.index("{") : done.stdout.rindex("}") + 1])
    assert report["ranks"] == 4 and len(report["links"]) == 4 and not report["mismatched"]
    assert {r["op"] for r in report["collectives"]} == {"all_reduce", "all_gather", "reduce_scatter"}
    profile = load_profile(str(tmp_path / "measured.toml"))
    assert profile.devices_per_node == 4 and profile.measured.matmul_fp32 and profile.measured.all_reduce
    assert "measured: matmul, attention, whole block" in profile.sources()
    # a block at tp 2 with sequence parallelism, on groups of two neighbouring ranks, prices that layout
    work = Workload(model_config("tiny"), 32, 8, "fp32")
    tp2 = Layout.of(tp=2, dp_shard=2, sequence_parallel=True, activation_checkpoint="none")
    assert step_time(work, tp2, profile).layer == "measured block"
    # the config's FSDP timed too, over the ranks each tp degree leaves: what the step's data parallelism costs
    assert "data-parallel block" in profile.sources()
    shape = block_shape(model_config("tiny"), 32, 1, "fp32", 2, True, "none")
    block, ends, _ = profile.measured.block(dp_block_shape(shape, "fsdp", 2, False))
    priced = step_time(work, tp2, profile)
    assert priced.dp_comm == pytest.approx(max(0.0, 4 * (4 * block + ends) - priced.compute))
    assert profile.measured.block(
        dp_block_shape(block_shape(model_config("tiny"), 32, 1, "fp32", 1, False, "none"), "fsdp", 4, False)
    )
    from hlat.cli import main

    assert (
        main(
            [
                "plan",
                "--model",
                "tiny",
                "--hardware",
                str(tmp_path / "measured.toml"),
                "--seq-len",
                "32",
                "--global-batch",
                "8",
                "--precision",
                "fp32",
                "--json",
            ]
        )
        == 0
    )


def test_a_delayed_rank_and_a_rank_whose_numerics_differ_are_named(tmp_path, warm_torchrun):
    """One run with both faults: rank 2 sleeps 40 ms before each of its collectives, rank 3 sees different inputs
    in the numerics check."""
    done = preflight(warm_torchrun, tmp_path, "--debug-delay", "2:40", "--debug-perturb", "3")
    assert done.returncode != 0
    problems = [line for line in done.stderr.splitlines() if line.startswith("hlat preflight: ")]
    assert any("rank 2 (" in line and "straggler" in line for line in problems), problems
    assert [line for line in problems if "numerics differ" in line] == [
        next(line for line in problems if line.startswith("hlat preflight: rank 3 (") and "numerics" in line)
    ]


@pytest.mark.parametrize(
    "argv, message",
    [
        (["--tp", "3"], "--tp: 3 does not divide"),
        (["--dtypes", "fp16"], "--dtypes"),
        (["--dp", "hsdp"], "--dp: expected fsdp, zero1, ddp or none"),
        (["--threshold", "2"], "--threshold"),
        (["--fp8", "blockwise"], "--fp8: expected tensorwise, rowwise or none"),
    ],
)
def test_bad_options_are_one_line_errors(argv, message, capsys):
    from hlat.cli import main

    assert main(["preflight", "--model", "tiny", *argv]) == 2
    assert message in capsys.readouterr().err


def test_a_single_process_preflight_times_the_configs_block_as_the_trainer_runs_it(tmp_path, capsys):
    from hlat.cli import main

    out = tmp_path / "measured.toml"
    assert (
        main(
            [
                "preflight",
                "--model",
                "tiny",
                "--train.seq_len",
                "32",
                "--train.micro_batch",
                "2",
                "--repeats",
                "1",
                "--dtypes",
                "fp32",
                "--parallel.activation_checkpoint",
                "selective",
                "--precision.mode",
                "bf16_mixed",
                "--json",
                "--out",
                str(out),
            ]
        )
        == 0
    )
    printed = capsys.readouterr().out
    report = json.loads(printed[printed.index("{") : printed.rindex("}") + 1])
    measured = load_profile(str(out)).measured
    # the update is the trainer's (clipping and AdamW on the fp32 master weights) over every parameter of the
    # timed blocks and the rest (tiny has 4 layers: the whole model), priced at bf16_mixed's AdamW bytes
    update = next(row for row in report["compute"] if row["what"].startswith("update"))
    params = model_config("tiny").num_params()
    assert (update["what"], update["shape"]) == ("update (clip, AdamW) bf16_mixed", f"{params} params")
    assert measured.optimizer_gbs == pytest.approx(optimizer_bytes(params, 4, 4, 8) / update["seconds"] / 1e9, rel=1e-3)
    assert measured.block_shapes == [block_shape(model_config("tiny"), 32, 2, "bf16_mixed", 1, False, "selective")]
    assert measured.block_s[0] > 0 and measured.ends_s[0] > 0 and measured.embedding_s[0] > 0
    work = Workload(model_config("tiny"), 32, 4, "bf16_mixed")
    layout = Layout.of(micro_batch=2, activation_checkpoint="selective")
    t = step_time(work, layout, load_profile(str(out)))
    assert t.layer == "measured block"
    assert t.compute == pytest.approx(2 * (4 * measured.block_s[0] + measured.ends_s[0]))
    # a CPU has no FP8 tensor cores: nothing measured, said in one line (torchao's emulation is no hardware figure)
    assert report["fp8"].startswith("FP8 matmuls: not measured: cpu has no FP8 tensor cores")
    assert not (measured.matmul_fp8_tensorwise or measured.matmul_fp8_rowwise)


def test_with_parallel_compile_the_blocks_are_timed_compiled_and_price_compiled_plans(tmp_path):
    """A compiled block is another kernel schedule than an eager one: preflight compiles the blocks it times as the
    trainer does, records them under the compiled key, and the planner prices a compiled plan from them."""
    from torch._dynamo.utils import counters

    from hlat.cli import main

    out = tmp_path / "measured.toml"
    graphs = counters["stats"]["unique_graphs"]
    assert (
        main(
            [
                "preflight",
                "--model",
                "tiny",
                "--train.seq_len",
                "32",
                "--train.micro_batch",
                "2",
                "--repeats",
                "1",
                "--dtypes",
                "fp32",
                "--fp8",
                "none",
                "--parallel.compile",
                "true",
                "--out",
                str(out),
            ]
        )
        == 0
    )
    assert counters["stats"]["unique_graphs"] > graphs  # dynamo compiled what was timed
    measured = load_profile(str(out)).measured
    assert measured.block_shapes == [block_shape(model_config("tiny"), 32, 2, "fp32", 1, False, "none", compiled=True)]
    work, profile = Workload(model_config("tiny"), 32, 4, "fp32"), load_profile(str(out))
    compiled = Layout.of(micro_batch=2, activation_checkpoint="none", compile=True)
    assert step_time(work, compiled, profile).layer == "measured block"
    assert step_time(work, compiled.replaced(compile=False), profile).layer != "measured block"


def test_the_update_is_recorded_under_its_optimizers_name():
    """The pure-bf16 modes' BF16AdamW is another kernel than AdamW: its rate goes to its own field, so a profile can
    hold both (the planner prices each mode's update at its own)."""
    from hlat.measure.blocks import UpdateTiming, block_fields

    for optimizer, field, other in (
        ("AdamW", "optimizer_gbs", "bf16_optimizer_gbs"),
        ("BF16AdamW", "bf16_optimizer_gbs", "optimizer_gbs"),
    ):
        fields = block_fields([], UpdateTiming(optimizer, "bf16_sr", 10, 1.0, 123.0))
        assert fields[field] == 123.0 and other not in fields


@pytest.mark.parametrize("recipe", ["tensorwise", "rowwise"])
def test_fp8_rates_time_torchaos_float8_linear_at_each_block_linears_shape(recipe):
    """The path a GPU with FP8 tensor cores takes, on torchao's emulated Float8Linear (its speed means nothing
    here): one [forward FLOPs, TFLOP/s] row per distinct FLOP count of the blocks' linear layers, at every
    micro-batch and tensor-parallel degree asked for, each rate positive."""
    pytest.importorskip("torchao")
    from functools import partial

    import torch

    from hlat.measure.fp8 import float8_linear, linear_rates
    from hlat.measure.options import Options
    from hlat.planner.costs import block_linears, matmul_flops
    from hlat.planner.timing import linears_forward
    from hlat.profiles import Measured

    model, cpu = model_config("tiny"), torch.device("cpu")
    options = Options(
        model=model, seq_len=32, micro_batch=2, other_micro_batches=(1,), tps=(1, 2), repeats=1, precision="bf16_mixed"
    )
    make = partial(float8_linear, recipe=recipe, device=cpu, dtype=torch.float32, emulate=True)
    assert type(make(64, 32)).__name__ == "Float8Linear"
    rows, table = linear_rates(options, cpu, make, f"fp8 {recipe}")
    flops = {
        matmul_flops(shape) for mb in (1, 2) for tp in (1, 2) for shape in block_linears(model, 32 * mb, tp).values()
    }
    assert [flop for flop, _ in table] == sorted(flops) and all(rate > 0 for _, rate in table)
    assert (rows[0].what, rows[0].shape) == (f"linear wq tp1/wk tp1/wv tp1/wo tp1 fp8 {recipe} (fwd+bwd)", "32x256x256")
    # at one micro-batch and tp degree the planner prices a block's linears at exactly their measured time: the
    # rows' seconds, each counted for every linear layer of its shape (w1, w3 and w2 share a FLOP count)
    rows, table = linear_rates(replace(options, other_micro_batches=(), tps=(1,)), cpu, make, f"fp8 {recipe}")
    profile = replace(
        load_profile("cpu"), measured=Measured(matmul_bf16=[[1.0, 1.0]], **{f"matmul_fp8_{recipe}": table})
    )
    work = Workload(model, 32, 2, "bf16_mixed", fp8=recipe)
    measured = sum(row.seconds * (row.what.count("/") + 1) for row in rows)
    assert 3 * linears_forward(work, [], 64, 1, profile) == pytest.approx(measured, rel=1e-9)


def test_fp8_is_measured_only_on_fp8_tensor_cores_and_says_why_not(monkeypatch):
    """An A100 (compute capability 8.0) has none; an H100 (9.0) has them, given torchao."""
    import importlib.util

    import torch

    from hlat.measure import fp8
    from hlat.measure.options import Options

    options = Options(model=model_config("tiny"), seq_len=32, micro_batch=1, precision="bf16_sr")
    cuda = torch.device("cuda", 0)
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: "NVIDIA A100-SXM4-80GB")
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (8, 0))
    assert fp8.measure_fp8(options, cuda) == (
        "FP8 matmuls: not measured: NVIDIA A100-SXM4-80GB (compute capability "
        "8.0) has no FP8 tensor cores (8.9 or newer: Ada, Hopper, Blackwell); "
        "emulation is no hardware figure",
        [],
        {},
    )
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (9, 0))
    installed = importlib.util.find_spec("torchao") is not None
    assert fp8.fp8_unsupported(cuda) == ("" if installed else "torchao is not installed (pip install 'hlat[fp8]')")
    monkeypatch.setattr(importlib.util, "find_spec", lambda name: None)
    assert fp8.fp8_unsupported(cuda) == "torchao is not installed (pip install 'hlat[fp8]')"
    assert fp8.measure_fp8(replace(options, fp8=()), cuda)[0] == "FP8 matmuls: not measured (--fp8 none)"
