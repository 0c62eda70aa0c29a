"""Using a trained model: validation loss (during training and `hlat eval`) and text generation (`hlat generate`,
the sample at the end of `make train`).

Validation reads its documents in a fixed order (no shuffling, no workers), tokenizes them, puts EOS after each
and cuts the token stream into rows of seq_len + 1 tokens, consecutive rows sharing one token as in training
(data/packing.py), so every token is a target once; the last row is padded (targets -100). The same batches
are used at every evaluation of a run.
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn
from torch.distributed.tensor import DTensor

from hlat import HlatError
from hlat.data.packing import IGNORE, doc_ids_and_positions
from hlat.data.sources import held_out, iter_documents, resolve_data_files, resolve_paths
from hlat.data.tokenizer import Tokenizer, load_tokenizer
from hlat.models import build_model, materialize
from hlat.models.generate import generate
from hlat.train.checkpoint import CONFIG_FILE, load_checkpoint, resolve_checkpoint
from hlat.train.config import Config, load_config

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float64": torch.float64}


# --- validation data -----------------------------------------------------------------------------------------

def validation_documents(cfg: Config, paths: list[str] | None = None) -> Iterator[str]:
    """`paths` (or eval.paths) in sorted order; without them, the training documents eval.holdout sets aside."""
    paths = paths or cfg.eval.paths
    try:
        files = resolve_paths(paths) if paths else resolve_data_files(cfg.data)
    except HlatError as e:
        raise HlatError(f"validation data: {e}") from None
    for file in files:
        for doc in iter_documents(file, cfg.data.text_field, cfg.data.max_doc_bytes):
            if paths or held_out(doc, cfg.eval.holdout):
                yield doc


def validation_batches(docs: Iterable[str], tokenizer: Tokenizer, seq_len: int, batch_size: int,
                       max_batches: int, doc_mask: bool = False) -> list[dict[str, torch.Tensor]]:
    """Up to `max_batches` batches {"inputs", "targets"} ([batch, seq_len]; plus "positions" and "doc_ids" with
    doc_mask) from the documents in order; fewer when the documents run out."""
    width, wanted = seq_len + 1, max_batches * batch_size
    rows: list[list[int]] = []
    stream: list[int] = []
    for doc in docs:
        ids = tokenizer.encode_batch([doc])[0] if isinstance(doc, str) else doc.tolist()  # token files: ids
        stream += [*ids, tokenizer.eos_id]
        while len(stream) >= width and len(rows) < wanted:
            rows.append(stream[:width])
            stream = stream[seq_len:]  # the row's last token is the next row's first input
        if len(rows) == wanted:
            break
    if len(rows) < wanted and len(stream) > 1:
        rows.append(stream + [-1] * (width - len(stream)))  # the rest, padded
    if not rows:
        raise HlatError("validation data: no tokens (no documents, or every one held out for training)")
    batches = []
    for i in range(0, len(rows), batch_size):
        chunk = torch.tensor(rows[i : i + batch_size])
        pad = chunk < 0
        inputs = torch.where(pad[:, :-1], tokenizer.eos_id, chunk[:, :-1])
        batch = {"inputs": inputs, "targets": torch.where(pad[:, 1:], IGNORE, chunk[:, 1:])}
        if doc_mask:
            batch["doc_ids"], batch["positions"] = doc_ids_and_positions(inputs, tokenizer.eos_id)
        batches.append(batch)
    return batches


@dataclass
class Evaluation:
    loss: float  # mean over the target tokens
    tokens: int

    @property
    def perplexity(self) -> float:
        return math.exp(self.loss) if self.loss < 700 else float("inf")


@torch.no_grad()
def evaluate(model: nn.Module, batches: list[dict[str, torch.Tensor]], device: torch.device,
             autocast=contextlib.nullcontext(), loss_context: Callable = contextlib.nullcontext) -> Evaluation:
    """The mean token loss of `model` (whole, or tensor-parallel: the same value on every rank) over `batches`."""
    total = torch.zeros((), device=device, dtype=torch.float64)
    count = 0
    for batch in batches:
        batch = {k: t.to(device) for k, t in batch.items()}
        targets = batch.pop("targets")
        with loss_context():
            with autocast:
                logits = model(batch.pop("inputs"), **batch)
            loss = F.cross_entropy(logits.float().flatten(0, 1), targets.flatten(), reduction="sum")
        total += (loss.full_tensor() if isinstance(loss, DTensor) else loss).double()
        count += int((targets != IGNORE).sum())
    return Evaluation(total.item() / count, count)


# --- trained models ------------------------------------------------------------------------------------------

def run_tokenizer(checkpoint: Path, cfg: Config) -> Tokenizer:
    """The tokenizer a checkpoint was trained with: the one saved in its run directory, else data.tokenizer."""
    run_dir = checkpoint.parent.parent  # <run>/checkpoints/step_XXXXXXXX
    for directory in (run_dir, checkpoint):
        with contextlib.suppress(HlatError):
            return load_tokenizer(directory)
    if cfg.data.tokenizer:
        return load_tokenizer(cfg.data.tokenizer)
    raise HlatError(f"{checkpoint}: no tokenizer in {run_dir} and data.tokenizer is not set; give --tokenizer")


def load_trained(path: str | Path, device: torch.device | str = "cpu", dtype: str = "float32",
                 tokenizer: str | None = None) -> tuple[Config, nn.Module, Tokenizer]:
    """The config, model (weights of the checkpoint, or a run directory's latest) and tokenizer of a run."""
    checkpoint = resolve_checkpoint(path)
    if not (checkpoint / CONFIG_FILE).is_file():
        raise HlatError(f"{checkpoint}: has no {CONFIG_FILE}, so its model shape is unknown")
    cfg = load_config(checkpoint / CONFIG_FILE)
    model = materialize(build_model(cfg.model), device)
    load_checkpoint(checkpoint, [model])
    tok = load_tokenizer(tokenizer) if tokenizer else run_tokenizer(checkpoint, cfg)
    return cfg, model.to(DTYPES[dtype]).eval(), tok


def sample_text(model: nn.Module, tokenizer: Tokenizer, prompt: str, max_new_tokens: int, temperature: float = 0.0,
                top_p: float = 1.0, seed: int = 0) -> str:
    """The text `model` writes after `prompt`, stopping at EOS or max_new_tokens (cut to fit max_seq_len)."""
    (ids,) = tokenizer.encode_batch([prompt])
    if not ids:
        ids = [tokenizer.eos_id]  # an empty prompt: start as a new document would
    limit = model.cfg.max_seq_len
    if len(ids) >= limit:
        raise HlatError(f"the prompt is {len(ids)} tokens; the model reads at most {limit}")
    device = next(model.parameters()).device
    generator = torch.Generator(device).manual_seed(seed)
    (new,) = generate(model, [ids], min(max_new_tokens, limit - len(ids)), temperature, top_p, tokenizer.eos_id,
                      generator=generator)
    if new and new[-1] == tokenizer.eos_id:
        new = new[:-1]
    return tokenizer.decode(new)
