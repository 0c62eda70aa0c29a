"""Checks before weights are loaded into a run: that a checkpoint's tensors fit the model (for `train.init_from`
and resuming), and what a resumed run changes against the config its checkpoint was saved with."""

from __future__ import annotations

from pathlib import Path

import torch.distributed.checkpoint as dcp
from torch import nn

from hlat import HlatError
from hlat.checkpoint.durable import DamagedCheckpoint, newest_good_checkpoint, verified_checkpoint
from hlat.config.job import Config, load_config
from hlat.fields import to_dict
from hlat.parallel.mesh import continues_run
from hlat.paths import CONFIG_FILE, checkpoint_step, latest_checkpoint

# What a resume may change without a word: where and how it runs, not what it computes.
_UNWATCHED = {
    "data",
    "parallel",
    "cluster",
    "eval",
    "cost",
    "health",
    "tracking",
    "train.run_dir",
    "train.resume",
    "train.init_from",
    "train.log_every",
    "train.ckpt_every",
    "train.keep_checkpoints",
    "train.device",
    "train.peak_flops",
    "train.allow_schedule_change",
}


def check_model_shapes(path: Path, model: nn.Module) -> None:
    """Fail in one line, naming the first tensor whose shape differs, when checkpoint `path` does not hold this
    model (DCP would otherwise fail deep inside the load with a long nested error)."""
    saved = dcp.FileSystemReader(path).read_metadata().state_dict_metadata
    for name, tensor in model.state_dict().items():
        meta = saved.get(f"model.{name}")
        if meta is None:
            raise HlatError(f"{path}: has no tensor {name!r}: it holds another model{_model_hint(path)}")
        if tuple(meta.size) != tuple(tensor.shape):
            raise HlatError(
                f"{path}: tensor {name!r} has shape {list(meta.size)} in the checkpoint but "
                f"{list(tensor.shape)} in this model{_model_hint(path)}"
            )


def _model_hint(path: Path) -> str:
    """'; the checkpoint's config has model.dim = 128, ...' when the checkpoint says how it was built."""
    if not (path / CONFIG_FILE).is_file():
        return ""
    model = to_dict(load_config(path / CONFIG_FILE).model)
    shape = ("family", "dim", "n_layers", "n_heads", "n_kv_heads", "ffn_dim", "vocab_size", "tie_embeddings")
    return "; the checkpoint was built with " + ", ".join(f"model.{k} = {model[k]!r}" for k in shape)


def config_changes(saved: Config, current: Config, unwatched: set[str] = _UNWATCHED) -> list[str]:
    """'section.field: old -> new' for every field that changes what the run computes (of the sections and fields
    not in `unwatched`)."""
    old, new = to_dict(saved), to_dict(current)
    return [
        f"{section}.{key}: {value!r} -> {new[section][key]!r}"
        for section, table in old.items()
        if section not in unwatched
        for key, value in table.items()
        if f"{section}.{key}" not in unwatched and new[section][key] != value
    ]


# What the learning rate of a step is made of (`Config.lr_at`): a refused schedule change names only these.
SCHEDULE_FIELDS = ("optim.lr", "optim.min_lr", "optim.warmup_steps", "optim.decay_steps", "train.steps")


def schedule_changes(saved: Config, current: Config, step: int) -> bool:
    """Whether the learning rate of any step from `step` on differs (the decay horizon is optim.decay_steps, or
    train.steps when that is 0, so a longer run reshapes the schedule)."""
    last = max(saved.train.steps, current.train.steps, saved.optim.decay_steps, current.optim.decay_steps)
    return any(saved.lr_at(s) != current.lr_at(s) for s in range(step, last + 1))


def find_resume_checkpoint(cfg: Config) -> tuple[Path | None, list[DamagedCheckpoint]]:
    """The checkpoint to resume from, and the damaged checkpoints passed over to find it.

    `--resume auto` takes the newest checkpoint that verifies against its manifest (none: start fresh if the
    run has no checkpoint at all); a checkpoint named explicitly is verified and refused if damaged. A worker of a
    torchrun job that restarts its workers in place runs the command line its run started with at every attempt:
    it continues that run (auto), rather than being refused the checkpoints an earlier attempt wrote."""
    resume = cfg.train.resume or ("auto" if continues_run() else "")
    if not resume:
        if latest_checkpoint(cfg.train.run_dir):  # never overwrite a run's checkpoints by starting afresh
            raise HlatError(
                f"train.run_dir: {cfg.train.run_dir} already holds checkpoints; continue it with "
                "--resume auto or choose another --train.run_dir"
            )
        return None, []
    if resume != "auto":
        try:
            return verified_checkpoint(resume), []
        except DamagedCheckpoint as e:
            raise HlatError(
                f"{e}; refusing to resume from it (--resume auto falls back to the previous good checkpoint)"
            ) from None
    found, passed_over = newest_good_checkpoint(cfg.train.run_dir)
    if found is None and passed_over:
        raise HlatError(f"train.run_dir: {cfg.train.run_dir}: every checkpoint is damaged ({passed_over[0]})")
    return found, passed_over


def check_start(cfg: Config, resume_from: Path | None, model: nn.Module) -> list[str]:
    """Before any process group: the weights the run starts from fit `model` (on meta), and a resume's changes to
    the config (returned, for the log) are allowed."""
    if resume_from is not None:
        check_model_shapes(resume_from, model)
        return check_resume(resume_from, cfg)
    if cfg.train.init_from:
        check_model_shapes(verified_checkpoint(cfg.train.init_from), model)
    return []


def check_resume(path: Path, cfg: Config) -> list[str]:
    """What resuming checkpoint `path` with `cfg` changes; refused in one line when the learning rate of a step
    still to run changes and `train.allow_schedule_change` is off."""
    if not (path / CONFIG_FILE).is_file():
        return []
    step = checkpoint_step(path) or 0
    saved = load_config(path / CONFIG_FILE)
    changes = config_changes(saved, cfg)
    if changes and schedule_changes(saved, cfg, step) and not cfg.train.allow_schedule_change:
        moved = [change for change in changes if change.partition(":")[0] in SCHEDULE_FIELDS]
        raise HlatError(
            f"resuming {path} changes the learning-rate schedule from step {step} on "
            f"({'; '.join(moved)}); pass --train.allow_schedule_change true to accept that, or keep the "
            "old values (set optim.decay_steps to fix the schedule's length while changing train.steps)"
        )
    return changes
