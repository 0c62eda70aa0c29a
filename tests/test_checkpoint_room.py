"""The room the durable tier's checkpoints need, checked once before the first step (hlat/checkpoint/room.py): a
run whose checkpoints cannot fit is refused in one line, exit code 2, and keeping every checkpoint warns when they
will outgrow the disk."""

import json
from collections import namedtuple

from test_disk import one_line, only_step_2_intact, two_step_run
from test_faults import write_config
from test_train import config

from hlat import files
from hlat.cli import main
from hlat.paths import complete_checkpoints

Usage = namedtuple("Usage", "total used free")


def test_a_run_whose_checkpoints_cannot_fit_is_refused_before_its_first_step(tmp_path, capsys, monkeypatch):
    """The free-space check, on resume, against the size of the checkpoint resumed from (its manifest) times the
    rotation: keep_checkpoints = 2 with one already there needs room for 2 more."""
    cfg_file = two_step_run(tmp_path)
    checkpoint = complete_checkpoints(tmp_path / "run")[0][1]
    size = sum(size for size, _ in json.loads((checkpoint / "manifest.json").read_text()).values())
    monkeypatch.setattr(files.shutil, "disk_usage", lambda path: Usage(10**12, 10**12 - 2 * size + 1, 2 * size - 1))
    assert main(["train", "--config", str(cfg_file)]) == 2
    err = one_line(capsys)
    assert (
        f"not enough free space for the checkpoints of {tmp_path}/run: {files.size_text(2 * size - 1)} free, 2 x "
        f"{files.size_text(size)} needed (train.keep_checkpoints = 2, and the one being written)" in err
    )
    only_step_2_intact(tmp_path / "run")
    assert len((tmp_path / "run" / "metrics.jsonl").read_text().splitlines()) == 2  # nothing ran

    monkeypatch.setattr(files.shutil, "disk_usage", lambda path: Usage(10**12, 0, 2 * size))
    assert main(["train", "--config", str(cfg_file)]) == 0


def test_a_fresh_run_is_checked_against_its_weights_and_optimizer_states(tmp_path, capsys, monkeypatch):
    """Before any checkpoint exists: parameters x (weight + optimizer bytes) of the precision mode (fp32: 4 + 8);
    the first checkpoint written is that size within its files' headers and small entries (about 20 KB per
    parameter tensor: a few percent of this 1.4M-parameter model, nothing of a large one). A file system that
    reports no size at all (some FUSE mounts: 0 of 0) is not checked."""
    cfg = config(tmp_path / "run", steps=2, ckpt_every=2)
    cfg.model.dim, cfg.model.ffn_dim = 256, 512
    cfg.data.workers = 0
    cfg_file = write_config(tmp_path / "c.toml", cfg)
    estimate = cfg.model.num_params() * 12
    monkeypatch.setattr(files.shutil, "disk_usage", lambda path: Usage(10**12, 10**12, 1000))
    assert main(["train", "--config", str(cfg_file)]) == 2
    assert f"{files.size_text(1000)} free, 3 x {files.size_text(estimate)} needed" in one_line(capsys)
    monkeypatch.setattr(files.shutil, "disk_usage", lambda path: Usage(0, 0, 0))
    assert main(["train", "--config", str(cfg_file)]) == 0
    written = sum(
        size
        for size, _ in json.loads((complete_checkpoints(tmp_path / "run")[0][1] / "manifest.json").read_text()).values()
    )
    assert estimate <= written < 1.1 * estimate


def test_keeping_every_checkpoint_warns_when_they_will_outgrow_the_disk(tmp_path, capsys, monkeypatch):
    cfg = config(tmp_path / "run", steps=8, ckpt_every=2, keep_checkpoints=0)
    cfg.data.workers = 0
    estimate = cfg.model.num_params() * 12
    monkeypatch.setattr(files.shutil, "disk_usage", lambda path: Usage(10**12, 0, int(2.5 * estimate)))
    assert main(["train", "--config", str(write_config(tmp_path / "c.toml", cfg))]) == 0
    assert (
        f"has room for 2 of the 4 checkpoints of {files.size_text(estimate)} this run will keep"
        in capsys.readouterr().out
    )
