"""The planner: memory and time formulas against published references, the search's recommendations, the
CLI, calibration, and (when the validation data is present) the fits and their held-out errors."""

from __future__ import annotations

import argparse
import json
import re
import sys
from dataclasses import asdict, replace
from pathlib import Path

import pytest

from hlat import HlatError
from hlat.config.job import build_config
from hlat.fields import ConfigError, load_toml
from hlat.models.config import model_config
from hlat.planner.calibration import Sample, fit_factors, nnls
from hlat.planner.cli import add_arguments, run
from hlat.planner.comms import collective
from hlat.planner.layout import Layout, Workload, layout_problem
from hlat.planner.memory import head_bytes, layer_activation_bytes, memory, stage_params
from hlat.planner.search import candidates, evaluate, search
from hlat.planner.timing import step_time
from hlat.profiles import FACTORS, Fit, load_profile, profile_names

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))  # the validation samples' home
from planner_samples import VALIDATION_DIR  # noqa: E402

TRN1 = load_profile("trn1.32xlarge")
ONLY_FLOPS = Fit(flops_factor=1.0, layer_overhead_ms=0.0, intra_factor=0.0, inter_factor=0.0, dp_factor=0.0)


def gpt(dim=4096, layers=32, heads=32, seq=2048, vocab=51200):
    return model_config(
        family="neox",
        dim=dim,
        n_layers=layers,
        n_heads=heads,
        ffn_dim=4 * dim,
        vocab_size=vocab,
        max_seq_len=seq,
        rotary_pct=1.0,
        tie_embeddings=True,
    )


def plan_args(*argv: str) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    add_arguments(parser)
    return parser.parse_args(list(argv))


# --- memory ------------------------------------------------------------------------------------------------------


def test_model_states_follow_the_published_parameter_count_and_sharding():
    work = Workload(model_config("llama2-7b"), 4096, 1024, "bf16_mixed")
    published = 6_738_415_616  # LLaMA-2 7B
    norms = (2 * 32 + 1) * 4096  # whole on every tensor-parallel rank
    per_device = (published - norms) / 8 + norms
    assert stage_params(work.model, Layout.of(tp=8)) == per_device
    ddp = memory(work, Layout.of(tp=8, dp_replicate=256, sequence_parallel=True), TRN1)
    zero1 = memory(work, Layout.of(tp=8, dp_shard=256, sequence_parallel=True, zero1=True), TRN1)
    fsdp = memory(work, Layout.of(tp=8, dp_shard=256, sequence_parallel=True), TRN1)
    assert ddp.weights == per_device * 4  # fp32 master weights
    assert ddp.optimizer == per_device * 8  # AdamW moments
    assert zero1.optimizer == pytest.approx(ddp.optimizer / 256) and zero1.weights == ddp.weights
    assert fsdp.weights + fsdp.grads + fsdp.optimizer == pytest.approx((ddp.weights + ddp.grads + ddp.optimizer) / 256)
    assert fsdp.buffers > 0 == ddp.buffers
    # Under a pipeline the trainer keeps FSDP's parameters gathered and its gradients whole through the step.
    piped = dict(tp=8, pp=2, sequence_parallel=True)
    fsdp_pp = memory(work, Layout.of(dp_shard=128, **piped), TRN1)
    ddp_pp = memory(work, Layout.of(dp_replicate=128, **piped), TRN1)
    assert fsdp_pp.weights + fsdp_pp.grads + fsdp_pp.buffers >= ddp_pp.weights + ddp_pp.grads
    assert fsdp_pp.optimizer == pytest.approx(ddp_pp.optimizer / 128)


def test_activations_match_korthikanti_without_dropout():
    """Korthikanti et al. 2022, per layer: sbh (10 + 24/t + 5as/(ht)) bytes, of which dropout's masks and output
    (2 sbh outside the tensor-parallel region, 3 a s^2 b inside) do not exist without dropout."""
    s, b, h, a, t = 2048, 2, 4096, 32, 8
    model = gpt(dim=h, heads=a, seq=s)
    sbh = s * b * h

    def act(recompute, sp):
        layout = Layout.of(tp=t, micro_batch=b, sequence_parallel=sp)
        return layer_activation_bytes(model, s, layout, recompute, 2, flash=False, stack="megatron")

    assert act("none", False) == pytest.approx(sbh * (8 + 24 / t) + 2 * a * s * s * b / t)
    assert act("selective", False) == pytest.approx(sbh * (8 + 24 / t))
    assert act("selective", True) == pytest.approx(sbh * 32 / t)
    assert act("full", True) == pytest.approx(2 * sbh / t)
    assert act("full", False) == pytest.approx(2 * sbh)
    flash = layer_activation_bytes(
        model, s, Layout.of(tp=t, micro_batch=b, sequence_parallel=False), "none", 2, flash=True, stack="megatron"
    )
    assert flash == pytest.approx(act("selective", False))  # fused attention never stores the scores


def test_pipeline_schedules_hold_the_expected_micro_batches_in_flight():
    model = gpt(layers=32)
    hw = replace(TRN1, devices_per_node=8)
    work = Workload(model, 2048, 64, "bf16_mixed")
    base = Layout.of(tp=2, pp=4, activation_checkpoint="selective")  # 8 devices, 64 micro-batches
    per_layer = layer_activation_bytes(model, 2048, base, "selective", 2, flash=False, stack="megatron")

    def acts(**kw):
        layout = base.replaced(**kw)
        return memory(work, layout, hw).activations - head_bytes(work, layout, 64, hw.activations)

    assert acts(pp_schedule="1f1b") == pytest.approx(32 * per_layer)  # p stages' worth: the whole model once
    assert acts(pp_schedule="gpipe") == pytest.approx(8 * 64 * per_layer)  # every micro-batch
    assert acts(pp_schedule="interleaved_1f1b", virtual_stages=2) == pytest.approx(32 * (1 + 3 / 8) * per_layer)


# --- time --------------------------------------------------------------------------------------------------------


def test_compute_matches_megatrons_flop_count_with_full_recomputation():
    """Narayanan et al. 2021: 96 B s L h^2 (1 + s/6h + V/16Lh) FLOPs per step with full recomputation."""
    model = gpt(dim=4096, layers=32, heads=32, seq=2048)
    hw = replace(TRN1, devices_per_node=1, peak_tflops=100.0)
    work = Workload(model, 2048, 8, "bf16_mixed")
    layout = Layout.of(micro_batch=2, activation_checkpoint="full")
    t = step_time(work, layout, hw, ONLY_FLOPS)
    B, s, L, h, V = 8, 2048, 32, 4096, 51200
    megatron = 96 * B * s * L * h * h * (1 + s / (6 * h) + V / (16 * L * h))
    assert t.compute * 100e12 == pytest.approx(megatron, rel=5e-3)  # biases and norms are the difference


def test_pipeline_bubble_p2p_cost_and_linearity_in_the_factors():
    model, hw = gpt(layers=32), replace(TRN1, devices_per_node=8)
    work = Workload(model, 2048, 64, "bf16_mixed")
    # The last stage's output layer: 6 V h FLOPs per token for the 64 x 2048 tokens; filling and draining the
    # pipeline runs through the other stages, which lack it.
    output = 6 * model.vocab_size * model.dim * 64 * 2048 / (hw.peak_tflops * 1e12)
    for layout, bubble in (
        (Layout.of(pp=8, micro_batch=1), 7 / 64),
        (Layout.of(pp=8, micro_batch=1, pp_schedule="interleaved_1f1b", virtual_stages=2), 7 / 128),
    ):
        t = step_time(work, layout, hw, ONLY_FLOPS)
        assert t.bubble / (t.compute - output) == pytest.approx(bubble)
        # each micro-batch's activations go forward and their gradients back, v times per pipeline rank
        handshakes = step_time(work, layout, hw, replace(ONLY_FLOPS, p2p_ms=1.0)).pp_comm
        assert handshakes == pytest.approx(64 * 2 * layout.virtual_stages * 1e-3)
    layout = Layout.of(tp=2, pp=2, dp_shard=2, micro_batch=2, zero1=True, sequence_parallel=True)
    fit = hw.fit
    doubled = replace(fit, **{k: 2 * getattr(fit, k) for k in FACTORS})
    one, two = step_time(work, layout, hw, fit), step_time(work, layout, hw, doubled)
    assert two.total - two.optimizer == pytest.approx(2 * (one.total - one.optimizer))


def test_fsdp_under_a_pipeline_communicates_like_zero1():
    """The trainer keeps FSDP's parameters gathered through a pipelined step and reduces once (torch's
    pipelining defers the gradient sync), so its traffic is ZeRO-1's: one reduce-scatter and one all-gather."""
    work = Workload(gpt(layers=8), 2048, 64, "bf16_mixed")
    hw = replace(TRN1, devices_per_node=8)
    fsdp = step_time(work, Layout.of(pp=2, dp_shard=8, micro_batch=1), hw)
    zero1 = step_time(work, Layout.of(pp=2, dp_shard=8, zero1=True, micro_batch=1), hw)
    unpiped = step_time(work, Layout.of(dp_shard=16, micro_batch=1), hw)
    assert fsdp.dp_comm == pytest.approx(zero1.dp_comm) and fsdp.dp_comm > 0
    assert unpiped.dp_comm != pytest.approx(
        step_time(work, Layout.of(dp_shard=16, zero1=True, micro_batch=1), hw).dp_comm
    )


