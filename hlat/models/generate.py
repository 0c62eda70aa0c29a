"""Text generation from an hlat model: greedy or sampled (temperature, nucleus top-p), with a KV cache (one
position's forward per new token) or, for comparison, recomputing the whole prefix at every token."""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import nn

from hlat.models.kv_cache import KVCache


def next_token(
    logits: torch.Tensor, temperature: float, top_p: float, generator: torch.Generator | None
) -> torch.Tensor:
    """The next token [batch] from the last position's logits [batch, vocab]: the argmax at temperature 0, else
    a sample from softmax(logits / temperature) restricted to the smallest set of tokens whose probability
    reaches top_p (the most likely token is always kept)."""
    if temperature == 0:
        return logits.argmax(-1)
    probs = torch.softmax(logits.float() / temperature, dim=-1)
    if top_p < 1.0:
        sorted_probs, order = probs.sort(dim=-1, descending=True)
        before = sorted_probs.cumsum(-1) - sorted_probs  # probability of the tokens ranked above each one
        sorted_probs = sorted_probs.masked_fill(before >= top_p, 0.0)
        probs = torch.zeros_like(probs).scatter_(-1, order, sorted_probs)
    return torch.multinomial(probs, 1, generator=generator).squeeze(-1)


@torch.no_grad()
def generate(
    model: nn.Module,
    prompts: Sequence[Sequence[int]],
    max_new_tokens: int,
    temperature: float = 0.0,
    top_p: float = 1.0,
    eos_id: int | None = None,
    use_cache: bool = True,
    generator: torch.Generator | None = None,
) -> list[list[int]]:
    """The new tokens of each prompt (all prompts of one length), at most `max_new_tokens`, ending at EOS
    (included) when `eos_id` is given. The prompt plus the new tokens must fit in model.cfg.max_seq_len."""
    if not prompts or not prompts[0] or len({len(p) for p in prompts}) != 1:
        raise ValueError("generate: needs one or more non-empty prompts of the same length")
    cfg = model.cfg
    device = next(model.parameters()).device
    tokens = torch.tensor([list(p) for p in prompts], device=device)
    total = tokens.shape[1] + max_new_tokens
    if total > cfg.max_seq_len:
        raise ValueError(
            f"the prompt ({tokens.shape[1]} tokens) plus {max_new_tokens} new tokens exceed "
            f"model.max_seq_len {cfg.max_seq_len}"
        )
    dtype = next(model.parameters()).dtype
    cache = KVCache(cfg, tokens.shape[0], total, device, dtype) if use_cache else None
    done = torch.zeros(tokens.shape[0], dtype=torch.bool, device=device)
    out: list[torch.Tensor] = []
    step_input = tokens
    for _ in range(max_new_tokens):
        logits = model(step_input, cache=cache) if use_cache else model(tokens)
        token = next_token(logits[:, -1], temperature, top_p, generator)
        if eos_id is not None:
            token = torch.where(done, eos_id, token)  # a finished sequence only repeats EOS (trimmed below)
            done |= token == eos_id
        out.append(token)
        tokens = torch.cat([tokens, token[:, None]], dim=1)
        step_input = token[:, None]
        if eos_id is not None and bool(done.all()):
            break
    new = torch.stack(out, dim=1).tolist() if out else [[] for _ in prompts]
    if eos_id is not None:
        new = [seq[: seq.index(eos_id) + 1] if eos_id in seq else seq for seq in new]
    return new
