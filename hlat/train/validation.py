"""Validation loss: during training (every `eval.every` steps, on the default set of eval.paths or eval.holdout
and on each named set of eval.sets) and for `hlat eval`.

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

import torch
from torch import nn

from hlat import HlatError
from hlat.config.job import Config
from hlat.data.packing import IGNORE, rows_to_batch
from hlat.data.readers import iter_documents
from hlat.data.records import held_out
from hlat.data.sources import Source, resolve_paths, resolve_sources, source_files
from hlat.data.tokenizer import Tokenizer


def validation_documents(
    cfg: Config, sources: list[Source] | None = None, paths: list[str] | None = None
) -> Iterator[str]:
    """`paths` (or eval.paths) in sorted order; without them, the documents of the run's data (`sources`, resolved
    here when not given) that eval.holdout sets aside."""
    paths = paths or cfg.eval.paths
    try:
        files = resolve_paths(paths) if paths else source_files(sources or resolve_sources(cfg.data))
    except HlatError as e:
        raise HlatError(f"validation data: {e}") from None
    for file in files:
        for doc in iter_documents(file, cfg.data.text_field, cfg.data.max_doc_bytes):
            if paths or held_out(doc, cfg.eval.holdout):
                yield doc


def validation_batches(
    docs: Iterable[str], tokenizer: Tokenizer, seq_len: int, batch_size: int, max_batches: int, doc_mask: bool = False
) -> list[dict[str, torch.Tensor]]:
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
    return [
        rows_to_batch(torch.tensor(rows[i : i + batch_size]), tokenizer.eos_id, doc_mask)
        for i in range(0, len(rows), batch_size)
    ]


@dataclass
class Evaluation:
    loss: float  # mean over the target tokens
    tokens: int

    @property
    def perplexity(self) -> float:
        return math.exp(self.loss) if self.loss < 700 else float("inf")

    def figures(self, name: str = "") -> dict:
        """The metrics record's validation fields: val_loss... for the default set, val_NAME_loss... for set NAME."""
        prefix = f"val_{name}_" if name else "val_"
        return {f"{prefix}loss": self.loss, f"{prefix}perplexity": self.perplexity, f"{prefix}tokens": self.tokens}


@torch.no_grad()
def evaluate(
    model: nn.Module,
    batches: list[dict[str, torch.Tensor]],
    device: torch.device,
    autocast=contextlib.nullcontext(),  # noqa: B008 (reusable)
    loss_context: Callable = contextlib.nullcontext,
) -> Evaluation:
    """The mean token loss of `model` (whole, or tensor-parallel: the same value on every rank) over `batches`."""
    total = torch.zeros((), device=device, dtype=torch.float64)
    count = 0
    for batch in batches:
        batch = {k: t.to(device) for k, t in batch.items()}
        with loss_context(), autocast:
            total += model(batch.pop("inputs"), reduction="sum", **batch).double()
        count += int((batch["targets"] != IGNORE).sum())
    return Evaluation(total.item() / count, count)


class Validation:
    """Validation during training: each set's batches, built once before the first step, and when to evaluate
    them (every `eval.every` steps and at the last step; never without `eval.every`). `latest` holds the figures
    of the last evaluation."""

    def __init__(self, cfg: Config, tokenizer: Tokenizer, sources: list[Source]):
        self.every, self.last = cfg.eval.every, cfg.train.steps
        self.sets: dict[str, list[dict]] = {}  # by name; "" is the default set
        self.latest: dict = {}
        for name, documents in (validation_sets(cfg, sources) if self.every else {}).items():
            try:
                self.sets[name] = validation_batches(
                    documents, tokenizer, cfg.train.seq_len, cfg.train.micro_batch, cfg.eval.batches, cfg.model.doc_mask
                )
            except HlatError as e:
                raise HlatError(f"eval.sets: {name!r}: {e}" if name else str(e)) from None

    def due(self, step: int) -> bool:
        return bool(self.every) and (step % self.every == 0 or step == self.last)

    def run(self, model: nn.Module, device: torch.device, autocast, loss_context: Callable) -> dict:
        self.latest = {}
        for name, batches in self.sets.items():
            self.latest.update(evaluate(model, batches, device, autocast, loss_context).figures(name))
        return self.latest


def validation_sets(cfg: Config, sources: list[Source]) -> dict[str, Iterator[str]]:
    """The documents of each validation set: the default set ("") of eval.paths or eval.holdout, if either is set,
    and each named set of eval.sets."""
    named = {name: validation_documents(cfg, paths=patterns) for name, patterns in cfg.eval.named_sets().items()}
    return ({"": validation_documents(cfg, sources)} if cfg.eval.paths or cfg.eval.holdout else {}) | named