def test_host_overhead_shows_only_where_layers_are_small_and_scores_cost_seq_squared():
    model, hw = gpt(layers=8), replace(TRN1, devices_per_node=1, peak_tflops=100.0, hbm_gbs=1000.0)
    work = Workload(model, 2048, 8, "bf16_mixed")
    layout = Layout.of(micro_batch=1, activation_checkpoint="full")
    device = step_time(work, layout, hw, ONLY_FLOPS)
    per_layer = (device.compute - 6 * model.vocab_size * model.dim * 2048 * 8 / 100e12) / (8 * 8)
    host = replace(ONLY_FLOPS, layer_overhead_ms=2e3 * per_layer)  # twice the device's time per layer
    below = replace(ONLY_FLOPS, layer_overhead_ms=0.5e3 * per_layer)
    assert step_time(work, layout, hw, host).compute - device.compute == pytest.approx(8 * 8 * per_layer)
    assert step_time(work, layout, hw, below).compute == pytest.approx(device.compute)  # hidden behind the device
    scores = replace(ONLY_FLOPS, attention_factor=1.0)
    extra = [
        step_time(Workload(model, s, 8, "bf16_mixed"), layout, replace(hw, flash_attention=False), scores).compute
        - step_time(Workload(model, s, 8, "bf16_mixed"), layout, replace(hw, flash_attention=True), scores).compute
        for s in (1024, 2048)
    ]
    assert extra[1] == pytest.approx(4 * extra[0]) and extra[1] == pytest.approx(8 * 8 * 32 * 2048**2 * 2 / 1e12)


