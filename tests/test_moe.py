"""Mixture-of-experts blocks (hlat/models/moe.py) in one process, against references written token by token in
float64: the routing, the experts, the load-balancing loss's gradient, token dropping and the routing figures."""

import json

import pytest
import torch
import torch.nn.functional as F

from hlat.fields import ConfigError
from hlat.models import build_model, count_params, materialize
from hlat.models.config import model_config
from hlat.models.moe import routing_table
from hlat.parallel.recompute import apply_recomputation

TINY = dict(dim=32, n_layers=2, n_heads=4, ffn_dim=24, vocab_size=64, max_seq_len=64)


def tiny_moe(**overrides):
    model = materialize(build_model(model_config("tiny-moe", **{**TINY, **overrides})), "cpu")
    return model.double()


def reference_block(moe, x):
    """The block's output token by token: softmax over the experts, the top k renormalised, their SwiGLUs so
    weighted."""
    probs = (x @ moe.router.weight.T).softmax(-1)
    weights, chosen = probs.topk(moe.top_k, -1)
    weights = weights / weights.sum(-1, keepdim=True)
    experts = moe.experts
    out = torch.zeros_like(x)
    for index in torch.cartesian_prod(*(torch.arange(n) for n in x.shape[:2])).tolist():
        token = x[tuple(index)]
        for w, e in zip(weights[tuple(index)], chosen[tuple(index)]):
            hidden = F.silu(experts.w1[e] @ token) * (experts.w3[e] @ token)
            out[tuple(index)] = out[tuple(index)] + w * (experts.w2[e] @ hidden)
    return out


def test_counts_and_the_published_shape():
    """Mixtral 8x7B's published 46.7B parameters, 12.9B of them active per token; the built modules agree."""
    cfg = model_config("mixtral-8x7b")
    assert cfg.num_params() == count_params(build_model(cfg)) == 46_702_792_704
    assert cfg.active_params() == 12_879_925_248
    dense_twin = model_config("mixtral-8x7b", n_experts=0)  # one SwiGLU per layer: a token runs two, and the router
    extra = 32 * (3 * 4096 * 14336 + 8 * 4096)
    assert cfg.flops_per_token(4096) == dense_twin.flops_per_token(4096) + 6 * extra


def test_the_block_and_its_gradients_follow_a_token_by_token_reference():
    torch.manual_seed(0)
    moe = tiny_moe().layers["0"].feed_forward
    x = torch.randn(2, 6, 32, dtype=torch.float64, requires_grad=True)
    moe.aux_loss_coef = 0.0
    got = moe(x)
    grads = torch.autograd.grad(got.square().sum(), [x, moe.router.weight, moe.experts.w1])
    want = reference_block(moe, x)
    expected = torch.autograd.grad(want.square().sum(), [x, moe.router.weight, moe.experts.w1])
    torch.testing.assert_close(got, want, rtol=1e-12, atol=1e-12)
    for g, e in zip(grads, expected):
        torch.testing.assert_close(g, e, rtol=1e-10, atol=1e-12)


def test_the_load_balancing_loss_adds_its_gradient_where_the_loss_is_weighted():
    """coef x the Switch loss of each layer and sequence, n_experts x sum of (share of the sequence's choices) x
    (mean probability over its tokens), averaged over the sequences, added to the objective with the weight of the
    micro-batch's loss (here 1/4): the gradients with the coefficient less those without it are coef / 4 x the
    gradient of the layers' losses, computed from their inputs (in the model without the coefficient, whose
    backward passes add nothing)."""
    torch.manual_seed(0)
    tokens = torch.randint(0, 64, (2, 12))
    grads, inputs = [], []
    for coef in (0.5, 0.0):
        model, inputs = tiny_moe(aux_loss_coef=coef), []
        for block in model.layers.values():
            block.feed_forward.register_forward_pre_hook(lambda module, args: inputs.append(args[0]))
        (model(tokens, targets=tokens) / 4).backward(retain_graph=True)
        grads.append({name: p.grad.clone() for name, p in model.named_parameters()})
    aux = 0.0
    for block, x in zip(model.layers.values(), inputs):
        for sequence in x:
            probs = (sequence @ block.feed_forward.router.weight.T).softmax(-1)
            shares = torch.bincount(probs.topk(2, -1).indices.flatten(), minlength=8) / (len(probs) * 2)
            aux = aux + 8 * (shares * probs.mean(0)).sum() / len(x)
    expected = torch.autograd.grad(aux, list(model.parameters()), allow_unused=True)
    for (name, _), e in zip(model.named_parameters(), expected):
        delta = (grads[0][name] - grads[1][name]) / (0.5 / 4)
        torch.testing.assert_close(delta, torch.zeros_like(delta) if e is None else e, rtol=1e-7, atol=1e-12)


