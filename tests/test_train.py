"""The single-process trainer: exact resume, metrics and clean errors for bad input (its checkpoints:
tests/test_checkpoint_*.py)."""

import json
import os
from pathlib import Path

import pytest
import torch

from hlat.checkpoint.state import load_weights
from hlat.cli import main
from hlat.config.job import build_config
from hlat.models import build_model, layers, materialize
from hlat.paths import complete_checkpoints
from hlat.train.loop import train
from hlat.train.step import TrainStep

CORPUS = os.path.join(os.path.dirname(json.__file__), "*.py")  # a few real files, on every machine
TINY = {"preset": "tiny", "dim": 64, "n_layers": 2, "n_heads": 4, "n_kv_heads": 2, "ffn_dim": 128, "vocab_size": 512}


def config(run_dir: Path, decay_steps=8, **train):
    """A tiny run in `run_dir`, its memory tier's snapshots beside it (not in /dev/shm, which outlives the test)."""
    data = {
        "model": dict(TINY),
        "data": {"paths": [CORPUS]},
        "optim": {"lr": 3e-3, "min_lr": 3e-4, "warmup_steps": 2, "decay_steps": decay_steps},
        "train": {
            "steps": 8,
            "global_batch": 4,
            "micro_batch": 2,
            "seq_len": 32,
            "log_every": 1,
            "run_dir": str(run_dir),
            "snapshot_dir": str(run_dir.parent / "snapshots"),
            **train,
        },
    }
    return build_config(data)


def losses(run_dir: Path) -> list[float]:
    return [json.loads(line)["loss"] for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


def final_weights(run_dir: Path, cfg) -> dict:
    model = materialize(build_model(cfg.model), "cpu")
    load_weights(complete_checkpoints(run_dir)[-1][1], [model])
    return model.state_dict()


@pytest.mark.parametrize("precision", ["fp32", "bf16_mixed", "bf16_sr"])
def test_resume_is_bit_exact(tmp_path, precision, monkeypatch):
    """...and a resume draws no initial weights (the checkpoint's are loaded over them: each rank would draw every
    parameter's full value, seconds per billion parameters, only to overwrite it)."""
    drawn = []
    monkeypatch.setattr(
        layers, "initial_value", lambda *args, real=layers.initial_value: drawn.append(args[1]) or real(*args)
    )

    def run(name, **train_fields):
        cfg = config(tmp_path / name, **train_fields)
        cfg.precision.mode = precision
        drawn.clear()
        train(cfg)
        return cfg

    full = run("full")
    assert "tok_embeddings.weight" in drawn
    run("split", steps=3)  # stops at step 3 (same schedule: decay_steps is fixed)
    run("split", resume="auto")
    assert drawn == []
    assert losses(tmp_path / "split") == losses(tmp_path / "full")
    assert len(losses(tmp_path / "full")) == 8
    a, b = final_weights(tmp_path / "full", full), final_weights(tmp_path / "split", full)
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def test_metrics_and_learning(tmp_path):
    cfg = config(
        tmp_path / "run",
        decay_steps=30,
        steps=30,
        ckpt_every=10,
        keep_checkpoints=2,
        global_batch=16,
        micro_batch=8,
        seq_len=64,
    )
    summary = train(cfg)
    records = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in records] == list(range(1, 31))
    for key in ("loss", "grad_norm", "lr", "tokens_seen", "tokens_per_s", "step_time_s", "mfu", "peak_memory_gb"):
        assert all(r[key] is not None for r in records), key
    assert records[-1]["tokens_seen"] == 30 * 16 * 64 == summary.tokens_seen
    assert summary.last_loss < 0.85 * summary.first_loss  # from ln(512) = 6.24 to below the unigram entropy
    assert [s for s, _ in complete_checkpoints(tmp_path / "run")] == [20, 30]  # keep_checkpoints prunes
    assert (tmp_path / "run" / "tokenizer.json").is_file()


class HostReads:
    """Counts, inside each call of `TrainStep`, the calls that read a tensor's values to the host (on an accelerator,
    a device-to-host transfer; on a CPU the same calls, though nothing moves). Reads of the optimizers' step
    counters are left out: torch's AdamW and hlat's BF16AdamW keep them as host tensors on every device
    (`state["step"]`), so reading them transfers nothing anywhere."""

    CALLS = ("item", "tolist", "numpy", "__bool__", "__float__", "__int__")

    def __init__(self, monkeypatch):
        self.per_step: list[int] = []
        self.stepping, self.optimizers = False, []
        for name in self.CALLS:
            monkeypatch.setattr(torch.Tensor, name, self.counted(getattr(torch.Tensor, name)))
        real_step = TrainStep.__call__

        def step(train_step, *args):
            self.optimizers, self.stepping = train_step.parts.optimizers, True
            self.per_step.append(0)
            try:
                return real_step(train_step, *args)
            finally:
                self.stepping = False

        monkeypatch.setattr(TrainStep, "__call__", step)

    def counted(self, real):
        def read(tensor, *args, **kwargs):
            if self.stepping and not any(
                tensor is state.get("step") for optimizer in self.optimizers for state in optimizer.state.values()
            ):
                self.per_step[-1] += 1
            return real(tensor, *args, **kwargs)

        return read


