"""The key/value cache of generation: every layer's keys and values of the positions seen so far, so each new
token costs one position's forward instead of the whole prefix's. Training never builds one."""

from __future__ import annotations

import torch

from hlat.models.config import ModelConfig


class KVCache:
    """Keys and values [layers, batch, kv_heads, max_len, head_dim], preallocated; `length` positions are filled.

    A forward with a cache takes the next `n` tokens of every sequence in the batch (all sequences are at the
    same position): each layer stores its new keys and values and attends to all `length + n` of them."""

    def __init__(self, cfg: ModelConfig, batch: int, max_len: int, device: torch.device | str, dtype: torch.dtype):
        if max_len > cfg.max_seq_len:
            raise ValueError(f"a cache of {max_len} positions exceeds model.max_seq_len {cfg.max_seq_len}")
        shape = (cfg.n_layers, batch, cfg.kv_heads, max_len, cfg.head_dim)
        self.keys = torch.zeros(shape, device=device, dtype=dtype)
        self.values = torch.zeros(shape, device=device, dtype=dtype)
        self.length = 0

    @property
    def max_len(self) -> int:
        return self.keys.shape[3]

    def positions_and_mask(self, n: int) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Rotary positions [batch, n] of the next n tokens and the attention mask [n, length + n] (True: may
        attend); None while the cache is empty, where plain causal attention is the same."""
        if self.length + n > self.max_len:
            raise ValueError(f"{self.length} cached + {n} new positions exceed the cache's {self.max_len}")
        device = self.keys.device
        new = torch.arange(self.length, self.length + n, device=device)
        positions = new.expand(self.keys.shape[1], n)
        if self.length == 0:
            return positions, None
        return positions, torch.arange(self.length + n, device=device) <= new[:, None]

    def layer(self, index: int) -> LayerCache:
        return LayerCache(self, index)

    def advance(self, n: int) -> None:
        self.length += n


class LayerCache:
    """One layer's view of the cache."""

    def __init__(self, cache: KVCache, index: int):
        self.cache, self.index = cache, index

    def store(self, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Write the new keys and values [batch, kv_heads, n, head_dim]; return all of them so far."""
        c = self.cache
        end = c.length + k.shape[2]
        c.keys[self.index, :, :, c.length : end] = k
        c.values[self.index, :, :, c.length : end] = v
        return c.keys[self.index, :, :, :end], c.values[self.index, :, :, :end]
