"""Mixture-of-experts models under expert parallelism, alone and with FSDP, tensor, pipeline and context parallelism
(CPU, gloo, torchrun): each layout follows the single process's loss and gradient norm, routes every token to the
same experts, and a checkpoint written at one expert-parallel size resumes at another."""

import json
from pathlib import Path

import pytest
from test_parallel import assert_close, fewer_micro_batches, torchrun, write_toml
from test_parallel import job as parallel_job

from hlat.config.job import build_config, load_config
from hlat.fields import ConfigError, update
from hlat.train.loop import train

# 8 experts of which each token takes 2; capacity for 1.25 x an even share of each sequence, so that some choices are
# dropped and the order of a sequence's tokens (split over cp and tp ranks) matters
MODEL = {
    "preset": "tiny-moe",
    "dim": 64,
    "n_layers": 4,
    "n_heads": 4,
    "n_kv_heads": 2,
    "ffn_dim": 64,
    "vocab_size": 512,
    "capacity_factor": 1.25,
}
LAYOUTS = {  # name: (processes, [parallel] overrides)
    "ep2": (2, {"ep": 2}),
    "ep2_fsdp2": (4, {"ep": 2, "dp_shard": 4}),
    "ep2_tp2": (4, {"ep": 2, "tp": 2, "dp_shard": 2, "activation_checkpoint": "selective"}),
    "ep2_pp2": (4, {"ep": 2, "pp": 2, "dp_shard": 2}),
    "ep2_cp2": (2, {"ep": 2, "cp": 2, "dp_shard": 1, "activation_checkpoint": "full"}),
}


def job(run_dir: Path, **train) -> dict:
    return parallel_job(run_dir, MODEL, **train)


def records(run_dir: Path) -> list[dict]:
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


def trajectory(run_dir: Path) -> list[tuple[float, float]]:
    return [(r["loss"], r["grad_norm"]) for r in records(run_dir)]


def routing(run_dir: Path) -> list:
    """Each step's choices per expert and layer, and the choices dropped."""
    return [(r["moe_tokens_per_expert"], r["moe_dropped"]) for r in records(run_dir)]


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    run = tmp_path_factory.mktemp("moe_reference") / "run"
    train(build_config(job(run)))
    return run


@pytest.mark.parametrize("layout", LAYOUTS)
def test_layout_matches_single_process(layout, reference, tmp_path, warm_torchrun):
    """The loss and gradient norm within 1e-4 of the single process over 4 steps (fp32: only the order of sums
    differs, each rank's experts taking every rank's tokens), and each step's choices per expert, and the choices
    dropped past capacity, exactly the single process's: the router's choices do not depend on the layout."""
    nproc, parallel = LAYOUTS[layout]
    config = write_toml(tmp_path / "job.toml", job(tmp_path / "run"))
    torchrun(warm_torchrun, nproc, config, parallel, *fewer_micro_batches(nproc, parallel))
    assert_close(trajectory(tmp_path / "run"), trajectory(reference))
    assert routing(tmp_path / "run") == routing(reference)
    assert all(r["moe_dropped"] > 0 for r in records(reference))


def test_a_checkpoint_written_at_ep2_resumes_at_ep1(reference, tmp_path, warm_torchrun):
    """2 steps at ep 2 (each rank holding 4 experts), then steps 3 and 4 in one process holding all 8: the
    uninterrupted single-process run."""
    config = write_toml(tmp_path / "job.toml", job(tmp_path / "run", ckpt_every=2))
    torchrun(warm_torchrun, 2, config, {"ep": 2}, "--train.steps", "2")
    train(load_config(config, ["--train.resume", "auto"]))
    assert_close(trajectory(tmp_path / "run"), trajectory(reference))
    assert routing(tmp_path / "run") == routing(reference)


@pytest.mark.parametrize(
    "model, parallel, world, message",
    [
        ({}, {"ep": 3}, 3, "parallel.ep: 3 does not divide model.n_experts 8"),
        ({"n_experts": 0}, {"ep": 2}, 2, "parallel.ep: 2 needs a mixture-of-experts model"),
        ({}, {"ep": 4, "dp_shard": 2, "tp": 2}, 4, r"parallel.ep: 4 does not divide dp_shard x cp = 2"),
        ({}, {"compile": True}, 1, "parallel.compile: not supported for mixture-of-experts models"),
        ({"n_experts": 4, "ffn_dim": 66}, {"ep": 2, "dp_shard": 6}, 6, "FSDP shards each rank's 2 experts over"),
    ],
)
def test_impossible_expert_layouts_are_refused_up_front(model, parallel, world, message, tmp_path):
    cfg = build_config(job(tmp_path))
    update(cfg.model, model)
    update(cfg.parallel, parallel)
    with pytest.raises(ConfigError, match=message):
        cfg.resolved_parallel(world)


def test_fp8_is_refused_for_experts(tmp_path):
    data = job(tmp_path)
    data["precision"] = {"mode": "bf16_mixed", "fp8": "tensorwise"}
    with pytest.raises(ConfigError, match="precision.fp8: not supported for mixture-of-experts models"):
        build_config(data)
