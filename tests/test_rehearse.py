"""`hlat rehearse`: one rank of a 1,024-rank job (TP 8, PP 4, DP 32, interleaved 1F1B, FSDP) and of an 8,192-rank
one (TP 32 over 8 kv heads, PP 8, DP 32, 1F1B, FSDP), the first and the last pipeline rank of each, on this CPU.
Their parameter, gradient and optimizer bytes equal the planner's exactly (and a count from the layers' shapes
made here), their activations are within 10% of the planner's, and the collectives they issue per step are,
kind by kind and mesh dimension by dimension, what the layout implies, derived here from the trainer's plan; a
layout `hlat train` refuses is refused in the same line; `hlat plan --rehearsal` takes what was measured."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from hlat.checkpoint.tiers import Writes
from hlat.cli import main

ROOT = Path(__file__).resolve().parents[1]
JOBS = {  # small models, full-size worlds: dims chosen so that FSDP pads nothing (dim 0 of every shard divides)
    1024: dict(
        dim=256,
        n_layers=8,
        n_heads=8,
        kv_heads=8,
        ffn_dim=512,
        vocab_size=1024,
        seq_len=64,
        tp=8,
        pp=4,
        virtual_stages=2,
        schedule="interleaved_1f1b",
        global_batch=128,
        nodes=128,
        nproc_per_node=8,
    ),
    8192: dict(
        dim=1024,
        n_layers=8,
        n_heads=32,
        kv_heads=8,
        ffn_dim=1024,
        vocab_size=2048,
        seq_len=64,
        tp=32,
        pp=8,
        virtual_stages=1,
        schedule="1f1b",
        global_batch=256,
        nodes=256,
        nproc_per_node=32,
    ),
}


def config_text(job: dict) -> str:
    return f"""
[model]
dim = {job["dim"]}
n_layers = {job["n_layers"]}
n_heads = {job["n_heads"]}
n_kv_heads = {job["kv_heads"]}
ffn_dim = {job["ffn_dim"]}
vocab_size = {job["vocab_size"]}
max_seq_len = {job["seq_len"]}

[precision]
mode = "fp32"

[parallel]
tp = {job["tp"]}
pp = {job["pp"]}
pp_schedule = "{job["schedule"]}"
virtual_stages = {max(2, job["virtual_stages"])}
dp_replicate = 1
dp_shard = -1

[train]
seq_len = {job["seq_len"]}
global_batch = {job["global_batch"]}
micro_batch = 1
device = "cpu"

