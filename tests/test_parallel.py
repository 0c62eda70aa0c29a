"""Every parallel layout follows the single-process loss trajectory (CPU, gloo, torchrun), checkpoints move
between layouts, and impossible layouts are refused before any process starts."""

import json
import os
import shutil
from pathlib import Path

import pytest
import torch
from warm_torchrun import WarmTorchrun

from hlat.config.job import build_config, load_config
from hlat.fields import ConfigError, update
from hlat.train.loop import train

CORPUS = os.path.join(os.path.dirname(json.__file__), "*.py")
MODELS = {
    "llama": {
        "preset": "tiny",
        "dim": 64,
        "n_layers": 4,
        "n_heads": 4,
        "n_kv_heads": 2,
        "ffn_dim": 128,
        "vocab_size": 512,
    },
    "neox": {"preset": "tiny-neox", "dim": 64, "n_layers": 4, "n_heads": 4, "ffn_dim": 128, "vocab_size": 512},
}
LAYOUTS = {  # name: (processes, [parallel] overrides)
    "ddp2": (2, {"dp_replicate": 2, "dp_shard": 1}),
    "fsdp2": (2, {"dp_shard": 2, "activation_checkpoint": "full"}),
    "zero1_2": (2, {"dp_shard": 2, "zero1": True}),
    "tp2_sp": (2, {"tp": 2, "sequence_parallel": True, "activation_checkpoint": "selective"}),
    "pp2_1f1b": (2, {"pp": 2, "pp_schedule": "1f1b"}),
    "pp2_interleaved": (2, {"pp": 2, "pp_schedule": "interleaved_1f1b", "virtual_stages": 2}),
    "tp2_fsdp2": (4, {"tp": 2, "dp_shard": 2, "activation_checkpoint": "selective"}),
    "pp2_tp2": (4, {"pp": 2, "tp": 2, "dp_shard": 1, "activation_checkpoint": "full"}),
    "pp2_fsdp2": (4, {"pp": 2, "dp_shard": 2}),
    "tp4_kv_replicated": (4, {"tp": 4}),  # 2 kv heads, each computed on the 2 ranks whose queries use it
}


def job(run_dir: Path, family: str | dict, **train) -> dict:
    """4 steps of a family's tiny model (or of the model fields given): the first compares the split forward and
    backward passes, the later ones the sharded optimizer (Adam's moments included) and the data each rank reads.
    Tokenized in the training process: a worker process per rank adds its start to every run (workers under layouts:
    test_resume_at_another_data_parallel_size)."""
    return {
        "model": dict(MODELS[family] if isinstance(family, str) else family),
        "data": {"paths": [CORPUS], "shuffle_rows": 64, "workers": 0},
        "optim": {"lr": 3e-3, "min_lr": 3e-4, "warmup_steps": 2, "decay_steps": 10},
        "train": {
            "steps": 4,
            "global_batch": 8,
            "micro_batch": 2,
            "seq_len": 32,
            "log_every": 1,
            "run_dir": str(run_dir),
            **train,
        },
    }


def write_toml(path: Path, data: dict) -> Path:
    path.write_text(build_config(data).to_toml())
    return path


def torchrun(runner: WarmTorchrun, nproc: int, config: Path, parallel: dict, *extra: str) -> None:
    overrides = [a for k, v in parallel.items() for a in (f"--parallel.{k}", str(v).lower())]
    done = runner.run(nproc, ["train", "--config", str(config), *overrides, *extra])
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]


def fewer_micro_batches(nproc: int, parallel: dict) -> list[str]:
    """Overrides for a layout whose every rank takes the whole step (no data or pipeline parallelism): 2
    micro-batches of 4 rows instead of 4 of 2, still accumulated. Each micro-batch under tensor or context
    parallelism costs DTensor's dispatch on every op (measured: a tp 2 job 5.7 -> 3.2 s)."""
    return ["--train.micro_batch", "4"] if nproc == parallel.get("tp", 1) * parallel.get("cp", 1) else []