def test_capacity_drops_the_later_tokens_and_only_in_training():
    """A router that sends every token to experts 0 and 1: with capacity_factor 1 each takes ceil(8 x 2 / 4) = 4
    tokens of each sequence of 8, its first 4; the others pass nothing. Without a gradient (evaluation, generation)
    every token is routed."""
    moe = tiny_moe(n_experts=4, capacity_factor=1.0).layers["0"].feed_forward
    with torch.no_grad():
        moe.router.weight.zero_()
        moe.router.weight[:2] = 1.0
    x = torch.rand(2, 8, 32, dtype=torch.float64) + 0.1  # positive: experts 0 and 1 score highest
    kept = moe(x)
    with torch.no_grad():
        everything = moe(x)
    assert torch.equal(kept[:, :4], everything[:, :4]) and kept[:, :4].abs().min() > 0
    assert torch.equal(kept[:, 4:], torch.zeros_like(kept[:, 4:]))
    kept.sum().backward()
    table = routing_table([moe_model_of(moe)])
    assert table[0, :4].tolist() == [16, 16, 0, 0] and table[0, 4].item() == 16  # 16 choices dropped


def moe_model_of(moe):
    """A stand-in model holding one MoE block as layer 0, for `routing_table`."""
    model = tiny_moe(n_experts=4)
    model.layers["0"].feed_forward = moe
    return model


@pytest.mark.parametrize("recompute", ["full", "selective"])
def test_routing_figures_are_counted_once_per_micro_batch_under_recomputation(recompute):
    """Recomputation runs a block's forward again in backward: the gradients are the same, and the figures (each
    expert's choices, the micro-batches) are counted once, in backward; reading them starts them again."""
    torch.manual_seed(0)
    tokens = torch.randint(0, 64, (2, 12))
    runs = []
    for mode in ("none", recompute):
        model = tiny_moe(capacity_factor=1.5)
        apply_recomputation(model, mode)
        for _ in range(2):
            model(tokens, targets=tokens).backward()
        runs.append(({n: p.grad for n, p in model.named_parameters()}, routing_table([model])))
    (plain, plain_table), (recomputed, table) = runs
    for name, grad in plain.items():
        torch.testing.assert_close(recomputed[name], grad, rtol=0, atol=0)
    assert torch.equal(table, plain_table)
    assert table[:, :8].sum(1).tolist() == [2 * 24 * 2] * 2 and table[:, -1].tolist() == [2.0, 2.0]
    assert routing_table([model]).abs().sum() == 0


@pytest.mark.parametrize(
    "overrides, message",
    [
        ({"family": "neox"}, "model.n_experts: mixture-of-experts blocks are built for the llama family only"),
        ({"experts_per_token": 9}, "model.experts_per_token: must be between 1 and n_experts 8, got 9"),
        ({"capacity_factor": -1.0}, "model.capacity_factor/aux_loss_coef: must be >= 0"),
    ],
)
def test_a_bad_expert_field_is_named(overrides, message):
    with pytest.raises(ConfigError, match=message):
        model_config("tiny-moe", **overrides)


