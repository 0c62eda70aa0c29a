"""Trained models: loading one from a checkpoint (for `hlat eval`, `hlat generate` and `hlat export-hf`) and
continuing a prompt with it (`hlat generate`, the sample at the end of `make train`)."""

from __future__ import annotations

from pathlib import Path

import torch
from torch import nn

from hlat import HlatError
from hlat.checkpoint.durable import verified_checkpoint
from hlat.checkpoint.state import load_weights
from hlat.config.job import Config, load_config
from hlat.data.tokenizer import Tokenizer, load_tokenizer, tokenizer_file_in
from hlat.models import build_model, materialize
from hlat.models.generate import generate
from hlat.paths import CONFIG_FILE

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float64": torch.float64}


def saved_tokenizer(checkpoint: Path) -> Tokenizer | None:
    """The tokenizer a run saved beside its checkpoints (<run>/checkpoints/step_N -> <run>), or in the checkpoint
    itself (an imported one), if any."""
    for directory in (checkpoint.parent.parent, checkpoint):
        if directory.is_dir() and tokenizer_file_in(directory) is not None:
            return load_tokenizer(directory)
    return None


def load_trained_model(
    path: str | Path, device: torch.device | str = "cpu", dtype: str = "float32"
) -> tuple[Path, Config, nn.Module]:
    """The checkpoint (`path`, or a run directory's latest), verified against its manifest, its config and its model,
    in eval mode."""
    checkpoint = verified_checkpoint(path)
    if not (checkpoint / CONFIG_FILE).is_file():
        raise HlatError(f"{checkpoint}: has no {CONFIG_FILE}, so its model shape is unknown")
    cfg = load_config(checkpoint / CONFIG_FILE)
    model = materialize(build_model(cfg.model), device, weights="loaded")
    load_weights(checkpoint, [model])
    return checkpoint, cfg, model.to(DTYPES[dtype]).eval()


def load_trained(
    path: str | Path, device: torch.device | str = "cpu", dtype: str = "float32", tokenizer: str | None = None
) -> tuple[Config, nn.Module, Tokenizer]:
    """The config, model and tokenizer of a run: `tokenizer`, else the one the run saved, else data.tokenizer."""
    checkpoint, cfg, model = load_trained_model(path, device, dtype)
    if tokenizer:
        return cfg, model, load_tokenizer(tokenizer)
    saved = saved_tokenizer(checkpoint)
    if saved is None and not cfg.data.tokenizer:
        raise HlatError(
            f"{checkpoint}: no tokenizer in it or in its run directory {checkpoint.parent.parent}, and "
            "data.tokenizer is not set; give --tokenizer"
        )
    return cfg, model, saved or load_tokenizer(cfg.data.tokenizer)


def sample_text(
    model: nn.Module,
    tokenizer: Tokenizer,
    prompt: str,
    max_new_tokens: int,
    temperature: float = 0.0,
    top_p: float = 1.0,
    seed: int = 0,
) -> str:
    """The text `model` writes after `prompt`, stopping at EOS or max_new_tokens (cut to fit max_seq_len)."""
    (ids,) = tokenizer.encode_batch([prompt])
    if not ids:
        ids = [tokenizer.eos_id]  # an empty prompt: start as a new document would
    limit = model.cfg.max_seq_len
    if len(ids) >= limit:
        raise HlatError(f"the prompt is {len(ids)} tokens; the model reads at most {limit}")
    device = next(model.parameters()).device
    generator = torch.Generator(device).manual_seed(seed)
    (new,) = generate(
        model, [ids], min(max_new_tokens, limit - len(ids)), temperature, top_p, tokenizer.eos_id, generator=generator
    )
    if new and new[-1] == tokenizer.eos_id:
        new = new[:-1]
    return tokenizer.decode(new)