def test_a_step_reads_from_the_device_once(tmp_path, monkeypatch):
    """The loss, the gradient norm and the stop and save flags come back in one transfer (hlat.train.step), which
    the bad-step decision needs before the update; logging and checkpointing read nothing more inside a step."""
    reads = HostReads(monkeypatch)
    cfg = config(tmp_path / "run", steps=3, ckpt_every=2, async_checkpoint=True)
    cfg.data.workers = 0  # the stream in this process: its reads, if any, would count
    train(cfg)
    assert reads.per_step == [1, 1, 1]


@pytest.mark.parametrize(
    "override, message",
    [
        (["--data.paths", "/no/such/dir/*.txt"], "data.paths: no files match"),
        (["--train.resume", "{empty}"], "holds no complete checkpoint"),
        (["--train.init_from", "{empty}"], "holds no complete checkpoint"),
    ],
)
def test_bad_input_is_one_line(tmp_path, capsys, override, message):
    (tmp_path / "empty").mkdir()
    cfg_file = tmp_path / "c.toml"
    cfg_file.write_text(config(tmp_path / "run").to_toml())
    override = [o.format(empty=tmp_path / "empty") for o in override]
    assert main(["train", "--config", str(cfg_file), *override]) == 2
    err = capsys.readouterr().err.strip()
    assert message in err and "\n" not in err and "Traceback" not in err


def test_empty_corpus_is_an_error(tmp_path, capsys):
    (tmp_path / "blank.txt").write_text("   \n")
    cfg_file = tmp_path / "c.toml"
    cfg_file.write_text(config(tmp_path / "run").to_toml())
    assert main(["train", "--config", str(cfg_file), "--data.paths", str(tmp_path / "blank.txt")]) == 2
    assert "no documents" in capsys.readouterr().err


def test_sigterm_to_the_whole_job_checkpoints_and_resumes(tmp_path):
    """A scheduler's SIGTERM reaches every process of the job, tokenizer workers included: the trainer
    finishes its step, checkpoints, stops its workers and exits 0; --resume auto continues from there.
    (Workers ignore SIGTERM so that a step still waiting for data when it comes can finish.)"""
    import signal
    import subprocess
    import sys
    import time

    cfg_file = tmp_path / "c.toml"
    cfg = config(tmp_path / "run", steps=10_000, decay_steps=10_000)
    cfg.data.workers = 1
    cfg_file.write_text(cfg.to_toml())
    job = subprocess.Popen(
        [sys.executable, "-m", "hlat", "train", "--config", str(cfg_file)],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        start_new_session=True,
    )
    metrics = tmp_path / "run" / "metrics.jsonl"
    deadline = time.time() + 120
    while (not metrics.exists() or len(metrics.read_text().splitlines()) < 3) and time.time() < deadline:
        time.sleep(0.2)
    os.killpg(job.pid, signal.SIGTERM)
    out, _ = job.communicate(timeout=120)
    assert job.returncode == 0, out
    assert "stopped by signal" in out
    ((stopped_at, _),) = complete_checkpoints(tmp_path / "run")
    assert stopped_at >= 3 and len(losses(tmp_path / "run")) == stopped_at
    assert main(["train", "--config", str(cfg_file), "--resume", "auto", "--train.steps", str(stopped_at + 2)]) == 0
    assert len(losses(tmp_path / "run")) == stopped_at + 2


def test_single_process_runs_honour_activation_checkpointing(tmp_path):
    """The parallel section's per-model settings apply without torchrun too: full recomputation runs each
    layer's forward matmuls again in the backward pass, and does not change the trajectory (compiling without
    torchrun: tests/test_fp8.py, test_compiled_fp8_blocks_follow_the_eager_ones)."""
    from torch.utils._python_dispatch import TorchDispatchMode

    class MatmulCount(TorchDispatchMode):
        def __init__(self):
            super().__init__()
            self.matmuls = 0

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            self.matmuls += func.overloadpacket.__name__ in ("mm", "addmm", "bmm")
            return func(*args, **(kwargs or {}))

    def run(name: str, **parallel) -> int:
        cfg = config(tmp_path / name, steps=2)
        for key, value in parallel.items():
            setattr(cfg.parallel, key, value)
        cfg.data.workers = 0  # tokenise in this process, under the counting mode
        with MatmulCount() as count:
            train(cfg)
        return count.matmuls

    plain, recomputed = run("plain"), run("full", activation_checkpoint="full")
    assert recomputed > plain
    assert losses(tmp_path / "full") == pytest.approx(losses(tmp_path / "plain"), rel=1e-6)