[cluster]
nodes = {job["nodes"]}
nproc_per_node = {job["nproc_per_node"]}
"""


def hlat(*args: str, env: dict | None = None) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "hlat", *args],
        capture_output=True,
        text=True,
        timeout=900,
        env={**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1", **(env or {})},
    )


def refused(capsys, *args: str) -> tuple[int, str]:
    """An hlat command that stops at a one-line error, run in this process (no Python and torch start): its
    exit code and everything it wrote to stderr."""
    code = main(list(args))
    return code, capsys.readouterr().err


@pytest.fixture(scope="module", params=sorted(JOBS))
def rehearsed(request, tmp_path_factory) -> tuple[dict, dict, Path]:
    """(job, `hlat rehearse --json` of its default ranks, the JSON file)."""
    job = JOBS[request.param]
    config = tmp_path_factory.mktemp(f"world{request.param}") / "job.toml"
    config.write_text(config_text(job))
    done = hlat("rehearse", "--config", str(config), "--json")
    assert done.returncode == 0, done.stderr[-3000:]
    (config.parent / "rehearsal.json").write_text(done.stdout)
    return job, json.loads(done.stdout), config


def rank_stages(job: dict, pp_rank: int) -> list[int]:
    return [pp_rank + k * job["pp"] for k in range(job["virtual_stages"])]


def tp_rank_params(job: dict, stages: list[int]) -> int:
    """Parameters of one tensor-parallel rank's stages, from the layers' shapes as tensor parallelism cuts them:
    wq, w1, w3 by rows and wo, w2 by columns over tp; K and V by rows, or whole on every rank when there are
    fewer kv heads than ranks; norms whole; the vocabulary of the embedding and output over tp."""
    d, f, tp = job["dim"], job["ffn_dim"], job["tp"]
    kv_rows = job["kv_heads"] * d // job["n_heads"]
    kv_rows //= 1 if job["kv_heads"] % tp else tp
    block = d // tp * d + 2 * kv_rows * d + d * (d // tp) + 3 * (f // tp) * d + 2 * d
    per_stage = job["n_layers"] // (job["pp"] * job["virtual_stages"])
    last = job["pp"] * job["virtual_stages"] - 1
    vocab_rows = job["vocab_size"] // tp * d
    return (
        len(stages) * per_stage * block + (vocab_rows if 0 in stages else 0) + (d + vocab_rows if last in stages else 0)
    )


def expected_collectives(job: dict, stages: list[int]) -> dict[tuple[str, str], tuple[float | None, float]]:
    """{(kind, mesh dimension): (count or None, bytes)} per step of a rank holding `stages`, fp32."""
    d, tp, pp, seq = job["dim"], job["tp"], job["pp"], job["seq_len"]
    n_stages, dp = pp * job["virtual_stages"], job["nodes"] * job["nproc_per_node"] // (tp * pp)
    m = job["global_batch"] // dp  # micro-batches (of one sequence) per step
    blocks = len(stages) * job["n_layers"] // n_stages
    first, last = int(0 in stages), int(n_stages - 1 in stages)
    activation = seq * d * 4
    # sequence parallelism: per block and micro-batch two all-gathers into attention and the MLP and two
    # reduce-scatters out of them, and the same again in backward; the embedding reduce-scatters its output (and
    # gathers its gradient), the output projection gathers its input (and reduce-scatters its gradient)
    gathers = m * (4 * blocks + first + last)
    # the vocabulary-parallel loss: per micro-batch (one chunk of model.loss_chunk tokens) each rank's log-sum-exp
    # and target logit per token, gathered from every rank
    loss_gathers, loss_gathered = last * m, last * m * tp * 2 * seq * 4
    sends = m * sum((s != n_stages - 1) + (s != 0) for s in stages)  # activations forward, gradients back
    params = tp_rank_params(job, stages)
    units = blocks + first + last  # fully_shard units with parameters: each block, and a first or last stage's rest
    replicated_kv = job["kv_heads"] % tp != 0
    kv_grads = 2 * blocks * job["kv_heads"] * d // job["n_heads"] * d if replicated_kv else 0
    tp_sharded = (5 if replicated_kv else 7) * blocks + first + last  # parameters whose gradient tp splits
    n_params = 9 * blocks + first + 2 * last
    return {
        ("all_gather", "tp"): (gathers + loss_gathers, gathers * activation + loss_gathered),
        ("reduce_scatter", "tp"): (gathers, gathers * activation),
        ("send", "pp"): (sends, sends * seq // tp * d * 4),
        ("recv", "pp"): (sends, sends * seq // tp * d * 4),
        # FSDP over dp_shard alone: no replicas, so no all-reduce of the gradient shards across them
        ("all_gather", "dp_shard"): (units, params * 4),
        ("reduce_scatter", "dp_shard"): (units, params * 4),
        # the norms' weight gradients (partial over tp under sequence parallelism), the replicated K and V
        # weights' gradients, and clipping: one norm per gradient tp splits
        ("all_reduce", "tp"): (None, 4 * ((2 * blocks + last) * d + kv_grads + tp_sharded)),
        ("all_reduce", "dp_shard"): (None, 4 * n_params),  # clipping: every gradient is FSDP's shard
        ("all_reduce", "pp"): (1, 4),  # the squared gradient norm summed over the stages
        # the step's loss, its stop flag, whether a cross-replica all-reduce failed (parallel.replica_groups) and its
        # background writes' flags (a checkpoint's, the memory tier's and whether one failed:
        # hlat.checkpoint.tiers.Writes), fp32 each
        ("all_reduce", "world"): (1, 4 * (3 + len(Writes().flags()))),
    }


@pytest.mark.slow
def test_model_states_equal_the_planner_and_the_layers_shapes(rehearsed):
    job, out, _ = rehearsed
    dp_shard = out["parallel"]["dp_shard"]
    for rank in out["ranks"]:
        memory = rank["memory"]
        stored = tp_rank_params(job, rank["stages"]) * 4 / dp_shard
        for figure, per_param in (("params", 1), ("grads", 1), ("optimizer", 2)):
            assert memory[figure]["measured"] == memory[figure]["planned"] == stored * per_param, (figure, rank)


@pytest.mark.slow
def test_activations_within_ten_percent_of_the_planner(rehearsed):
    _, out, _ = rehearsed
    for rank in out["ranks"]:
        activations = rank["memory"]["activations"]
        assert activations["measured"] == pytest.approx(activations["planned"], rel=0.10), rank["rank"]


@pytest.mark.slow
def test_collectives_per_step_are_what_the_layout_implies(rehearsed):
    job, out, _ = rehearsed
    world = job["nodes"] * job["nproc_per_node"]
    assert [r["rank"] for r in out["ranks"]] == [0, world - world // job["pp"]]
    for rank in out["ranks"]:
        recorded = {
            (row["kind"], row["dim"]): (row["count"], row["bytes"]) for row in rank["collectives"] if row["count"]
        }  # (rows of kinds the planner prices and the rank did not issue have none)
        expected = expected_collectives(job, rank["stages"])
        assert set(recorded) == set(expected), rank["rank"]
        for key, (count, nbytes) in expected.items():
            assert recorded[key][1] == nbytes, (rank["rank"], key, recorded[key])
            assert count is None or recorded[key][0] == count, (rank["rank"], key, recorded[key])


@pytest.mark.slow
def test_the_planner_takes_a_rehearsal(rehearsed):
    job, out, config = rehearsed
    if job["tp"] != 8:
        pytest.skip("one rehearsal is enough")
    nodes = str(job["nodes"] * job["nproc_per_node"])
    done = hlat(
        "plan",
        "--config",
        str(config),
        "--hardware",
        "cpu",
        "--nodes",
        nodes,
        "--json",
        "--rehearsal",
        str(config.parent / "rehearsal.json"),
    )
    assert done.returncode == 0, done.stderr
    plan = json.loads(done.stdout)
    fullest = max(out["ranks"], key=lambda r: sum(v.get("step", v)["measured"] for k, v in r["memory"].items()))
    assert f"memory rehearsed (ranks 0, 768 of 1,024; the fullest, rank {fullest['rank']})" in plan["note"]
    assert "compute rehearsed on cpu" in plan["note"] and plan["plans"][0]["layer"] == "rehearsed"
    gib = plan["plans"][0]["memory_gib"]
    assert gib["weights"] == round(fullest["memory"]["params"]["measured"] / 2**30, 3)
    assert plan["plans"][0]["step_time_s"]["compute"] == round(
        max(r["time"]["step_compute_s"]["measured"] for r in out["ranks"]), 4
    )
    other = hlat(
        "plan",
        "--config",
        str(config),
        "--hardware",
        "cpu",
        "--nodes",
        nodes,
        "--rehearsal",
        str(config.parent / "rehearsal.json"),
        "--global-batch",
        "256",
    )
    assert other.returncode == 2 and "rehearsed a different job: global_batch 128 (planned: 256)" in other.stderr


@pytest.mark.parametrize(
    "override, line",
    [
        (
            ("--train.global_batch", "100"),
            "train.global_batch: 100 is not divisible by micro_batch 1 x data-parallel size 32",
        ),
        (("--model.n_layers", "4"), "parallel.pp: 8 pipeline stages but only 4 layers"),
    ],
)
def test_a_layout_train_refuses_is_refused_in_the_same_line(tmp_path, override, line, capsys, monkeypatch):
    config = tmp_path / "job.toml"
    config.write_text(config_text(JOBS[1024]))
    rehearse = refused(capsys, "rehearse", "--config", str(config), *override)
    monkeypatch.setenv("WORLD_SIZE", "1024")
    train = refused(capsys, "train", "--config", str(config), *override)
    assert rehearse == train == (2, f"hlat: error: {line}\n")


def test_a_rank_that_cannot_fit_here_fails_before_allocating(tmp_path):
    config = tmp_path / "job.toml"
    config.write_text(config_text({**JOBS[1024], "dim": 2**20, "n_heads": 2**12, "kv_heads": 2**12}))
    done = hlat("rehearse", "--config", str(config), "--rank", "0")
    assert done.returncode == 2
    job, error = done.stderr.splitlines()  # what is rehearsed, then why it cannot be
    assert job.startswith("hlat rehearse: llama, TP8 PP4 DP32 ") and job.endswith(": the job as its config states it")
    assert error.startswith("hlat: error: rank 0 needs ") and error.endswith(" GiB available")


@pytest.mark.parametrize(
    "flags, line",
    [
        (
            ("--micro-batches", "2"),
            "--micro-batches: the interleaved_1f1b schedule needs at least pp = 4 micro-batches, got 2",
        ),
        (
            ("--micro-batches", "6", "--train.global_batch", "256"),
            "--micro-batches: interleaved_1f1b needs a multiple of pp = 4, got 6",
        ),
        (("--micro-batches", "8"), "--micro-batches: 8 is not between 1 and the step's 4"),
        (("--rank", "1024"), "--rank: 1024 is not a rank of a world of 1024"),
    ],
)
def test_what_cannot_be_rehearsed_is_said_in_one_line(tmp_path, flags, line, capsys):
    config = tmp_path / "job.toml"
    config.write_text(config_text(JOBS[1024]))
    assert refused(capsys, "rehearse", "--config", str(config), *flags) == (2, f"hlat: error: {line}\n")


def test_the_planner_says_when_hlats_own_trainer_would_not_fit_a_recipe():
    """trn1's profile prices NeuronX Distributed's activations; hlat-70b's first stage, as hlat's trainer keeps it
    (torch's tensor parallelism keeps the projections' gathered inputs whole), does not fit a NeuronCore."""
    notes = {}
    for recipe in ("hlat-70b", "hlat-7b"):
        done = hlat("plan", "--config", recipe, "--json")
        assert done.returncode == 0, done.stderr
        notes[recipe] = json.loads(done.stdout)["note"]
    own = re.search(
        r"memory as trn1.32xlarge's stack keeps it \(megatron\); hlat's own trainer needs ([\d.]+) GiB "
        r"of 16 GiB per device \(activations ([\d.]+) GiB\)",
        notes["hlat-70b"],
    )
    assert own and float(own[1]) > 16 and float(own[2]) > 16, notes["hlat-70b"]
    assert "hlat's own trainer" not in notes["hlat-7b"]


@pytest.mark.slow
def test_mixed_precision_activations_and_weight_casts_as_the_planner_says(tmp_path):
    """bf16_mixed with selective recomputation over replicated kv heads: an fp32 residual stream beside bf16
    matmuls, and autocast's bf16 copies of the weights kept through the pipeline's step."""
    job = dict(
        JOBS[1024],
        n_heads=8,
        kv_heads=2,
        seq_len=128,
        pp=2,
        virtual_stages=1,
        schedule="1f1b",
        global_batch=16,
        nodes=8,
        nproc_per_node=8,
    )
    config = tmp_path / "job.toml"
    config.write_text(config_text(job).replace('"fp32"', '"bf16_mixed"'))
    done = hlat("rehearse", "--config", str(config), "--json", "--parallel.activation_checkpoint", "selective")
    assert done.returncode == 0, done.stderr[-3000:]
    for rank in json.loads(done.stdout)["ranks"]:
        memory = rank["memory"]
        assert memory["activations"]["measured"] == pytest.approx(memory["activations"]["planned"], rel=0.10)
        assert memory["parameter_casts"]["measured"] == memory["parameter_casts"]["planned"] > 0


@pytest.mark.slow
def test_fp8_weights_gathered_by_fsdp_are_counted_where_their_data_is(tmp_path):
    """Tensorwise FP8 under FSDP gathers torchao's wrapper tensors, which hold no storage of their own: the
    rehearsal counts the tensors inside them (it failed on the wrapper's storage) and its model states are still
    the planner's to the byte, its activations within 10%."""
    config = tmp_path / "job.toml"
    config.write_text(
        config_text(
            dict(JOBS[1024], tp=1, pp=1, virtual_stages=1, schedule="1f1b", global_batch=16, nodes=2, nproc_per_node=4)
        ).replace('"fp32"', '"bf16_mixed"')
    )
    done = hlat(
        "rehearse", "--config", str(config), "--rank", "0", "--steps", "1", "--precision.fp8", "tensorwise", "--json"
    )
    assert done.returncode == 0, done.stderr[-3000:]
    (rank,) = json.loads(done.stdout)["ranks"]
    memory = rank["memory"]
    for figure in ("params", "grads", "optimizer"):
        assert memory[figure]["measured"] == memory[figure]["planned"] > 0, figure
    assert memory["activations"]["measured"] == pytest.approx(memory["activations"]["planned"], rel=0.10)


# A rank whose step makes no data-parallel copies (dp = 1: nothing is gathered), so that what a shortened
# rehearsal extrapolates is its model states, which the planner prices exactly, and its activations.
SHORTENED = dict(JOBS[1024], n_layers=16, global_batch=16, nodes=4, nproc_per_node=8)


def shortened_job(tmp_path: Path) -> Path:
    config = tmp_path / "job.toml"
    config.write_text(config_text(SHORTENED) + 'hardware = "trn1.32xlarge"\n')
    return config


@pytest.fixture(scope="module")
def shortened(tmp_path_factory) -> tuple[dict, list[str], Path]:
    """Rank 0 of the 16-layer job rehearsed at 8 layers, its numbers made NaN (train.debug_nan_step) before its only
    update: `hlat rehearse --json`, its stderr lines, the config."""
    config = shortened_job(tmp_path_factory.mktemp("shortened"))
    done = hlat(
        "rehearse",
        "--config",
        str(config),
        "--rank",
        "0",
        "--steps",
        "1",
        "--micro-batches",
        "4",
        "--model.n_layers",
        "8",
        "--train.debug_nan_step",
        "1",
        "--json",
    )
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads(done.stdout), done.stderr.splitlines(), config


def test_non_finite_numbers_still_measure_the_update_and_a_shortened_job_says_so(shortened, capsys):
    """NaN before the only update (a real run would drop it): the update runs, and its gradients and optimizer
    states are measured at the planner's bytes, not as zero. The shortened model is named on the first line (before
    any progress line) and in the verdict, beside the fit extrapolated to the config's 16 layers."""
    from hlat.measure.rehearse_cli import show

    out, err, _ = shortened
    (rank,) = out["ranks"]
    memory = rank["memory"]
    assert rank["non_finite"] == "loss is nan"
    assert memory["optimizer"]["measured"] == memory["optimizer"]["planned"] > 0
    # the embedding's gradient comes out of DTensor whole over the vocabulary (docs/rehearsal.md), and with no data
    # parallelism to reduce it, it stays so: the planner prices the rank's vocabulary shard of it
    whole_embedding = SHORTENED["vocab_size"] * SHORTENED["dim"] * 4 * (1 - 1 / SHORTENED["tp"])
    assert memory["grads"]["measured"] == memory["grads"]["planned"] + whole_embedding > whole_embedding
    changed = "a CHANGED job: model.n_layers: 16 -> 8; train.debug_nan_step: 0 -> 1"
    assert err[0].startswith("hlat rehearse: llama, TP8 PP4 DP1 ") and changed in err[0]
    assert err[1].startswith("hlat rehearse: rank 0 of 32: start-up: its 2 blocks") and "step 1 of 1" in err[2]
    show(out)
    lines = capsys.readouterr().out.splitlines()
    assert changed in lines[0]
    (verdict,) = [line for line in lines if line.startswith("rank 0 fits one trn1.32xlarge device")]
    assert "as changed (model.n_layers: 16 -> 8; train.debug_nan_step: 0 -> 1); at the config's 16 layers" in verdict
    assert any(line.startswith("rank 0: loss is nan, as numbers in a fake world may be") for line in lines)


@pytest.mark.slow
def test_a_shortened_rehearsals_fit_extrapolates_to_the_full_job(shortened):
    """The fit extrapolated from 8 layers against the 16-layer job rehearsed whole. The extrapolation adds the
    planner's figures for the blocks added to what was measured, so its error is the planner's error on those
    blocks: none on model states (test_model_states_equal_the_planner_and_the_layers_shapes), nothing gathered
    (dp = 1), and on the activations at most the 10% the planner holds to (test_activations_within_ten_percent_of_
    the_planner) of the activations the blocks add."""
    out, _, config = shortened
    done = hlat("rehearse", "--config", str(config), "--rank", "0", "--steps", "1", "--micro-batches", "4", "--json")
    assert done.returncode == 0, done.stderr[-3000:]
    (full,), (short,) = json.loads(done.stdout)["ranks"], out["ranks"]
    added = full["memory"]["activations"]["step"]["planned"] - short["memory"]["activations"]["step"]["planned"]
    assert short["full_job_fits"]["needed"] == pytest.approx(full["fits"]["needed"], abs=0.10 * added)
    assert short["memory"]["gathered"]["measured"] == full["memory"]["gathered"]["measured"] == 0


def test_progress_counts_the_micro_batches_and_speaks_during_the_update(monkeypatch, capsys):
    """Within a step, what the rank is doing: the micro-batches whose forward and whose backward began on its first
    part, then the optimizer's update, which a line names while it runs (here the update waits for that line: a
    step's one long operation is not silent)."""
    import threading

    import torch

    from hlat import console
    from hlat.measure.progress import Progress

    monkeypatch.setattr(console, "EVERY_S", 0.05)
    part, said, named = torch.nn.Linear(2, 2), Progress(3, 64), threading.Event()
    optimizer = torch.optim.SGD(part.parameters(), lr=0.1)

    def slow_update(*_) -> None:
        assert named.wait(60), "no line named the update"

    def say(what: str) -> None:
        console.Ticker.say(said.ticker, what)
        if what.endswith(": optimizer update"):
            named.set()

    optimizer.register_step_pre_hook(slow_update)
    monkeypatch.setattr(said.ticker, "say", say)
    doing = []
    with said.watching(part, 2):
        said.step(1, 1)
        losses = [part(torch.ones(1, 2)).sum() for _ in range(2)]  # both forwards first, as 1F1B's warm-up
        doing.append(said.doing())
        for loss in losses:
            loss.backward()
            doing.append(said.doing())
        optimizer.step()  # its pre-hook runs after the one that marks the update
    assert doing == [f"step 1 of 1: micro-batch 2 of 2 forward, {b} backward" for b in (0, 1, 2)]
    lines = [line.split(" (")[0] for line in capsys.readouterr().err.splitlines()]
    assert {
        "hlat rehearse: rank 3 of 64: step 1 of 1",
        "hlat rehearse: rank 3 of 64: step 1 of 1: optimizer update",
    } <= {*lines}


@pytest.mark.slow
def test_one_rank_of_the_70b_long_context_stage_matches_the_planner():
    """hlat-70b-long: llama2-70b on 128 H100s in the layout the planner ranks first for 32,768 tokens (cp 8, TP 2,
    FSDP over dp_shard x cp), rank 0 rehearsed here with one of its blocks (a block's share is the same in each;
    benchmarks/rehearse_recipes.py rehearses the whole rank at the full sequence, results/rehearse_recipes.md), here
    at an eighth of the sequence (4,096 tokens: 512 of every sequence against all 4,096 keys; measured here 0.05%
    off the planner's activations, in 27 s against 35 at 8,192). Its parameters, gradients and optimizer states
    are the planner's to the byte, what it keeps for backward within 10% (the all-gathered keys and values, the
    mask, fp32 RMSNorm tensors on this CPU included)."""
    seq_len = 4096
    done = hlat(
        "rehearse",
        "--config",
        "hlat-70b-long",
        "--rank",
        "0",
        "--steps",
        "1",
        "--micro-batches",
        "1",
        "--model.n_layers",
        "1",
        "--train.device",
        "cpu",
        "--train.seq_len",
        str(seq_len),
        "--json",
    )
    assert done.returncode == 0, done.stderr[-3000:]
    out = json.loads(done.stdout)
    assert (out["seq_len"], out["parallel"]["cp"], out["world_size"]) == (seq_len, 8, 128)
    (rank,) = out["ranks"]
    memory = rank["memory"]
    for figure in ("params", "grads", "optimizer"):
        assert memory[figure]["measured"] == memory[figure]["planned"] > 0, figure
    assert memory["activations"]["measured"] == pytest.approx(memory["activations"]["planned"], rel=0.10)
    # per block and micro-batch, the keys and values of its 4 kv heads over the whole sequence (bf16) gathered over
    # cp and their gradients reduce-scattered, as the planner prices them (the gathers of positions and document
    # ids, 16 bytes a token, are not priced: 0.8% more)
    cp = {row["kind"]: row for row in rank["collectives"] if row["dim"] == "cp"}
    assert cp["all_gather"]["bytes"] == pytest.approx(2 * seq_len * 4 * 128 * 2, rel=0.01)
    for kind in ("all_gather", "reduce_scatter"):
        assert cp[kind]["step_bytes"] == pytest.approx(cp[kind]["planned_step_bytes"], rel=0.01), kind