def test_routing_figures_in_the_log_tensorboard_and_metrics(tmp_path, capsys):
    """A run of the tiny MoE preset logs each layer's choices per expert over each record's steps (every token's
    experts_per_token choices, before any is dropped), the busiest expert against an even share, the choices
    dropped past capacity and the load-balancing loss, in metrics.jsonl, TensorBoard and the console line."""
    import json
    import os

    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    from hlat.config.job import build_config
    from hlat.train.loop import train

    run = tmp_path / "run"
    model = dict(TINY, preset="tiny-moe", vocab_size=512, capacity_factor=1.0)
    train_settings = dict(steps=4, global_batch=4, micro_batch=2, seq_len=32, log_every=2, run_dir=str(run))
    corpus = os.path.join(os.path.dirname(json.__file__), "*.py")
    train(build_config({"model": model, "data": {"paths": [corpus], "workers": 0}, "train": train_settings}))
    records = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in records] == [1, 2, 4]
    seen = 0
    for r in records:
        table, interval = r["moe_tokens_per_expert"], r["tokens_seen"] - seen
        seen = r["tokens_seen"]
        assert len(table) == 2 and all(len(row) == 8 and sum(row) == 2 * interval for row in table)
        for i, row in enumerate(table):
            assert r[f"moe_imbalance_layer{i}"] == pytest.approx(max(row) * 8 / sum(row), abs=1e-4)
        assert r["moe_imbalance"] == max(r["moe_imbalance_layer0"], r["moe_imbalance_layer1"]) > 1
        assert 0 < r["moe_dropped"] < 0.5 and 0.9 < r["moe_aux_loss"] < 1.5
    assert "experts: busiest x" in capsys.readouterr().out
    events = EventAccumulator(str(run))
    events.Reload()
    for tag, key in (("moe/imbalance", "moe_imbalance"), ("moe/dropped", "moe_dropped")):
        assert [e.value for e in events.Scalars(tag)] == pytest.approx([r[key] for r in records])


# --- the planner and the rehearsal -----------------------------------------------------------------------------------


def test_the_planner_counts_expert_parameters_as_the_model_holds_them():
    """Every expert stored once over dp_shard x cp (ep x ep_shard ranks), as the rest of the block; a rank gathers
    its n_experts / ep experts (split over tp) for a block's forward."""
    from hlat.planner.layout import Layout, Workload
    from hlat.planner.memory import layer_params_per_device, memory, stage_params
    from hlat.profiles import load_profile

    cfg = model_config("tiny-moe", **TINY)
    assert stage_params(cfg, Layout.of()) == count_params(build_model(cfg))
    block = count_params(build_model(cfg).layers["0"])
    experts = 8 * 3 * 32 * 24
    assert layer_params_per_device(cfg, tp=1) == block
    attention = block - experts - 8 * 32 - 2 * 32  # the router and the norms are whole on every rank
    assert layer_params_per_device(cfg, tp=2, ep=4) == attention / 2 + 8 * 32 + 2 * 32 + experts / 4 / 2
    work, hw = Workload(cfg, 64, 8, "fp32"), load_profile("cpu")
    plain, sharded = memory(work, Layout.of(), hw), memory(work, Layout.of(dp_shard=8, ep=4), hw)
    assert sharded.weights == plain.weights / 8 and sharded.optimizer == plain.optimizer / 8