def trajectory(run_dir: Path) -> list[tuple[float, float]]:
    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    return [(r["loss"], r["grad_norm"]) for r in records]


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    """Single-process trajectories, one per family."""
    root = tmp_path_factory.mktemp("reference")
    runs = {}
    for family in MODELS:
        train(build_config(job(root / family, family)))
        runs[family] = trajectory(root / family)
    return runs


def assert_close(got, expected, rtol=1e-4, norm_rtol=None):
    assert len(got) == len(expected)
    for step, ((loss, norm), (ref_loss, ref_norm)) in enumerate(zip(got, expected), 1):
        assert abs(loss - ref_loss) <= rtol * abs(ref_loss), (step, loss, ref_loss)
        assert abs(norm - ref_norm) <= (norm_rtol or rtol) * abs(ref_norm) + 1e-6, (step, norm, ref_norm)


FOUR_PROCESS_FAMILY = {"tp2_fsdp2": "llama", "tp4_kv_replicated": "llama", "pp2_tp2": "neox", "pp2_fsdp2": "neox"}


# Two-process layouts run for both families; four-process ones (slow on a small CI machine) for one family each,
# both families among them.
@pytest.mark.parametrize(
    "layout, family",
    [(layout, family) for layout in LAYOUTS for family in MODELS if FOUR_PROCESS_FAMILY.get(layout, family) == family],
)
def test_layout_matches_single_process(layout, family, reference, tmp_path, warm_torchrun):
    nproc, parallel = LAYOUTS[layout]
    config = write_toml(tmp_path / "job.toml", job(tmp_path / "run", family))
    torchrun(warm_torchrun, nproc, config, parallel, *fewer_micro_batches(nproc, parallel))
    assert_close(trajectory(tmp_path / "run"), reference[family])


@pytest.mark.parametrize(
    "precision, nproc, parallel",
    [
        ("bf16_sr", 2, {"dp_replicate": 2, "dp_shard": 1}),
        ("bf16_sr", 2, {"tp": 2}),  # the vocabulary-parallel embedding's gradient arrives replicated
        ("bf16_mixed", 4, {"pp": 2, "tp": 2, "dp_shard": 1}),
    ],
)
def test_bf16_modes_under_parallel_layouts(precision, nproc, parallel, tmp_path, warm_torchrun):
    """A split layout sums and rounds in another order, and each bf16 rounding moves a value by up to its unit
    roundoff u = 2^-8. The loss, a mean over all the batch's tokens, stays within u of the single process for
    the whole run (measured: 2.5e-4 relative at most, bf16_mixed under pp2 x tp2). The gradient norm is where
    those differences grow step by step (1e-4 apart at step 1, 4e-3 at step 3, 2.5e-2 at step 8 in that run,
    and ~6% by step 10 under other CPUs and loads), so it is compared while the weights are still nearly the
    same, over the first three steps, within 4u."""
    unit_roundoff = 2.0**-8
    data = job(tmp_path / "single", "llama", steps=10)
    data["precision"] = {"mode": precision}
    train(build_config(data))
    data["train"]["run_dir"] = str(tmp_path / "run")
    torchrun(warm_torchrun, nproc, write_toml(tmp_path / "job.toml", data), parallel)
    got, expected = trajectory(tmp_path / "run"), trajectory(tmp_path / "single")
    assert len(got) == len(expected) == 10
    for step, ((loss, norm), (ref_loss, ref_norm)) in enumerate(zip(got, expected), 1):
        assert abs(loss - ref_loss) <= unit_roundoff * ref_loss, (step, loss, ref_loss)
        if step <= 3:
            assert abs(norm - ref_norm) <= 4 * unit_roundoff * ref_norm, (step, norm, ref_norm)