def test_fit_recovers_known_factors_across_host_and_device_bound_runs():
    hw = replace(TRN1, devices_per_node=8, flash_attention=False)
    truth = Fit(
        flops_factor=1.3,
        layer_overhead_ms=4.0,
        intra_factor=2.0,
        inter_factor=1.0,
        dp_factor=0.5,
        attention_factor=40.0,
        p2p_ms=0.8,
    )
    samples = []
    for dim, seq in ((1024, 1024), (2048, 1024), (4096, 2048)):
        work = Workload(gpt(dim=dim, layers=8, heads=16, seq=seq), seq, 16, "bf16_mixed")
        for tp, pp, mb in ((1, 1, 1), (2, 1, 2), (4, 1, 1), (8, 1, 4), (2, 1, 4), (2, 2, 1), (1, 4, 2)):
            layout = Layout.of(tp=tp, pp=pp, dp_replicate=8 // (tp * pp), micro_batch=mb, activation_checkpoint="full")
            samples.append(Sample("", work, layout, hw, step_time(work, layout, hw, truth).total))
    fitted = fit_factors(samples, FACTORS, Fit(), "test")
    # All runs sit in one node: nothing crosses nodes, so inter_factor is not identified.
    assert [getattr(fitted, k) for k in FACTORS if k != "inter_factor"] == pytest.approx(
        [getattr(truth, k) for k in FACTORS if k != "inter_factor"], rel=1e-3
    )


def test_collectives_follow_the_ring_formula_and_share_the_nic():
    hw = replace(
        TRN1, devices_per_node=8, intra_gbs=100.0, intra_latency_us=0.0, inter_gbps=800.0, inter_latency_us=0.0
    )
    nbytes = 1e9
    intra, inter = collective(hw, nbytes, group=8, per_node=8, passes=2)
    assert (intra, inter) == (pytest.approx(2 * 7 / 8 * nbytes / 100e9), 0.0)
    # 4 nodes, one member per node: 8 such groups share each node's 100 GB/s.
    intra, inter = collective(hw, nbytes, group=4, per_node=1, passes=2)
    assert (intra, inter) == (0.0, pytest.approx(2 * 3 / 4 * nbytes / (100e9 / 8)))


def test_tensor_parallelism_beyond_a_node_runs_over_the_network():
    model, hw = gpt(layers=8), replace(TRN1, devices_per_node=8)
    work = Workload(model, 2048, 16, "bf16_mixed")
    slow_network = replace(hw.fit, inter_factor=2 * hw.fit.inter_factor)
    for tp, crosses in ((8, False), (16, True)):
        layout = Layout.of(tp=tp, dp_replicate=16 // tp, micro_batch=1)
        base, slow = step_time(work, layout, hw).tp_comm, step_time(work, layout, hw, slow_network).tp_comm
        assert base > 0 and (slow > 1.2 * base if crosses else slow == base)


# --- search and recommendations ------------------------------------------------------------------------------------


def test_llama2_7b_on_64_trn1_nodes_is_tp8_pp1():
    work = Workload(model_config("llama2-7b"), 4096, 1024, "bf16_mixed")
    best = search(work, TRN1, 64).plans[0]
    assert (best.layout.tp, best.layout.pp) == (8, 1)
    assert best.memory.fits and 0.2 < best.mfu < 0.6


def test_llama2_70b_on_64_trn1_nodes_is_a_large_tp_deep_pp_zero1_layout():
    work = Workload(model_config("llama2-70b"), 4096, 1024, "bf16_mixed")
    result = search(work, TRN1, 64)
    best = result.plans[0].layout
    assert best.tp >= 16 and best.pp >= 4 and best.zero1
    hlat = evaluate(work, Layout.of(tp=32, pp=8, dp_shard=8, zero1=True, activation_checkpoint="selective"), TRN1, 64)
    assert hlat.memory.fits and hlat.time.total > result.plans[0].time.total
    with pytest.raises(HlatError, match="no layout"):
        run(plan_args("--model", "llama2-70b", "--hardware", "trn1.32xlarge", "--nodes", "1", "--seq-len", "4096"), [])


def test_candidates_are_valid_and_ties_rank_the_simplest_first():
    work = Workload(model_config("llama2-13b"), 4096, 256, "bf16_mixed")
    layouts = list(candidates(work, TRN1, 4))
    assert len(layouts) == len(set(layouts)) > 100
    assert all(layout_problem(work, lay, 128) is None for lay in layouts)
    exact = search(work, TRN1, 4, tolerance=0.0).plans
    assert all(a.tokens_per_s >= b.tokens_per_s for a, b in zip(exact, exact[1:]))
    tied = search(work, TRN1, 4, tolerance=0.05).plans
    assert tied[0].tokens_per_s >= 0.95 * exact[0].tokens_per_s
    assert (tied[0].layout.pp, tied[0].layout.virtual_stages) <= (exact[0].layout.pp, exact[0].layout.virtual_stages)


@pytest.mark.parametrize("hardware", ["trn1.32xlarge", "p4d.24xlarge"])
def test_full_70b_search_on_256_nodes(hardware):
    """Its speed is timed by benchmarks/planner_validation.py, not here."""
    work = Workload(model_config("llama2-70b"), 4096, 1024, "bf16_mixed")
    result = search(work, load_profile(hardware), 256)
    assert result.plans and result.considered > 500


def test_neox_20b_tokens_per_dollar_is_flat_across_4_to_64_nodes():
    """The published cost table: TP 8 x PP 4 on 4-64 trn1 nodes, 3.22M-3.30M tokens/$ at the reserved price."""
    work = Workload(model_config("neox-20b"), 2048, 16384, "bf16_sr")
    per_dollar = []
    for nodes in (4, 8, 16, 32, 64):
        layout = Layout.of(tp=8, pp=4, dp_replicate=nodes, sequence_parallel=True, activation_checkpoint="full")
        per_dollar.append(evaluate(work, layout, TRN1, nodes, TRN1.price_reserved).tokens_per_dollar)
    assert max(per_dollar) / min(per_dollar) < 1.10
    assert all(abs(x / 3.26e6 - 1) < 0.10 for x in per_dollar)


def test_tokens_per_dollar_objective_tries_smaller_clusters():
    work = Workload(model_config("llama2-7b"), 4096, 1024, "bf16_mixed")
    result = search(work, TRN1, 16, "tokens_per_dollar", TRN1.price_on_demand)
    assert {p.nodes for p in result.plans} == {1, 2, 4, 8, 16}
    assert result.plans[0].tokens_per_dollar >= 0.97 * max(p.tokens_per_dollar for p in result.plans)
    with pytest.raises(HlatError, match="no price"):
        search(work, load_profile("trn2.48xlarge"), 4, "tokens_per_dollar", 0.0)


# --- CLI -----------------------------------------------------------------------------------------------------------


def test_cli_json_and_emit(tmp_path, capsys):
    out = tmp_path / "parallel.toml"
    assert (
        run(
            plan_args(
                "--model",
                "llama2-7b",
                "--hardware",
                "trn1.32xlarge",
                "--nodes",
                "64",
                "--global-batch",
                "1024",
                "--seq-len",
                "4096",
                "--json",
                "--top",
                "3",
                "--emit",
                str(out),
            ),
            [],
        )
        == 0
    )
    report = json.loads(capsys.readouterr().out)
    assert len(report["plans"]) == 3 and report["plans"][0]["parallel"]["tp"] == 8
    emitted = load_toml(out)
    assert set(emitted["parallel"]) >= {
        "dp_replicate",
        "dp_shard",
        "tp",
        "pp",
        "pp_schedule",
        "sequence_parallel",
        "zero1",
        "activation_checkpoint",
    }
    # the trainer takes the emitted tables as they are, and finds the layout valid on 64 x 32 devices
    cfg = build_config({**emitted, "model": {"preset": "llama2-7b"}})
    p = cfg.resolved_parallel(64 * 32)
    assert (p.tp, p.dp * p.tp * p.pp, cfg.train.global_batch, cfg.train.seq_len) == (8, 64 * 32, 1024, 4096)


def test_cli_given_layout_and_table(capsys, tmp_path):
    assert (
        run(
            plan_args(
                "--model",
                "llama2-70b",
                "--hardware",
                "trn1.32xlarge",
                "--nodes",
                "64",
                "--seq-len",
                "4096",
                "--tp",
                "32",
                "--pp",
                "8",
                "--zero1",
            ),
            [],
        )
        == 0
    )
    assert "TP32 PP8 DP8" in capsys.readouterr().out
    emit = tmp_path / "never.toml"
    assert (
        run(
            plan_args(
                "--model",
                "llama2-70b",
                "--hardware",
                "trn1.32xlarge",
                "--nodes",
                "64",
                "--seq-len",
                "4096",
                "--tp",
                "8",
                "--recompute",
                "none",
                "--emit",
                str(emit),
            ),
            [],
        )
        == 1
    )
    assert "does not fit" in capsys.readouterr().out and not emit.exists()  # says so, exits 1, writes nothing
    config = tmp_path / "model.toml"
    config.write_text('[model]\npreset = "tiny"\nn_layers = 6\n[train]\nseq_len = 512\nglobal_batch = 16\n')
    assert run(plan_args("--config", str(config), "--hardware", "cpu"), []) == 0
    assert "seq 512 (train.seq_len), batch 16" in capsys.readouterr().out


@pytest.mark.parametrize(
    "argv, message",
    [
        (["--model", "llama2-7b", "--hardware", "h100"], "unknown profile 'h100'"),
        (["--model", "gpt5", "--hardware", "cpu"], "unknown preset 'gpt5'"),
        (["--model", "llama2-7b", "--hardware", "trn1.32xlarge", "--tp", "3"], "does not divide"),
        (
            ["--model", "llama2-7b", "--hardware", "trn1.32xlarge", "--tp", "64", "--nodes", "2"],
            "parallel.tp: 64 does not divide",
        ),
        (["--model", "llama2-7b"], "--hardware is required"),
    ],
)
def test_cli_rejects_bad_input_in_one_line(argv, message):
    with pytest.raises(HlatError, match=message):
        run(plan_args(*argv), [])


# --- a layout that does not suit its hardware (hlat/planner/advice.py) ------------------------------------------------


def plan_output(capsys, *argv: str) -> str:
    from hlat.cli import main

    assert main(["plan", *argv]) == 0
    return capsys.readouterr().out


def searched(capsys, *argv: str) -> dict:
    """What `--search` puts first, as --json gives it."""
    return json.loads(plan_output(capsys, *argv, "--search", "--json", "--top", "1"))["plans"][0]


def advice_lines(out: str) -> list[str]:
    return [line for line in out.splitlines() if "tensor parallelism across nodes" in line or "needlessly" in line]


def test_the_70b_recipes_tp32_on_p5_names_the_cross_node_group_and_the_planners_layout(capsys):
    """HLAT-70B's trn1 layout (TP32) on 8-GPU p5 nodes: one line names the tensor-parallel group across nodes and
    what --search finds on the same 256 nodes, with its step time, MFU, days and price; the table shows both."""
    best = searched(capsys, "--config", "hlat-70b", "--hardware", "p5.48xlarge")
    out = plan_output(capsys, "--config", "hlat-70b", "--hardware", "p5.48xlarge")
    (line,) = advice_lines(out)
    assert line.startswith(
        "tensor parallelism across nodes: TP32 PP8 DP8 mb1 1F1B SP ZeRO-1 AC:sel puts each TP32 "
        "group on 4 p5.48xlarge nodes of 8 processes"
    )
    days, dollars = best["budget"]["days"], best["budget"]["dollars"]
    said = re.search(r"chooses (.+): (\S+) s/step, (\S+)% MFU, (\S+) days, \$(\S+)M \(for 1.89T tokens\)", line)
    assert said, line
    assert said.group(1, 2, 3, 5) == (
        best["layout"],
        f"{best['step_time_s']['total']:.3g}",
        f"{best['mfu'] * 100:.1f}",
        f"{dollars / 1e6:.3g}",
    )
    assert float(said[4]) == pytest.approx(days, abs=0.05 + 0.005)  # one decimal there, two in --json
    assert f"  2   {best['layout']}" in out and "#2: what --search chooses" in out
    assert best["layout"].startswith("TP8 ")  # within a node
    both = json.loads(plan_output(capsys, "--config", "hlat-70b", "--hardware", "p5.48xlarge", "--json"))
    assert [p["layout"] for p in both["plans"]][1] == best["layout"] and line in both["notes"]


def test_a_layout_that_suits_its_hardware_gets_no_line(capsys):
    """The recipe on its own trn1 cluster, and on p5 the layout the search chooses, are left alone."""
    assert advice_lines(plan_output(capsys, "--config", "hlat-70b")) == []
    assert advice_lines(plan_output(capsys, "--config", "hlat-7b")) == []
    best = searched(capsys, "--config", "hlat-70b", "--hardware", "p5.48xlarge")["parallel"]
    out = plan_output(
        capsys,
        "--config",
        "hlat-70b",
        "--hardware",
        "p5.48xlarge",
        "--tp",
        str(best["tp"]),
        "--pp",
        str(best["pp"]),
        "--virtual-stages",
        str(best["virtual_stages"]),
        "--zero1",
        "--recompute",
        best["activation_checkpoint"],
    )
    assert advice_lines(out) == [] and "  2 " not in out


def test_on_trn2_the_70b_recipes_layout_is_named_for_its_links_not_its_nodes(capsys):
    """trn2's 64 NeuronCores per node hold TP32 whole, but its links make the trn1 layout needlessly slow there:
    its communication is more than a quarter of its step and the search's layout is more than 1.25x faster."""
    best = searched(capsys, "--config", "hlat-70b", "--hardware", "trn2.48xlarge")
    (line,) = advice_lines(plan_output(capsys, "--config", "hlat-70b", "--hardware", "trn2.48xlarge"))
    assert line.startswith("TP32 PP8 DP64 mb1 1F1B SP ZeRO-1 AC:sel is needlessly slow on trn2.48xlarge's links")
    assert f"`hlat plan --search` on 256 x trn2.48xlarge chooses {best['layout']}: " in line


def test_a_plan_on_another_stacks_memory_shows_hlats_own_beside_it(capsys):
    """trn1's profile prices NeuronX Distributed's activations: the table's memory of HLAT-70B's layout says what
    hlat's own trainer would need beside it, as the breakdown and the JSON do; an hlat-priced profile adds nothing."""
    out = plan_output(capsys, "--config", "hlat-70b")
    (row,) = [line for line in out.splitlines() if line.lstrip().startswith("1 ")]
    own = json.loads(plan_output(capsys, "--config", "hlat-70b", "--json"))["plans"][0]
    assert own["memory_gib"]["total"] < 16 < own["hlat_trainer_memory_gib"]
    assert f"{own['memory_gib']['total']:.1f} (hlat {own['hlat_trainer_memory_gib']:.1f})" in row
    assert (
        f"(as trn1.32xlarge's stack keeps it, megatron; hlat's own trainer: {own['hlat_trainer_memory_gib']:.1f} "
        "GiB)" in out
    )
    p5 = json.loads(plan_output(capsys, "--config", "hlat-70b", "--hardware", "p5.48xlarge", "--json"))["plans"][0]
    assert p5["hlat_trainer_memory_gib"] is None


def test_shipped_profiles_and_recipes_cite_nothing_outside_the_package():
    """A path such as ../shared/validation/README.md exists only beside this repository's development checkout,
    not where the package is installed; a price source or comment that a plan prints must not send users there."""
    from hlat.resources import HARDWARE_DIR, RECIPES_DIR

    for path in [*HARDWARE_DIR.glob("*.toml"), *RECIPES_DIR.glob("*.toml")]:
        assert "../" not in path.read_text() and "shared/validation" not in path.read_text(), path


# --- profiles and calibration ---------------------------------------------------------------------------------------


def test_profiles_load_and_bad_ones_are_named(tmp_path):
    assert {"trn1.32xlarge", "trn2.48xlarge", "p4d.24xlarge", "p5.48xlarge", "p5e.48xlarge", "cpu"} <= set(
        profile_names()
    )
    for name in profile_names():
        hw = load_profile(name)
        assert hw.peak_tflops > 0 and hw.fit.flops_factor >= 1
    bad = tmp_path / "mine.toml"
    bad.write_text('name = "mine"\nmemory_gb = 80\n')
    with pytest.raises(ConfigError, match="mine.toml: memory_gb"):
        load_profile(str(bad))
    bad.write_text('name = "mine"\nmemory_gib = -1\n')
    with pytest.raises(ConfigError, match="memory_gib must be positive"):
        load_profile(str(bad))


def test_nnls_matches_the_constrained_optimum():
    rows = [[1.0, 1.0], [2.0, 1.0], [3.0, 1.0]]  # fit t = x1 r + x2
    assert nnls(rows, [2.0, 3.0, 3.0]) == pytest.approx([0.5, 5 / 3])  # the unconstrained optimum is >= 0
    # The exact fit 2 r - 1 has x2 < 0: the constrained optimum has x2 = 0 and x1 = sum(r t) / sum(r^2).
    assert nnls(rows, [1.0, 3.0, 5.0]) == pytest.approx([22 / 14, 0.0])


def test_calibrate_recovers_the_factor_of_a_run(tmp_path, capsys):
    cpu = load_profile("cpu")
    work = Workload(model_config("tiny"), 256, 8, "fp32")
    truth = replace(cpu.fit, flops_factor=3.5)
    step = step_time(work, Layout.of(micro_batch=8, activation_checkpoint="none"), cpu, truth).total
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    (run_dir / "config.toml").write_text(
        '[model]\npreset = "tiny"\n[train]\nseq_len = 256\nglobal_batch = 8\n'
        'micro_batch = 8\n[precision]\nmode = "fp32"\n[parallel]\ndp_shard = 1\n'
    )
    (run_dir / "metrics.jsonl").write_text(
        "".join(json.dumps({"step": i, "step_time_s": step * (9 if i == 1 else 1)}) + "\n" for i in range(1, 6))
    )
    out = tmp_path / "calibrated.toml"
    assert run(plan_args("--hardware", "cpu", "--calibrate", str(run_dir), "--emit", str(out)), []) == 0
    assert "predicted" in capsys.readouterr().out
    fitted = load_profile(str(out))
    assert fitted.fit.flops_factor == pytest.approx(3.5, rel=1e-3) and "calibrated" in fitted.fit.source
    with pytest.raises(HlatError, match="not an hlat run directory"):
        run(plan_args("--hardware", "cpu", "--calibrate", str(tmp_path)), [])


# --- validation against measurements (needs the steering checkout's shared/validation) ----------------------------

needs_data = pytest.mark.skipif(not VALIDATION_DIR.is_dir(), reason="validation data not present")


@needs_data
def test_a100_fit_is_stored_and_holds_on_held_out_vtrain_runs():
    from planner_samples import best_layout_ranks, fit_a100, mape, split, vtrain_samples

    multi, single = vtrain_samples("multi"), vtrain_samples("single")
    (multi_fit, multi_held), (single_fit, single_held) = split(multi), split(single)
    fit = fit_a100(multi_fit, single_fit)
    assert asdict(fit) == asdict(load_profile("p4d.24xlarge").fit)
    assert mape(multi_held, fit) < 0.10 and mape(single_held, fit) < 0.10
    assert mape(multi_held + single_held, fit) < 0.10
    multi_ranks = best_layout_ranks(multi, fit).values()
    single_ranks = best_layout_ranks(single, fit).values()
    # The measured best is in the top 3 for 3 of 4 multi-node groups and 140 of 144 single-node ones (see the report).
    assert sum(r <= 3 for r, _, _ in multi_ranks) >= 3
    assert sum(r <= 3 for r, _, _ in single_ranks) >= 0.95 * len(single_ranks)
    assert all((regret == 0) == (r == 1) for r, _, regret in [*multi_ranks, *single_ranks])


@needs_data
def test_trn1_fit_is_stored_and_predicts_every_published_run():
    from planner_samples import fit_trn1, relative_errors, trainium_samples

    samples = trainium_samples()
    fit = fit_trn1(samples)
    assert asdict(fit) == asdict(TRN1.fit)
    assert max(map(abs, relative_errors(samples, fit))) < 0.15


@needs_data
def test_published_a100_runs_out_of_sample():
    from planner_samples import a100_published

    errors = []
    for sample, layouts in a100_published():
        hw = replace(sample.hardware, fit=load_profile("p4d.24xlarge").fit)
        plans = [evaluate(sample.workload, lay, hw, lay.devices // 8) for lay in layouts]
        best = min((p for p in plans if p.memory.fits), key=lambda p: p.time.total)
        errors.append(abs(best.time.total / sample.step_s - 1))
    assert len(errors) == 18 and sum(errors) / len(errors) < 0.15


def test_a_measured_block_prices_only_the_workload_it_was_measured_at():
    """A whole block timed by preflight is the per-layer time (tensor-parallel collectives included) and the
    measured ends replace the output layer, but only at exactly the shape it was taken at."""
    from hlat.planner.costs import block_shape
    from hlat.profiles import Measured

    model, work = model_config("tiny"), Workload(model_config("tiny"), 64, 8, "fp32")
    shape = block_shape(model, 64, 2, "fp32", 2, True, "none")
    hw = replace(load_profile("cpu"), measured=Measured(block_shapes=[shape], block_s=[0.25], ends_s=[0.5]))
    layout = Layout.of(tp=2, micro_batch=2, sequence_parallel=True)
    t = step_time(work, layout, hw)
    assert t.layer == "measured block" and t.tp_comm == 0
    assert t.compute == pytest.approx(4 * (model.n_layers * 0.25 + 0.5))  # 8 sequences in micro-batches of 2
    # another micro-batch, tp degree, recomputation, precision or model: the block does not apply
    for other_work, other in [
        (work, layout.replaced(micro_batch=1)),
        (work, layout.replaced(tp=1)),
        (work, layout.replaced(activation_checkpoint="full")),
        (replace(work, precision="bf16_mixed"), layout),
        (replace(work, model=replace(model, n_layers=2)), layout),
    ]:
        priced = step_time(other_work, other, hw)  # no operations measured either: the fitted factors
        assert priced.layer == "fitted" and (priced.tp_comm > 0) == (other.tp > 1), other.describe()


def test_a_pipeline_charges_the_measured_embedding_to_its_first_stage_and_the_rest_of_the_ends_to_its_last():
    from hlat.planner.costs import block_shape
    from hlat.profiles import Measured

    model, work = model_config("tiny"), Workload(model_config("tiny"), 64, 8, "fp32")
    shape = block_shape(model, 64, 2, "fp32", 1, False, "none")
    hw = replace(
        load_profile("cpu"), measured=Measured(block_shapes=[shape], block_s=[0.25], ends_s=[0.5], embedding_s=[0.125])
    )
    single = step_time(work, Layout.of(micro_batch=2), hw)
    assert single.compute == pytest.approx(4 * (model.n_layers * 0.25 + 0.5)) and single.bubble == 0
    piped = step_time(work, Layout.of(pp=2, micro_batch=2), hw)
    stage_layers = model.n_layers // 2
    assert piped.compute == pytest.approx(4 * (stage_layers * 0.25 + 0.5 - 0.125))  # the last stage
    assert piped.bubble == pytest.approx(stage_layers * 0.25 + 0.125 + piped.pp_comm / 4)  # the first stage, once


def test_data_parallel_traffic_is_priced_as_fully_shard_runs_it():
    """With measured collectives: one collective per unit (each block, then the rest), the root unit gathered
    once per micro-batch under FSDP, and buffer copies that a replicated layout pays for each re-gather."""
    from hlat.profiles import Measured

    model = model_config("small")
    blocks = model.n_layers * model.layer_params()
    rest = model.num_params() - blocks
    flat = [[4096, 1.0], [2.0**30, 1.0]]  # 1 GB/s bus bandwidth at every size
    hw = replace(
        load_profile("cpu"),
        devices_per_node=2,
        measured=Measured(all_reduce=flat, all_gather=flat, reduce_scatter=flat, overlap=0.0, copy_gbs=1e12),
    )  # copies free
    work = Workload(model, 128, 8, "fp32")
    assert step_time(work, Layout.of(dp_replicate=2), hw).dp_comm == pytest.approx((blocks + rest) * 4 / 1e9)
    fsdp = step_time(work, Layout.of(dp_shard=2), hw).dp_comm  # 4 micro-batches; half of each unit moves
    assert fsdp == pytest.approx(4 * ((2 * blocks + rest) + (blocks + rest)) * 4 / 2 / 1e9)
    # copies at 1 GB/s: a replicated layout gathers (copies) its blocks once more per extra micro-batch
    hw.measured.copy_gbs = 1.0
    one, four = (step_time(replace(work, global_batch=2 * m), Layout.of(dp_replicate=2), hw).dp_comm for m in (1, 4))
    assert four - one == pytest.approx(3 * blocks * 2 * 4 / 1e9)


def test_blocks_timed_under_the_layouts_data_parallelism_price_its_traffic():
    """Where preflight timed the blocks under the layout's own data parallelism, the exposed traffic is those
    micro-batches' excess over the plain blocks: every micro-batch reduces under FSDP; under ZeRO-1 and DDP the
    last reduces and the others accumulate. Another data-parallel size (or none timed) falls back to pricing the
    collectives."""
    from hlat.planner.costs import block_shape, dp_block_shape
    from hlat.profiles import Measured

    model = model_config("tiny")
    work = Workload(model, 64, 8, "fp32")  # 4 micro-batches per rank at dp 2
    shape = block_shape(model, 64, 1, "fp32", 1, False, "none")
    timed = {
        shape: (0.25, 0.5),
        dp_block_shape(shape, "fsdp", 2, False): (0.5, 1.5),
        dp_block_shape(shape, "zero1", 2, False): (0.375, 1.0),
        dp_block_shape(shape, "zero1", 2, True): (0.3125, 0.625),
        dp_block_shape(shape, "ddp", 2, False): (0.25, 2.0),
        dp_block_shape(shape, "ddp", 2, True): (0.25, 0.5),
    }
    flat = [[4096, 1.0], [2.0**30, 1.0]]
    hw = replace(
        load_profile("cpu"),
        devices_per_node=2,
        measured=Measured(
            block_shapes=list(timed),
            block_s=[b for b, _ in timed.values()],
            ends_s=[e for _, e in timed.values()],
            all_reduce=flat,
            all_gather=flat,
            reduce_scatter=flat,
            overlap=0.0,
            copy_gbs=1.0,
        ),
    )
    plain = model.n_layers * 0.25 + 0.5
    fsdp = step_time(work, Layout.of(dp_shard=2), hw)
    assert fsdp.compute == pytest.approx(4 * plain) and fsdp.data_parallel == "measured blocks"
    assert fsdp.dp_comm == pytest.approx(4 * (model.n_layers * 0.5 + 1.5 - plain))
    zero1 = step_time(work, Layout.of(dp_shard=2, zero1=True), hw).dp_comm
    assert zero1 == pytest.approx(model.n_layers * 0.375 + 1.0 + 3 * (model.n_layers * 0.3125 + 0.625) - 4 * plain)
    assert step_time(work, Layout.of(dp_replicate=2), hw).dp_comm == pytest.approx(2.0 - 0.5)
    # four ranks, or HSDP (not timed): the collectives at their measured bandwidths, and the copies, as without
    # any data-parallel timing
    untimed = replace(hw, measured=replace(hw.measured, block_shapes=[shape], block_s=[0.25], ends_s=[0.5]))
    for layout in (Layout.of(dp_shard=4), Layout.of(dp_shard=2, dp_replicate=2)):
        priced = step_time(replace(work, global_batch=16), layout, hw)
        assert priced.data_parallel == "composed"
        assert (
            priced.dp_comm > 0 and priced.dp_comm == step_time(replace(work, global_batch=16), layout, untimed).dp_comm
        )
    assert step_time(work, Layout.of(), hw).data_parallel == ""


# --- GPU profiles: cited collectives, the pipeline schedules, guard rails, plans of a config -------------------------


def test_cited_collectives_follow_nccl_tests_bus_bandwidth_and_share_the_nodes_network():
    """With [links], a collective takes the cited bus bandwidth at its size: within a node the intra rows, across
    nodes the rows at the node count (interpolated between cited counts), shared by the groups of a node."""
    from hlat.planner.comms import link_time
    from hlat.profiles import Links

    links = Links(
        source="test",
        intra_all_reduce=[[1e6, 100.0], [1e9, 400.0]],
        inter_all_reduce=[[2, 1e9, 200.0], [8, 1e9, 50.0]],
        inter_all_gather=[[2, 1e9, 300.0]],
    )
    hw = replace(load_profile("p5.48xlarge"), links=links, measured=replace(load_profile("cpu").measured))
    fit = hw.fit
    assert link_time(hw, fit, "all_reduce", 1e9, 8, 8) == pytest.approx(2 * 7 / 8 * 1e9 / 400e9)
    assert link_time(hw, fit, "all_gather", 1e9, 8, 8) == pytest.approx(7 / 8 * 1e9 / 400e9)  # all_reduce's rows
    assert link_time(hw, fit, "all_reduce", 1e9, 16, 8) == pytest.approx(2 * 15 / 16 * 1e9 / 200e9)
    # 4 nodes: halfway between 2 and 8 in log nodes
    assert link_time(hw, fit, "all_reduce", 1e9, 32, 8) == pytest.approx(2 * 31 / 32 * 1e9 / 125e9)
    assert link_time(hw, fit, "reduce_scatter", 1e9, 16, 8) == pytest.approx(15 / 16 * 1e9 / 300e9)  # mirror
    # two nodes, one member each: the node's 8 such groups share its network
    assert link_time(hw, fit, "all_reduce", 1e9, 2, 1) == pytest.approx(2 * 1 / 2 * 1e9 / (200e9 / 8))


def _run_order(orders: list[list[tuple[str, int, int]]], cost, chunks: int, delay: float = 0.0) -> float:
    """The time to run each rank's list of (F or B, model chunk, micro-batch) in order, one at a time per rank,
    a forward after the previous chunk's and a backward after its own forward and the next chunk's backward;
    what another rank computed arrives `delay` later (chunk c is on rank c mod ranks)."""
    done, free, at = {}, [0.0] * len(orders), [0] * len(orders)
    moved = True
    while moved:
        moved = False
        for rank, order in enumerate(orders):
            while at[rank] < len(order):
                kind, chunk, mb = order[at[rank]]
                if kind == "F":
                    needs = [("F", chunk - 1, mb)] if chunk else []
                else:
                    needs = [("F", chunk, mb)] + ([("B", chunk + 1, mb)] if chunk < chunks - 1 else [])
                if any(n not in done for n in needs):
                    break
                ready = [done[n] + (delay if n[1] % len(orders) != rank else 0.0) for n in needs]
                free[rank] = done[(kind, chunk, mb)] = max([free[rank]] + ready) + cost(kind, chunk)
                at[rank] += 1
                moved = True
    assert at == [len(order) for order in orders], "the schedule deadlocked"
    return max(free)


def _schedule_1f1b(p: int, m: int) -> list[list[tuple[str, int, int]]]:
    """Schedule1F1B's order as its step runs it: stage s runs min(m, p - s) forwards, then one backward and one
    forward in turn while forwards remain, then the remaining backwards."""
    orders = []
    for s in range(p):
        warmup = min(m, p - s)
        steady = [step for i in range(m - warmup) for step in (("B", s, i), ("F", s, warmup + i))]
        orders.append([("F", s, i) for i in range(warmup)] + steady + [("B", s, i) for i in range(m - warmup, m)])
    return orders


def _schedule_interleaved(p: int, m: int, v: int) -> list[list[tuple[str, int, int]]]:
    """ScheduleInterleaved1F1B's own order of work (its `pipeline_order`), built over stand-in stages."""
    from unittest import mock

    from torch.distributed.pipelining import PipelineStage
    from torch.distributed.pipelining.schedules import ScheduleInterleaved1F1B

    stage = mock.create_autospec(PipelineStage, instance=True)
    stage.group_rank, stage.group_size, stage.num_stages, stage.submod = 0, p, p * v, None
    order = ScheduleInterleaved1F1B([stage] * v, n_microbatches=m).pipeline_order
    return [
        [
            ("F" if a.computation_type.name == "FORWARD" else "B", a.stage_index, a.microbatch_index)
            for a in order[rank]
            if a is not None
        ]
        for rank in range(p)
    ]


@pytest.mark.parametrize("pp, v", [(8, 1), (16, 1), (8, 2), (8, 4), (16, 2), (16, 4)])
def test_pipeline_bubble_is_the_trainers_schedule(pp, v):
    """The planner's pipelined step (micro-batches x the busiest stage, plus (p - 1) / v micro-batches of a stage
    without the output layer) against the trainer's schedules run with the planner's own per-micro-batch times:
    a backward twice its forward, the last model chunk carrying the output layer."""
    from hlat.planner.comms import pipeline_send_time
    from hlat.planner.timing import micro_batch

    work = Workload(model_config("llama2-70b"), 4096, 2 * pp * 8, "bf16_mixed")
    schedule = "interleaved_1f1b" if v > 1 else "1f1b"
    layout = Layout.of(
        tp=8, pp=pp, dp_replicate=8, pp_schedule=schedule, virtual_stages=v, activation_checkpoint="selective"
    )
    m = layout.microbatches(work.global_batch)
    t, mb = step_time(work, layout, TRN1), micro_batch(work, layout, TRN1, TRN1.fit)
    stage = mb.compute - mb.output + mb.tp + pipeline_send_time(work, layout, TRN1, TRN1.fit)

    def cost(kind: str, chunk: int) -> float:
        seconds = stage / v + (mb.output if chunk == pp * v - 1 else 0.0)
        return seconds * (1 / 3 if kind == "F" else 2 / 3)

    orders = _schedule_interleaved(pp, m, v) if v > 1 else _schedule_1f1b(pp, m)
    simulated = _run_order(orders, cost, pp * v)
    assert t.compute + t.tp_comm + t.pp_comm + t.bubble == pytest.approx(simulated, rel=1e-9)


@pytest.mark.parametrize("pp, v", [(8, 2), (8, 4), (16, 2)])
def test_interleaved_pipeline_sends_hide_as_the_trainers_schedule_hides_them(pp, v):
    """With hlat's own communication (the p5 profile's cited links), ScheduleInterleaved1F1B posts its receives
    early: run with each send's time as the delay between ranks, its step is the planner's."""
    from hlat.planner.comms import pipeline_send_time
    from hlat.planner.timing import micro_batch

    p5 = load_profile("p5.48xlarge")
    work = Workload(model_config("llama2-7b"), 4096, 8 * 2 * pp, "bf16_mixed")
    layout = Layout.of(pp=pp, dp_replicate=8, virtual_stages=v, activation_checkpoint="full")
    t, mb = step_time(work, layout, p5), micro_batch(work, layout, p5, p5.fit)
    sends = pipeline_send_time(work, layout, p5, p5.fit)
    assert 0 < t.pp_comm < layout.microbatches(work.global_batch) * sends  # fewer than every micro-batch's

    def cost(kind: str, chunk: int) -> float:
        seconds = (mb.compute - mb.output + mb.tp) / v + (mb.output if chunk == pp * v - 1 else 0.0)
        return seconds * (1 / 3 if kind == "F" else 2 / 3)

    simulated = _run_order(_schedule_interleaved(pp, 2 * pp, v), cost, pp * v, delay=sends / (2 * v))
    assert t.compute + t.tp_comm + t.pp_comm + t.bubble == pytest.approx(simulated, rel=1e-9)


def test_shipped_gpu_profiles_carry_hlats_measurements_and_say_where_each_figure_comes_from():
    p5, p5e = load_profile("p5.48xlarge"), load_profile("p5e.48xlarge")
    assert "preflight_gpu.json" in p5.measured.source and not p5.measured.derived_from
    assert p5.fit.source.startswith("nominal") and "A100" not in p5.fit.source + p5e.fit.source
    assert p5.links.inter_all_reduce and p5.links.intra_all_reduce and "nccl-tests" in p5.links.source
    # p5e: the H100's rates, memory-bound ones scaled by the HBM ratio (4.8 / 3.35 TB/s), compute ones not
    ratio = p5e.hbm_gbs / p5.hbm_gbs
    assert (p5e.peak_tflops, p5e.measured.matmul_bf16, p5e.measured.attention_bf16) == (
        p5.peak_tflops,
        p5.measured.matmul_bf16,
        p5.measured.attention_bf16,
    )
    for name in ("norm_gbs", "activation_gbs", "rotary_gbs", "residual_gbs", "loss_gbs", "optimizer_gbs"):
        assert getattr(p5e.measured, name) == pytest.approx(getattr(p5.measured, name) * ratio, abs=0.06)
    assert "4.8/3.35" in p5e.measured.derived_from and p5e.sources().startswith("derived")
    for name in profile_names():  # every profile states its price with a date and a source
        hw = load_profile(name)
        assert hw.price_date and hw.price_source, name


def test_the_pure_bf16_update_is_priced_at_its_own_measured_rate():
    """BF16AdamW (bf16_sr, bf16_kahan) is another kernel than torch's AdamW: each mode's update takes the rate
    preflight measured for its own optimizer, and a profile without BF16AdamW's prices it as AdamW's."""
    from hlat.optim.modes import MODES
    from hlat.planner.costs import optimizer_bytes

    p5 = load_profile("p5.48xlarge")
    both = replace(
        p5, measured=replace(p5.measured, optimizer_gbs=800.0, optimizer_measured_bytes=0.0, bf16_optimizer_gbs=400.0)
    )
    adamw_only = replace(both, measured=replace(both.measured, bf16_optimizer_gbs=0.0))
    layout, params = Layout.of(micro_batch=1), model_config("llama2-7b").num_params()
    for mode, profile, rate in (
        ("bf16_sr", both, 400.0),
        ("bf16_kahan", both, 400.0),
        ("bf16_mixed", both, 800.0),
        ("bf16_sr", adamw_only, 800.0),
    ):
        m = MODES[mode]
        work = Workload(model_config("llama2-7b"), 4096, 1, mode)
        expected = optimizer_bytes(params, m.weight_bytes, m.grad_bytes, m.optimizer_bytes) / (rate * 1e9)
        assert step_time(work, layout, profile).optimizer == pytest.approx(expected, rel=1e-9), (mode, rate)


def _flag_plan(argv: list[str], capsys) -> dict:
    from hlat.cli import main

    assert main(["plan", *argv, "--json"]) == 0
    return json.loads(capsys.readouterr().out)


def test_a_plan_above_the_best_mfu_hlat_measured_is_marked(tmp_path, capsys):
    argv = ["--config", "hlat-7b", "--search", "--nodes", "8", "--top", "3"]
    out = _flag_plan([*argv, "--hardware", "p5e.48xlarge"], capsys)
    assert out["price_per_node_hour"] == 43.26 and "no on-demand price" in out["price_source"]
    assert out["measured_best_mfu"] == 0.544 and "gpu_step.md" in out["measured_best_source"]
    assert all(p["above_measured_best"] == (p["predicted_mfu"] > 0.544) for p in out["plans"])
    assert all(p["mfu"] <= 0.544 for p in out["plans"])  # never promised above what hlat has measured
    # a profile made to promise more: matmuls twice as fast as measured
    p5e = load_profile("p5e.48xlarge")
    doubled = [[size, 2 * rate] for size, rate in p5e.measured.matmul_bf16]
    faster = tmp_path / "faster.toml"
    faster.write_text(replace(p5e, measured=replace(p5e.measured, matmul_bf16=doubled)).to_toml())
    out = _flag_plan([*argv, "--hardware", str(faster)], capsys)
    assert all(p["predicted_mfu"] > 0.544 and p["above_measured_best"] for p in out["plans"])
    # ...is marked, and promises no more than the best measured: its days and dollars follow from that
    assert all(p["mfu"] == 0.544 and p["tokens_per_s"] < p["predicted_tokens_per_s"] for p in out["plans"])
    from hlat.cli import main

    assert main(["plan", *argv, "--hardware", str(faster), "--price-per-node-hour", "50"]) == 0
    table = capsys.readouterr().out
    assert "%*" in table and "predicted above the best MFU hlat has measured on p5e.48xlarge in bf16 (54.4%" in table
    assert "$50/node-hour, --price-per-node-hour" in table


def test_the_mfu_cap_does_not_rank_the_layouts(capsys):
    """hlat-70b-long's search: the top layouts are all predicted above the best MFU hlat has measured on p5 and
    promise that best alike; they rank by what is predicted for each (ties within the tolerance by simplicity), and
    the table shows each one's prediction beside the mark."""
    argv = ["--config", "hlat-70b-long", "--search", "--top", "5"]
    plans = _flag_plan([*argv, "--tolerance", "0"], capsys)["plans"]
    assert all(p["above_measured_best"] and p["mfu"] == plans[0]["mfu"] for p in plans)  # capped alike...
    predicted = [p["predicted_tokens_per_s"] for p in plans]
    assert predicted == sorted(predicted, reverse=True) and len(set(predicted)) > 1  # ...ranked by prediction
    tied = _flag_plan(argv, capsys)["plans"]
    assert min(p["predicted_tokens_per_s"] for p in tied[:2]) >= 0.97 * predicted[0]  # the first two tie within 3%
    assert [p["predicted_tokens_per_s"] for p in tied[2:]] == sorted(predicted[2:], reverse=True)[: len(tied) - 2]
    from hlat.cli import main

    assert main(["plan", *argv]) == 0
    rows = [line for line in capsys.readouterr().out.splitlines() if re.match(r"\s+[1-5]\s", line)]
    assert [re.search(r"%\* \((\S+)%\)", row)[1] for row in rows] == [f"{p['predicted_mfu']:.1%}"[:-1] for p in tied]


def test_a_layout_flag_changes_only_what_it_names(capsys):
    """hlat-70b-long with --cp 4 keeps its recipe's layout but for cp (TP 2 with sequence parallelism, no
    recomputation, FSDP, one sequence per micro-batch; data parallelism takes what cp 4 leaves), and says it does not
    fit rather than answer with another layout; each further flag changes what it names."""
    from hlat.cli import main

    def priced(*flags: str) -> dict:
        code = main(["plan", "--config", "hlat-70b-long", *flags, "--json"])
        (plan,) = json.loads(capsys.readouterr().out)["plans"]
        assert code == (0 if plan["fits"] else 1)
        return {**plan["parallel"], "micro_batch": plan["train"]["micro_batch"], "fits": plan["fits"]}

    recipe = priced()
    assert (recipe["tp"], recipe["cp"], recipe["dp_shard"], recipe["activation_checkpoint"]) == (2, 8, 8, "none")
    cp4 = priced("--cp", "4")
    assert cp4 == {**recipe, "cp": 4, "dp_shard": 16, "fits": False}
    assert priced("--cp", "4", "--recompute", "full") == {**cp4, "activation_checkpoint": "full", "fits": True}
    tp4 = priced("--tp", "4", "--cp", "4", "--recompute", "selective")
    assert tp4 == {**recipe, "tp": 4, "cp": 4, "activation_checkpoint": "selective", "fits": True}
    assert main(["plan", "--config", "hlat-70b-long", "--cp", "4"]) == 1
    out = capsys.readouterr().out
    assert "layout of the config with --cp 4, TP2 PP1 DP16 CP4 mb1 SP FSDP AC:none" in out and "does not fit" in out
    with pytest.raises(HlatError, match="the config's layout with --cp 3 --recompute full: parallel.cp: 3 does not"):
        run(plan_args("--config", "hlat-70b-long", "--cp", "3", "--recompute", "full"), [])


def test_a_plan_of_a_recipe_prices_its_cluster_precision_and_token_budget(tmp_path, capsys):
    out = _flag_plan(["--config", "neox-20b"], capsys)
    (plan,) = out["plans"]
    assert (out["hardware"], out["nodes"], out["precision"]) == ("trn1.32xlarge", 64, "bf16_sr")
    assert out["tokens"] == 150_000 * 1536 * 2048 and out["price_per_node_hour"] == 21.50  # 472B tokens
    hours = out["tokens"] / plan["tokens_per_s"] / 3600
    assert plan["budget"]["days"] == pytest.approx(hours / 24, abs=0.01)
    assert plan["budget"]["dollars"] == pytest.approx(hours * 64 * 21.50, rel=1e-3)
    assert (plan["parallel"]["tp"], plan["parallel"]["pp"]) == (8, 4)
    # what `hlat train --config` takes: merged files and --section.key overrides
    out = _flag_plan(["--config", "neox-20b", "--train.steps", "1000", "--cluster.nodes", "4"], capsys)
    assert out["tokens"] == 1000 * 1536 * 2048 and out["nodes"] == 4
    # a measured profile that lacks the config's precision says so in one line
    p5 = load_profile("p5.48xlarge")
    bf16_only = tmp_path / "bf16_only.toml"
    bf16_only.write_text(replace(p5, measured=replace(p5.measured, matmul_fp32=[])).to_toml())
    out = _flag_plan(
        ["--config", "neox-20b", "--precision.mode", "fp32", "--hardware", str(bf16_only), "--nodes", "2", "--search"],
        capsys,
    )
    assert out["notes"] == ["the profile measured no fp32 operations: fp32 is priced from its fitted factors"]


@pytest.mark.parametrize(
    "argv, message",
    [
        (["--model", "hlat-7b", "--hardware", "cpu"], "--model names a model preset .*use --config hlat-7b"),
        (["--model", "llama2-7b", "--hardware", "cpu", "--train.steps", "5"], "overrides apply to a --config"),
        (["--config", "neox-20b", "--price-per-node-hour", "-1"], "--price-per-node-hour: must be >= 0"),
    ],
)
def test_plan_names_a_preset_with_model_and_a_config_with_config(argv, message, capsys):
    from hlat.cli import main

    assert main(["plan", *argv]) == 2
    assert re.search(message, capsys.readouterr().err)


# --- FP8: priced from preflight's measured rates and from nothing else ------------------------------------------------

ONE_B = dict(family="llama", dim=2048, n_layers=16, n_heads=16, ffn_dim=5632, vocab_size=32000, max_seq_len=4096)


def fp8_profile(tensorwise: list[list[float]], bf16: list[list[float]], **best):
    """The H100 profile with test-made matmul tables, no rowwise one (and [best_mfu] fields: fp8 0 unless given)."""
    p5 = load_profile("p5.48xlarge")
    measured = replace(p5.measured, matmul_bf16=bf16, matmul_fp8_tensorwise=tensorwise, matmul_fp8_rowwise=[])
    return replace(p5, name="test-fp8", measured=measured, best_mfu=replace(p5.best_mfu, **{"fp8": 0.0, **best}))


def test_an_fp8_plan_prices_the_block_linears_at_the_measured_fp8_rates():
    """The 1B setting (micro-batch 4 x seq 4096): every linear of a block is 2048 x 2048 (wq, wk, wv, wo: A FLOPs
    each) or 2048 x 5632 (w1, w3, w2: B each). The FP8 table has a row at each (as preflight writes it: the
    forward + backward of a Float8Linear, at 3 x its forward FLOPs); bf16 runs at 400 TFLOP/s everywhere. The
    output layer and attention stay bf16: the step's compute differs by the blocks' linears alone."""
    model, tokens = model_config(**ONE_B), 4 * 4096
    a, b = 2.0 * tokens * 2048 * 2048, 2.0 * tokens * 2048 * 5632
    flat = [[1e6, 400.0], [1e15, 400.0]]
    hw = fp8_profile([[a, 600.0], [b, 900.0]], flat)
    bf16 = Workload(model, 4096, 32, "bf16_mixed")
    fp8 = replace(bf16, fp8="tensorwise")
    layout = Layout.of(micro_batch=4, activation_checkpoint="none")  # 8 micro-batches a step
    t_bf16, t_fp8 = step_time(bf16, layout, hw), step_time(fp8, layout, hw)
    linears_bf16 = 3 * (4 * a + 3 * b) / 400e12  # forward and backward
    linears_fp8 = 4 * a / 600e12 + 3 * b / 900e12  # as timed: forward + backward, 3 x the forward FLOPs
    assert t_fp8.compute - t_bf16.compute == pytest.approx(8 * 16 * (3 * linears_fp8 - linears_bf16), rel=1e-9)
    assert t_fp8.layer == "composed" and t_fp8.total < t_bf16.total  # the table says FP8 is faster here
    # slower FP8 rates than bf16's make a slower plan; memory is the bf16 mode's either way
    slow = fp8_profile([[a, 200.0], [b, 300.0]], flat)
    assert step_time(fp8, layout, slow).total > step_time(bf16, layout, slow).total
    assert memory(fp8, layout, hw) == memory(bf16, layout, hw)
    # full recomputation runs the forward again: a fourth pass at the same measured rate
    full = layout.replaced(activation_checkpoint="full")
    assert step_time(fp8, full, hw).compute - step_time(bf16, full, hw).compute == pytest.approx(
        8 * 16 * 4 * (linears_fp8 - linears_bf16 / 3), rel=1e-9
    )


def test_fsdp_gathers_the_block_linears_in_fp8_under_tensorwise_scaling():
    """torchao's FP8 all-gather: 1 byte per block-linear weight instead of bf16_sr's 2 (rowwise gathers bf16);
    biases, norms, the embedding and the output layer as stored. At 1 GB/s over 2 ranks a gather of n bytes per
    device takes n / 2 ns; each block is gathered twice a micro-batch."""
    from hlat.profiles import Measured

    model = model_config("small")
    d, f = model.dim, model.ffn_dim
    linear_weights = 4 * d * d + 3 * d * f  # wq, wk, wv, wo (no GQA), w1, w3, w2
    flat = [[1.0, 1.0], [2.0**40, 1.0]]
    hw = replace(
        load_profile("p5.48xlarge"),
        devices_per_node=2,
        measured=Measured(
            matmul_bf16=[[1.0, 400.0]],
            matmul_fp8_tensorwise=[[1.0, 800.0]],
            matmul_fp8_rowwise=[[1.0, 800.0]],
            all_reduce=flat,
            all_gather=flat,
            reduce_scatter=flat,
            overlap=0.0,
            copy_gbs=1e15,
        ),
    )  # copies ~free
    work = Workload(model, 1024, 8, "bf16_sr")  # 4 micro-batches per rank
    layout = Layout.of(dp_shard=2)
    dp = {fp8: step_time(replace(work, fp8=fp8), layout, hw).dp_comm for fp8 in ("none", "tensorwise", "rowwise")}
    assert dp["none"] - dp["tensorwise"] == pytest.approx(
        4 * 2 * model.n_layers * linear_weights * (2 - 1) / 2e9, rel=1e-6
    )
    assert dp["rowwise"] == dp["none"]


def test_a_profile_without_the_recipes_fp8_rates_refuses_the_plan_in_one_line(tmp_path, capsys):
    from hlat.cli import main

    argv = [
        "plan",
        "--model",
        "llama2-7b",
        "--hardware",
        "p5e.48xlarge",
        "--seq-len",
        "4096",
        "--precision",
        "bf16_sr",
        "--nodes",
        "1",
    ]
    assert main([*argv, "--fp8", "tensorwise"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith(
        "hlat: error: precision.fp8: p5e.48xlarge has no measured FP8 matmul rate (tensorwise); run `hlat preflight"
    )
    assert "--hardware measured.toml" in err
    # the config's precision.fp8 asks for it the same way; a profile with only the other recipe's table refuses too
    only_tensorwise = tmp_path / "tensorwise.toml"
    only_tensorwise.write_text(fp8_profile([[1.0, 800.0]], [[1.0, 400.0]]).to_toml())
    assert (
        main(
            [
                "plan",
                "--config",
                "hlat-7b",
                "--precision.fp8",
                "rowwise",
                "--hardware",
                str(only_tensorwise),
                "--nodes",
                "1",
            ]
        )
        == 2
    )
    assert "test-fp8 has no measured FP8 matmul rate (rowwise)" in capsys.readouterr().err
    assert main([*argv, "--fp8", "tensorwise", "--precision", "fp32"]) == 2  # the config's own rule
    assert "precision.fp8: FP8 matmuls need a bf16 mode" in capsys.readouterr().err


def test_an_fp8_plan_is_capped_only_by_a_measured_fp8_best_and_its_emitted_config_keeps_fp8(tmp_path, capsys):
    """[best_mfu] fp8 = 0 (none measured): no cap, said so; a measured one caps. The emitted config trains FP8, and
    `--calibrate` reads a run's precision.fp8 back."""
    fast = [[1.0, 2000.0], [1e15, 2000.0]]  # far above any MFU hlat has measured in bf16
    uncapped, capped = tmp_path / "uncapped.toml", tmp_path / "capped.toml"
    uncapped.write_text(fp8_profile(fast, [[1.0, 600.0]]).to_toml())
    capped.write_text(fp8_profile(fast, [[1.0, 600.0]], fp8=0.6).to_toml())
    emit = tmp_path / "plan.toml"
    argv = [
        "--model",
        "llama2-7b",
        "--seq-len",
        "4096",
        "--precision",
        "bf16_sr",
        "--fp8",
        "tensorwise",
        "--dp-shard",
        "8",
        "--recompute",
        "selective",
        "--global-batch",
        "64",
    ]
    out = _flag_plan([*argv, "--hardware", str(uncapped), "--emit", str(emit)], capsys)
    (plan,) = out["plans"]
    assert out["fp8"] == "tensorwise" and out["measured_best_mfu"] is None
    assert not plan["above_measured_best"] and plan["mfu"] == plan["predicted_mfu"] > 0.544
    assert any("no measured best MFU caps this plan" in note for note in out["notes"])
    (plan,) = _flag_plan([*argv, "--hardware", str(capped)], capsys)["plans"]
    assert plan["above_measured_best"] and plan["mfu"] == 0.6
    emitted = load_toml(emit)
    assert emitted["precision"] == {"mode": "bf16_sr", "fp8": "tensorwise"}
    assert build_config(emitted).precision.fp8 == "tensorwise"
    from hlat.planner.cli import run_sample

    run_dir = tmp_path / "run"
    run_dir.mkdir()
    (run_dir / "config.toml").write_text(
        '[model]\npreset = "tiny"\n[train]\nseq_len = 256\nglobal_batch = 8\n'
        'micro_batch = 8\n[precision]\nmode = "bf16_sr"\nfp8 = "rowwise"\n'
        "[parallel]\ndp_shard = 1\n"
    )
    (run_dir / "metrics.jsonl").write_text(
        "".join(json.dumps({"step": i, "step_time_s": 1.0}) + "\n" for i in range(1, 6))
    )
    assert run_sample(str(run_dir), load_profile("cpu")).workload.fp8 == "rowwise"
    with pytest.raises(HlatError, match="precision.fp8: cpu has no measured FP8 matmul rate"):
        run(plan_args("--hardware", "cpu", "--calibrate", str(run_dir)), [])


def test_a_search_prices_fp8_only_when_the_workload_asks_for_it():
    """A profile's FP8 rates change no bf16 plan: the search never switches precision by itself."""
    work = Workload(model_config(**ONE_B), 4096, 64, "bf16_mixed")
    p5 = load_profile("p5.48xlarge")
    with_fp8 = fp8_profile([[1.0, 2000.0]], p5.measured.matmul_bf16)
    plain, offered = search(work, p5, 1), search(work, with_fp8, 1)
    assert [(p.layout, p.time) for p in plain.plans] == [(p.layout, p.time) for p in offered.plans]
    asked = search(replace(work, fp8="tensorwise"), with_fp8, 1)
    assert asked.plans[0].time.total < plain.plans[0].time.total


def test_a_rehearsal_of_another_fp8_recipe_is_another_job():
    from hlat.planner.rehearsal import rehearsal_mismatch

    work, layout = Workload(model_config("tiny"), 32, 8, "bf16_sr", fp8="tensorwise"), Layout.of()
    data = {
        "model_config": asdict(work.model),
        "seq_len": 32,
        "global_batch": 8,
        "precision": "bf16_sr",
        "micro_batch": 1,
        "parallel": asdict(layout.parallel),
    }
    assert rehearsal_mismatch(data, work, layout) == "fp8 'none' (planned: 'tensorwise')"  # written before fp8
    assert rehearsal_mismatch({**data, "fp8": "tensorwise"}, work, layout) is None


def test_a_rehearsal_of_another_job_names_only_the_fields_that_differ(tmp_path):
    """A rehearsal of the 70B with 8 layers and another micro-batch, offered to the 80-layer plan: one line naming
    model.n_layers and micro_batch, not two whole model configs."""
    from hlat.config.job import load_config

    cfg = load_config(["hlat-70b"], [])
    rehearsal = {
        "model_config": asdict(replace(cfg.model, n_layers=8)),
        "seq_len": 4096,
        "global_batch": 1024,
        "precision": "bf16_mixed",
        "micro_batch": 2,
        "parallel": asdict(cfg.resolved_parallel(8192)),
        "ranks": [],
        "world_size": 8192,
        "hardware": "cpu",
    }
    (tmp_path / "r.json").write_text(json.dumps(rehearsal))
    with pytest.raises(HlatError) as refused:
        run(plan_args("--config", "hlat-70b", "--rehearsal", str(tmp_path / "r.json")), [])
    assert str(refused.value).endswith(
        "rehearsed a different job: model.n_layers 8 (planned: 80); micro_batch 2 (planned: 1)"
    )


# --- context parallelism -----------------------------------------------------------------------------------------


@pytest.mark.parametrize("recipe, cp", [("hlat-7b-long", 2), ("hlat-70b-long", 8)])
def test_search_proposes_context_parallelism_for_the_long_context_stages(recipe, cp, capsys):
    """The long-context stages (32,768 tokens) state the layout `hlat plan --search` ranks first, which splits
    each sequence over cp ranks and prices the gathers of keys and values it adds."""
    from hlat.cli import main
    from hlat.config.job import load_config

    assert main(["plan", "--config", recipe, "--search", "--json"]) == 0
    best = json.loads(capsys.readouterr().out)["plans"][0]
    cfg = load_config(recipe)
    stated = cfg.resolved_parallel(cfg.cluster.world_size)
    fields = ("tp", "cp", "pp", "dp_replicate", "dp_shard", "zero1", "sequence_parallel", "activation_checkpoint")
    assert {f: best["parallel"][f] for f in fields} == {f: getattr(stated, f) for f in fields}
    assert best["parallel"]["cp"] == cp
    assert best["fits"] and best["step_time_s"]["cp_comm"] > 0 and best["train"]["seq_len"] == 32768
    assert f"CP{cp}" in best["layout"]


def test_context_parallelism_is_searched_only_for_long_sequences():
    """Each cp rank keeps at least 4,096 tokens of a sequence: pretraining's sequences are never split, 32,768-token
    ones up to 8 ways."""
    hw = load_profile("p5.48xlarge")
    for seq_len, degrees in ((4096, {1}), (32768, {1, 2, 4, 8})):
        work = Workload(model_config("llama2-7b"), seq_len, 64, "bf16_sr")
        assert {layout.cp for layout in candidates(work, hw, 2)} == degrees, seq_len


def test_context_parallelism_splits_activations_and_prices_its_gathers_on_their_link():
    """cp 2 halves what a rank keeps of its sequences but for the keys and values it gathers from the other rank;
    the model states stay as they were, sharded over dp_shard x cp; and the gathers cross the network once tp x cp
    exceeds a node (tp innermost, cp next)."""
    from hlat.planner.comms import context_parallel_time

    work = Workload(model_config("llama2-70b"), 32768, 64, "bf16_sr")
    hw = load_profile("cpu")
    one, two = Layout.of(tp=8, dp_shard=2), Layout.of(tp=8, cp=2)
    for mode in ("none", "selective"):
        whole = layer_activation_bytes(work.model, 32768, one, mode, 2, flash=True)
        half = layer_activation_bytes(work.model, 32768, two, mode, 2, flash=True)
        # llama2-70b: 8 kv heads of 128 over tp 8, one per rank: K and V of 16,384 more tokens, bf16
        assert half == pytest.approx(whole / 2 + 2 * 16384 * 128 * 2 * (1 if mode == "none" else 2)), mode
    m1, m2 = memory(work, one, hw), memory(work, two, hw)
    assert (m1.weights, m1.grads, m1.optimizer) == (m2.weights, m2.grads, m2.optimizer)
    within, across = (replace(hw, devices_per_node=n) for n in (16, 8))
    assert context_parallel_time(work, two, within, hw.fit) < context_parallel_time(work, two, across, hw.fit)
    assert context_parallel_time(work, one, hw, hw.fit) == 0.0 < step_time(work, two, hw).cp_comm