def test_the_planner_prices_the_all_to_all_on_its_link_and_the_load_a_router_leaves():
    """Mixtral 8x7B on 16 p5.48xlarge: the experts' all-to-alls cost nothing without expert parallelism, more when
    an ep group crosses nodes (ep x tp above a node's 8 GPUs) than inside one; a busier rank's experts (the
    load a router leaves) cost time and activations, up to the capacity an expert has."""
    from hlat.planner.comms import expert_parallel_time
    from hlat.planner.layout import Layout, Workload
    from hlat.planner.memory import memory
    from hlat.planner.timing import step_time
    from hlat.profiles import load_profile

    cfg, hw = model_config("mixtral-8x7b"), load_profile("p5.48xlarge")
    work = Workload(cfg, 4096, 1024)
    inside, across = (Layout.of(tp=tp, ep=8, dp_shard=128 // tp) for tp in (1, 2))
    assert expert_parallel_time(work, Layout.of(dp_shard=128), hw, hw.fit) == 0
    assert expert_parallel_time(work, across, hw, hw.fit) > 2 * expert_parallel_time(work, inside, hw, hw.fit) > 0
    busy = Workload(cfg, 4096, 1024, expert_load=1.3)
    assert step_time(busy, inside, hw).total > step_time(work, inside, hw).total
    assert memory(busy, inside, hw).activations > 1.1 * memory(work, inside, hw).activations
    capped = Workload(model_config("mixtral-8x7b", capacity_factor=1.1), 4096, 1024, expert_load=1.3)
    assert capped.load(inside) == 1.1 and capped.load(Layout.of(dp_shard=128)) == 1.0


def test_plan_searches_expert_parallelism_and_takes_the_load_on_the_command_line(capsys):
    from hlat.cli import main

    args = ["plan", "--model", "mixtral-8x7b", "--hardware", "p5.48xlarge", "--nodes", "16", "--seq-len", "4096"]
    assert main([*args, "--json", "--top", "1"]) == 0
    (best,) = json.loads(capsys.readouterr().out)["plans"]
    assert best["parallel"]["ep"] == 8 and best["fits"]
    assert main([*args, "--ep", "8", "--dp-shard", "128", "--recompute", "none"]) == 0
    assert "TP1 PP1 DP128 EP8 mb1 FSDP AC:none" in capsys.readouterr().out
    assert main([*args, "--expert-load", "0.5"]) == 2
    assert capsys.readouterr().err.strip() == "hlat: error: --expert-load: 0.5 is below an even share (1)"


@pytest.mark.slow
def test_one_rank_of_an_expert_parallel_job_matches_the_planner(tmp_path):
    """Rank 0 of 128 (16 nodes of 8, EP 8 within each node, FSDP over all, each expert over the 16 ranks holding
    it), bf16_mixed: its parameter, gradient, optimizer and weight-cast bytes equal the planner's, what it keeps for
    backward is within 10%, and its all-to-alls send the bytes the planner prices (in a fake world a rank's experts
    receive as many choices as it sends: an even load)."""
    import subprocess
    import sys

    config = tmp_path / "job.toml"
    config.write_text(
        '[model]\npreset = "tiny-moe"\ndim = 256\nn_layers = 2\nn_heads = 8\nn_kv_heads = 4\nffn_dim = 512\n'
        'vocab_size = 1024\nmax_seq_len = 256\n[precision]\nmode = "bf16_mixed"\n[parallel]\nep = 8\n'
        'dp_shard = -1\n[train]\nseq_len = 256\nglobal_batch = 256\nmicro_batch = 1\ndevice = "cpu"\n'
        '[cluster]\nhardware = "p5.48xlarge"\nnodes = 16\nnproc_per_node = 8\n'
    )
    done = subprocess.run(
        [sys.executable, "-m", "hlat", "rehearse", "--config", str(config), "--rank", "0", "--json"],
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    (rank,) = json.loads(done.stdout)["ranks"]
    memory = rank["memory"]
    for figure in ("params", "grads", "optimizer", "parameter_casts"):
        assert memory[figure]["measured"] == memory[figure]["planned"] > 0, figure
    assert memory["activations"]["measured"] == pytest.approx(memory["activations"]["planned"], rel=0.10)
    (exchange,) = [row for row in rank["collectives"] if (row["kind"], row["dim"]) == ("all_to_all", "ep")]
    assert exchange["step_bytes"] == exchange["planned_step_bytes"] > 0


def test_the_mixtral_recipe_runs_its_layout_on_its_cluster():
    from hlat.config.job import load_config

    cfg = load_config("mixtral-8x7b")
    assert cfg.model.num_params() == 46_702_792_704 and cfg.model.aux_loss_coef == 0.02
    layout = cfg.resolved_parallel(cfg.cluster.world_size)
    assert (layout.ep, layout.dp_shard, layout.expert_shards, cfg.cluster.hardware) == (8, 128, 16, "p5.48xlarge")