@pytest.mark.slow
def test_compiled_blocks_under_tensor_parallelism(reference, tmp_path, warm_torchrun):
    """torch.compile per block with tensor and sequence parallelism: the same trajectory."""
    config = write_toml(tmp_path / "job.toml", job(tmp_path / "run", "llama"))
    parallel = {"tp": 2, "sequence_parallel": True, "compile": True, "compile_cache_dir": tmp_path / "compile-cache"}
    torchrun(warm_torchrun, 2, config, parallel, *fewer_micro_batches(2, parallel))
    assert any((tmp_path / "compile-cache").iterdir())
    assert_close(trajectory(tmp_path / "run"), reference["llama"])


def test_hsdp_with_gradient_accumulation(reference, tmp_path, warm_torchrun):
    """HSDP (2 replicas of 2 shards) with two micro-batches per rank: reduce-scattered every micro-batch,
    all-reduced across replicas once, and still the single-process trajectory."""
    config = write_toml(tmp_path / "job.toml", job(tmp_path / "run", "llama", micro_batch=1))
    torchrun(warm_torchrun, 4, config, {"dp_replicate": 2, "dp_shard": 2})
    assert_close(trajectory(tmp_path / "run"), reference["llama"])


def test_document_masking_under_tensor_parallelism(tmp_path, warm_torchrun):
    """Best-fit packing with attention kept inside documents: the tp 2 run follows the single process."""
    data = job(tmp_path / "single", "llama")
    data["model"]["doc_mask"] = True
    data["data"]["packing"] = "best_fit"
    train(build_config(data))
    data["train"]["run_dir"] = str(tmp_path / "run")
    torchrun(warm_torchrun, 2, write_toml(tmp_path / "job.toml", data), {"tp": 2}, *fewer_micro_batches(2, {"tp": 2}))
    assert_close(trajectory(tmp_path / "run"), trajectory(tmp_path / "single"))


CP_LAYOUTS = {  # name: (processes, [parallel] overrides); seq_len 32: chunks of 8 tokens (cp 2) or 4 (cp 4)
    "cp2": (2, {"cp": 2}),
    "cp2_fsdp2": (4, {"cp": 2, "dp_shard": 2}),
    "cp2_tp2_sp": (4, {"cp": 2, "tp": 2, "sequence_parallel": True, "activation_checkpoint": "selective"}),
    "cp2_pp2": (4, {"cp": 2, "pp": 2, "dp_shard": 1}),
    "cp4": (4, {"cp": 4, "activation_checkpoint": "full"}),
}


@pytest.fixture(scope="module")
def doc_mask_reference(tmp_path_factory):
    """The single-process trajectory of the llama job with best-fit packing and attention kept inside documents."""
    run = tmp_path_factory.mktemp("doc_mask_reference") / "run"
    train(build_config(doc_mask_job(run)))
    return trajectory(run)


def doc_mask_job(run_dir: Path) -> dict:
    data = job(run_dir, "llama")
    data["model"]["doc_mask"] = True
    data["data"]["packing"] = "best_fit"
    return data


# Packed documents under every layout; plain causal attention at cp 2 and 4. Under a split both build the mask from
# the gathered positions, packed documents from the gathered document ids too: the causal mask is that code with
# less in it, and the layout (FSDP, tp, a pipeline) does not change either.
@pytest.mark.parametrize(
    "layout, mask", [(layout, "doc_mask") for layout in CP_LAYOUTS] + [("cp2", "causal"), ("cp4", "causal")]
)
def test_context_parallel_layout_matches_single_process(
    layout, mask, reference, doc_mask_reference, tmp_path, warm_torchrun
):
    """Each sequence split over the cp ranks (every rank two of 2 x cp chunks, attending every rank's keys), alone
    and with FSDP, tensor and sequence parallelism, a pipeline, recomputation: the single process's trajectory at
    the same sequence length. fp32: the split sums the loss and the gradients over the same terms in another order
    (2^-24 each, over at most 256 tokens per step), far inside 1e-4."""
    nproc, parallel = CP_LAYOUTS[layout]
    doc_mask = mask == "doc_mask"
    data = doc_mask_job(tmp_path / "run") if doc_mask else job(tmp_path / "run", "llama")
    torchrun(
        warm_torchrun, nproc, write_toml(tmp_path / "job.toml", data), parallel, *fewer_micro_batches(nproc, parallel)
    )
    assert_close(trajectory(tmp_path / "run"), doc_mask_reference if doc_mask else reference["llama"])


