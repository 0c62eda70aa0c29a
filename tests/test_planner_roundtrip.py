"""One layout type between planner and trainer: `plan --emit` writes a config the trainer runs as it is, and
`plan --calibrate` reads back exactly the layout the trainer resolved."""

from __future__ import annotations

import json
import os

import pytest

from hlat.config.job import build_config
from hlat.fields import load_toml
from hlat.models.config import model_config
from hlat.planner.cli import run_sample
from hlat.planner.layout import Layout, Workload
from hlat.profiles import load_profile

CPU = load_profile("cpu")
CORPUS = os.path.join(os.path.dirname(json.__file__), "*.py")  # a few files: the first round is quickly made


def write_run(run_dir, config: dict, world: int, step_s: float = 1.0):
    """A run directory as the trainer leaves it: config.toml with the resolved layout, and metrics."""
    cfg = build_config(config)
    run_dir.mkdir()
    (run_dir / "config.toml").write_text(cfg.run_record(cfg.resolved_parallel(world)))
    (run_dir / "metrics.jsonl").write_text(
        "".join(json.dumps({"step": i, "step_time_s": step_s}) + "\n" for i in range(1, 4))
    )
    return cfg


@pytest.mark.parametrize(
    "parallel, world, check",
    [
        ({"dp_shard": -1, "zero1": True}, 4, lambda lay: lay.sharding == "zero1" and lay.dp_shard == 4),
        ({"pp": 2, "pp_schedule": "1f1b"}, 2, lambda lay: lay.virtual_stages == 1),  # not the default 2 chunks
        ({"pp": 3, "dp_shard": 1}, 3, lambda lay: lay.pp == 3),  # 32 layers split 11/11/10, as the trainer runs
        (
            {"tp": 2, "dp_replicate": 2, "dp_shard": 2, "activation_checkpoint": "selective"},
            8,
            lambda lay: lay.sharding == "hsdp" and lay.sequence_parallel,
        ),
    ],
)
def test_calibrate_reads_back_the_layout_the_trainer_resolved(tmp_path, parallel, world, check):
    config = {
        "model": {"preset": "llama2-7b"},
        "parallel": parallel,
        "train": {"global_batch": 24, "micro_batch": 1, "seq_len": 128},
    }
    cfg = write_run(tmp_path / "run", config, world)
    sample = run_sample(str(tmp_path / "run"), CPU)
    assert sample.layout == Layout(cfg.resolved_parallel(world), 1) and check(sample.layout)


def test_emit_train_calibrate_keeps_every_layout_field(tmp_path, capsys):
    """The emitted config trains as it is (one process, a few steps) and its run reads back to the same layout."""
    from hlat.cli import main
    from hlat.train.loop import train

    model = tmp_path / "model.toml"
    model.write_text(
        '[model]\npreset = "tiny"\nn_layers = 2\ndim = 64\nn_heads = 2\nffn_dim = 128\n'
        "vocab_size = 512\n[train]\nseq_len = 32\nglobal_batch = 4\nmicro_batch = 2\n"
        '[precision]\nmode = "fp32"\n'
    )
    emitted = tmp_path / "emitted.toml"
    assert (
        main(
            [
                "plan",
                "--config",
                str(model),
                "--hardware",
                "cpu",
                "--microbatch",
                "2",
                "--recompute",
                "full",
                "--emit",
                str(emitted),
            ]
        )
        == 0
    )
    tables = load_toml(emitted)
    assert set(tables) == {"model", "precision", "parallel", "train"}
    cfg = build_config(
        tables,
        [
            "--train.steps",
            "2",
            "--train.log_every",
            "1",
            "--train.run_dir",
            str(tmp_path / "run"),
            "--train.ckpt_every",
            "0",
            "--data.paths",
            CORPUS,
        ],
    )
    train(cfg)
    sample = run_sample(str(tmp_path / "run"), CPU)
    planned = Layout(build_config(tables).resolved_parallel(1), 2)
    assert sample.layout == planned and sample.layout.activation_checkpoint == "full"
    assert sample.workload == Workload(
        model_config("tiny", n_layers=2, dim=64, n_heads=2, ffn_dim=128, vocab_size=512), 32, 4, "fp32"
    )