def test_checkpoint_saved_under_context_parallelism_resumes_in_one_process(reference, tmp_path, warm_torchrun):
    """2 steps at cp 2 (FSDP's shards over the cp ranks), then steps 3 and 4 in one process: the uninterrupted
    single-process trajectory."""
    config = write_toml(tmp_path / "job.toml", job(tmp_path / "run", "llama", ckpt_every=2))
    torchrun(warm_torchrun, 2, config, {"cp": 2}, "--train.steps", "2")
    train(load_config(config, ["--train.resume", "auto"]))
    assert_close(trajectory(tmp_path / "run"), reference["llama"])


def test_a_long_context_stage_continues_a_checkpoint_at_a_longer_sequence(tmp_path, warm_torchrun):
    """The long-context stages' recipe in small (configs/hlat-7b-long.toml): weights trained at 32 tokens continue
    at 64, with a larger rotary base, split over cp 2, and follow the single process continuing them."""
    train(build_config(job(tmp_path / "pretrained", "llama", steps=2, ckpt_every=2)))
    stage = job(tmp_path / "single", "llama", seq_len=64, init_from=str(tmp_path / "pretrained"))
    stage["model"]["rope_theta"] = 500000.0
    train(build_config(stage))
    stage["train"]["run_dir"] = str(tmp_path / "run")
    torchrun(warm_torchrun, 2, write_toml(tmp_path / "job.toml", stage), {"cp": 2})
    assert_close(trajectory(tmp_path / "run"), trajectory(tmp_path / "single"))


@pytest.fixture(scope="module")
def saved_under_tp2_fsdp2(tmp_path_factory, warm_torchrun):
    """A run of 2 steps under tp 2 x dp 2, checkpointed at step 2."""
    run = tmp_path_factory.mktemp("saved") / "run"
    config = write_toml(run.parent / "job.toml", job(run, "llama", ckpt_every=2))
    torchrun(warm_torchrun, 4, config, {"tp": 2, "dp_shard": 2}, "--train.steps", "2")
    return run


@pytest.mark.parametrize("resumed", [{"dp_shard": 4}, {"pp": 2, "dp_shard": 2}])
def test_checkpoint_resumes_under_another_layout(resumed, saved_under_tp2_fsdp2, reference, tmp_path, warm_torchrun):
    run = tmp_path / "run"
    shutil.copytree(saved_under_tp2_fsdp2, run)
    torchrun(
        warm_torchrun,
        4,
        write_toml(tmp_path / "job.toml", job(run, "llama", ckpt_every=2)),
        resumed,
        "--resume",
        "auto",
    )
    assert_close(trajectory(run), reference["llama"])


def test_resume_at_another_data_parallel_size(reference, tmp_path, warm_torchrun):
    """The global data stream resumes at any data-parallel size and with any number of tokenizer workers:
    dp 2 (2 workers per rank) -> dp 4 (tokenizing in the training process) -> dp 2 (1 worker) follows the
    uninterrupted single-process run (tp 2 x dp 2 -> dp 4 is above)."""
    config = write_toml(tmp_path / "job.toml", job(tmp_path / "run", "llama"))
    torchrun(warm_torchrun, 2, config, {"dp_shard": 2}, "--train.steps", "2", "--data.workers", "2")
    torchrun(warm_torchrun, 4, config, {"dp_shard": 4}, "--train.steps", "3", "--data.workers", "0", "--resume", "auto")
    torchrun(warm_torchrun, 2, config, {"dp_replicate": 2, "dp_shard": 1}, "--data.workers", "1", "--resume", "auto")
    assert_close(trajectory(tmp_path / "run"), reference["llama"])


@pytest.mark.parametrize(
    "parallel, world, message",
    [
        ({"tp": 2, "pp": 2, "dp_shard": 1}, 8, "= 4, but the world size is 8"),
        ({"tp": 3}, 3, "parallel.tp: 3 does not divide model.n_heads 4"),
        ({"pp": 8}, 8, "8 pipeline stages but only 4 layers"),
        ({"pp": 2, "pp_schedule": "interleaved_1f1b", "virtual_stages": 4}, 2, "8 pipeline stages but only 4 layers"),
        ({"dp_replicate": 3}, 4, "does not divide the world size 4"),
        ({"pp": 4, "dp_replicate": 2, "dp_shard": 1}, 8, "cannot fill 4 pipeline stages"),
        ({"tp": 2, "compile": True, "activation_checkpoint": "selective"}, 2, "not supported with tp > 1"),
        ({"dp_shard": 2, "zero1": True, "dp_replicate": 2}, 4, None),
        ({"cp": 3}, 4, "parallel.cp: 3 does not divide the world size 4"),
        ({"cp": 32}, 32, "parallel.cp: train.seq_len 32 is not divisible by 2 x cp = 64"),
        ({"cp": 16, "tp": 4}, 64, "tp 4 does not divide the 2 tokens of each sequence a rank holds"),
    ],
)
def test_impossible_layouts_are_refused_up_front(parallel, world, message, tmp_path):
    cfg = build_config(job(tmp_path, "llama"))
    update(cfg.parallel, parallel)
    if message is None:
        assert cfg.resolved_parallel(world).dp == 4
        return
    with pytest.raises(ConfigError, match=message.replace("(", r"\(")):
        cfg.resolved_parallel(world)


@pytest.mark.parametrize(
    "world, overrides, line",
    [
        ("4", ["--parallel.cp", "3"], "parallel.cp: 3 does not divide the world size 4"),
        (
            "4",
            ["--parallel.cp", "4", "--train.seq_len", "36"],
            "parallel.cp: train.seq_len 36 is not divisible by 2 x cp = 8",
        ),
    ],
)
def test_context_parallel_refusals_are_one_line_before_any_process_group(
    world, overrides, line, tmp_path, capsys, monkeypatch
):
    from hlat.cli import main

    monkeypatch.setenv("WORLD_SIZE", world)  # as torchrun would set it; no process group is started
    config = write_toml(tmp_path / "job.toml", job(tmp_path / "run", "llama"))
    assert main(["train", "--config", str(config), *overrides]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith(f"hlat: error: {line}") and "\n" not in err
    assert not (tmp_path / "run").exists()


@pytest.mark.parametrize("parallel", [{"pp": 2}, {"cp": 2}])
def test_validation_during_training_is_refused_where_it_cannot_run(parallel, tmp_path):
    cfg = build_config(job(tmp_path, "llama"))
    update(cfg.parallel, parallel)
    cfg.eval.every, cfg.eval.holdout = 2, 0.1
    name, degree = next(iter(parallel.items()))
    with pytest.raises(
        ConfigError,
        match=f"eval.every: validation during training is not supported with "
        f"parallel.{name} > 1; evaluate checkpoints with `hlat eval` instead",
    ):
        cfg.resolved_parallel(degree)


def test_selective_checkpointing_recomputes_only_attention():
    from torch.utils._python_dispatch import TorchDispatchMode

    from hlat.models import build_model, materialize
    from hlat.parallel.recompute import apply_recomputation

    class Count(TorchDispatchMode):
        def __init__(self):
            super().__init__()
            self.calls: dict[str, int] = {}

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            name = func.overloadpacket.__name__
            self.calls[name] = self.calls.get(name, 0) + 1
            return func(*args, **(kwargs or {}))

    cfg = build_config(job(Path("."), "llama")).model
    counts = {}
    for mode in ("none", "selective", "full"):
        model = materialize(build_model(cfg), "cpu")
        apply_recomputation(model, mode)
        tokens = torch.randint(0, cfg.vocab_size, (2, 16))
        with Count() as counter:
            model(tokens).sum().backward()
        counts[mode] = counter.calls
    attention = next(k for k in counts["none"] if k.startswith("_scaled_dot_product") and "backward" not in k)
    assert counts["selective"][attention] == counts["full"][attention] == 2 * counts["none"][attention]
    assert counts["selective"]["mm"] == counts["none"]["mm"] < counts["full"]["mm"]  # matmuls are kept


def grad_sync_worker(out: str) -> None:  # one rank of a job of tests/warm_torchrun.py
    import copy

    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.utils._python_dispatch import TorchDispatchMode

    from hlat.models import build_model, materialize
    from hlat.models.config import model_config
    from hlat.parallel.data import apply_data_parallel, sync_gradients

    class Collectives(TorchDispatchMode):
        """The collectives a forward or backward pass issues, by name."""

        def __init__(self):
            super().__init__()
            self.names: list[str] = []

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            if "reduce" in func.overloadpacket.__name__ or "gather" in func.overloadpacket.__name__:
                self.names.append(func.overloadpacket.__name__)
            return func(*args, **(kwargs or {}))

    rank, world = dist.get_rank(), dist.get_world_size()
    cfg = model_config(**MODELS["llama"])
    batches = torch.randint(0, cfg.vocab_size, (world, 2, 2, 16), generator=torch.Generator().manual_seed(0))
    results = {}
    for name, shape, zero1 in (("ddp", (world, 1), False), ("zero1", (1, world), True), ("fsdp", (1, world), False)):
        model = build_model(cfg)
        materialize(model, torch.device("cpu"), seed=0)
        reference = copy.deepcopy(model)
        apply_data_parallel(
            model, init_device_mesh("cpu", shape, mesh_dim_names=("dp_replicate", "dp_shard")), zero1, pipelined=False
        )
        issued = []
        for i, tokens in enumerate(batches[rank]):  # this rank's two micro-batches
            sync_gradients(model, sharded=name == "fsdp", last_micro_batch=i == 1)
            with Collectives() as forward:
                loss = model(tokens).float().logsumexp(-1).mean()
            with Collectives() as backward:
                loss.backward()
            issued.append((sorted(set(forward.names)), sorted(set(backward.names))))
        for tokens in batches.flatten(0, 1):  # every rank's micro-batches, averaged over ranks as FSDP does
            (reference(tokens).float().logsumexp(-1).mean() / world).backward()
        error = max(
            (p.grad.full_tensor() - r.grad).abs().max().item() / r.grad.abs().max().item()
            for p, r in zip(model.parameters(), reference.parameters())
        )
        results[name] = (issued, error)
    torch.save(results, f"{out}/rank{rank}.pt")


def test_gradients_reduce_once_per_step_under_accumulation(tmp_path, warm_torchrun):
    """Replicated and ZeRO-1 layouts issue no gradient collective before the last micro-batch, and ZeRO-1 gathers
    the parameters once per step; FSDP reduce-scatters every micro-batch (to hold only its shard) and defers the
    all-reduce across replicas. Either way the step's gradient is the whole batch's."""
    done = warm_torchrun.call(2, "test_parallel:grad_sync_worker", str(tmp_path))
    assert done.returncode == 0, done.stderr[-3000:]
    for rank in (0, 1):
        results = torch.load(tmp_path / f"rank{rank}.pt")
        reductions = {
            name: [[op for op in ops if "reduce" in op] for _, ops in issued] for name, (issued, _) in results.items()
        }
        assert reductions["ddp"] == [[], ["allreduce_"]]
        assert reductions["zero1"][0] == [] and "_reduce_scatter_base_" in reductions["zero1"][1]
        first, last = reductions["fsdp"]
        assert "_reduce_scatter_base_" in first and "allreduce_" not in first and "allreduce_" in last
        # ZeRO-1 gathers the parameters for the first micro-batch and keeps them until the step's last backward
        (forward1, backward1), (forward2, _) = results["zero1"][0]
        assert any("gather" in op for op in forward1) and not any("gather" in op for op in backward1 + forward2)
        assert all(error < 1e-5 for _, error in results.values()), results
