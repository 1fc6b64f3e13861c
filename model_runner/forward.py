"""The two forward passes pdserve runs: a whole prompt (prefill) and one token per sequence (decode)."""

from __future__ import annotations

import functools
import logging
from collections.abc import Callable

import torch
from transformers import DynamicCache
from transformers.cache_utils import DynamicLayer

from model_runner.loading import LoadedModel
from model_runner.paged_cache import PagedKVCache, pieces_of
from model_runner.sampling import best_logits

log = logging.getLogger(__name__)

LayerKV = tuple[torch.Tensor, torch.Tensor]  # keys, values: (kv_heads, tokens, head_dim) each


class WatchedCache(DynamicCache):
    """A DynamicCache that reports each layer's KV the moment the forward pass has produced it.

    `on_layer(layer, keys, values)` gets the layer's whole cached KV, (batch, kv_heads, tokens, head_dim) each;
    it may raise to abandon the pass at that layer boundary. None: report nothing.
    `homes`: one prompt's KV is written straight into these tensors, (kv_heads, prompt tokens, head_dim) for each
    layer's keys and values (a shared-memory segment a decode worker lent, say), instead of memory of its own.
    """

    def __init__(self, on_layer: Callable[[int, torch.Tensor, torch.Tensor], None] | None = None,
                 homes: list[LayerKV] | None = None) -> None:
        super().__init__()
        self.on_layer = on_layer
        if homes is not None:
            self.layers = [_PlacedLayer(keys[None], values[None]) for keys, values in homes]

    def update(  # type: ignore[override]
        self, key_states: torch.Tensor, value_states: torch.Tensor, layer_idx: int, *args: object, **kwargs: object
    ) -> tuple[torch.Tensor, torch.Tensor]:
        keys, values = super().update(key_states, value_states, layer_idx, *args, **kwargs)
        if self.on_layer is not None:
            self.on_layer(layer_idx, keys, values)
        return keys, values


class FedCache(WatchedCache):
    """A WatchedCache whose first `prefix` positions are another worker's (split prefill): each layer's KV of
    them comes from `fetch(layer)`, called as the forward pass reaches that layer (it may wait, and may raise to
    abandon the pass), so the pass over the later positions starts before the prefix's later layers exist."""

    def __init__(self, prefix: int, fetch: Callable[[int], LayerKV],
                 on_layer: Callable[[int, torch.Tensor, torch.Tensor], None] | None = None) -> None:
        super().__init__(on_layer)
        self.prefix, self._fetch = prefix, fetch

    def get_seq_length(self, layer_idx: int = 0) -> int:
        return super().get_seq_length(layer_idx) or self.prefix  # the pass starts after the prefix

    def update(  # type: ignore[override]
        self, key_states: torch.Tensor, value_states: torch.Tensor, layer_idx: int, *args: object, **kwargs: object
    ) -> tuple[torch.Tensor, torch.Tensor]:
        if DynamicCache.get_seq_length(self, layer_idx) == 0:
            keys, values = self._fetch(layer_idx)  # (kv_heads, prefix, head_dim) each
            DynamicCache.update(self, keys.to(key_states.dtype)[None], values.to(value_states.dtype)[None],
                                layer_idx)
        return super().update(key_states, value_states, layer_idx, *args, **kwargs)


class _PlacedLayer(DynamicLayer):
    """A DynamicLayer over given tensors (1, kv_heads, max tokens, head_dim): each update copies the new positions
    into place, where a DynamicLayer would concatenate them with the old ones into new memory; keys and values are
    views of the positions filled so far."""

    def __init__(self, keys_home: torch.Tensor, values_home: torch.Tensor) -> None:
        super().__init__()
        self._homes = keys_home, values_home

    def update(  # type: ignore[override]
        self, key_states: torch.Tensor, value_states: torch.Tensor, *args: object, **kwargs: object
    ) -> tuple[torch.Tensor, torch.Tensor]:
        if not self.is_initialized:
            self.lazy_initialization(key_states, value_states)
        keys_home, values_home = self._homes
        start = self.get_seq_length()
        end = start + key_states.shape[-2]
        if key_states.shape[0] != 1 or end > keys_home.shape[-2]:
            raise ValueError(f"KV of {key_states.shape[0]} row(s) at positions {start}..{end} does not fit its "
                             f"home, 1 row of {keys_home.shape[-2]} positions")
        keys_home[:, :, start:end].copy_(key_states)
        values_home[:, :, start:end].copy_(value_states)
        self.keys, self.values = keys_home[:, :, :end], values_home[:, :, :end]
        return self.keys, self.values


@torch.inference_mode()
def prefill_pass(runner: LoadedModel, prompts: list[list[int]], cache: DynamicCache) -> torch.Tensor:
    """One forward pass over `prompts`; returns each one's last-position logits (B, vocab).

    Several prompts run as one right-padded batch: causal attention keeps every real position from seeing the
    padding after it, so row b's first len(prompts[b]) cached positions are exactly its KV. One prompt may
    continue after the tokens `cache` already holds (chunked prefill: a long prompt as several bounded passes).
    """
    start = cache.get_seq_length()
    if start and len(prompts) > 1:
        raise ValueError("only a batch of one prompt can continue a cache")
    longest = max(map(len, prompts))
    input_ids = torch.zeros(len(prompts), longest, dtype=torch.long)
    for row, prompt in enumerate(prompts):
        input_ids[row, : len(prompt)] = torch.tensor(prompt)
    return runner.runner.prefill(input_ids.to(runner.device), list(map(len, prompts)), start, cache)


@torch.inference_mode()
def replay_pass(runner: LoadedModel, token_ids: list[int], cache: DynamicCache) -> torch.Tensor:
    """Tokens that decode steps generated (a migrated stream's), continuing the sequence `cache` holds; returns
    the last position's logits (vocab,). Where the fast runner replays, each row gets the bits the decode step
    that first read it computed (LlamaRunner.replay), so the continuation picks what an uninterrupted run would;
    elsewhere they run as a prompt's next chunk."""
    if runner.runner.replays:
        ids = torch.tensor(token_ids, dtype=torch.long, device=runner.device)
        return runner.runner.replay(ids, cache.get_seq_length(), cache)[0]
    _warn_no_replay(runner.runner_name, runner.device.type)
    return prefill_pass(runner, [token_ids], cache)[0]


@functools.cache
def _warn_no_replay(runner: str, device: str) -> None:
    log.warning("the %s runner on %s cannot replay decoded tokens: a migrated stream's sent tokens are prefilled "
                "again, which rounds differently from the decode steps that made them", runner, device)


def prefill(
    runner: LoadedModel,
    token_ids: list[int],
    on_layer: Callable[[int, torch.Tensor, torch.Tensor], None] | None = None,
) -> tuple[torch.Tensor, list[LayerKV]]:
    """Run one whole prompt; returns its last position's logits (vocab,) and every layer's KV.

    `on_layer(layer, keys, values)` is called from inside the forward pass as each layer finishes, with
    (kv_heads, tokens, head_dim) tensors; it may raise to abandon the pass.
    """
    hook = None if on_layer is None else lambda layer, keys, values: on_layer(layer, keys[0], values[0])
    cache = WatchedCache(hook)
    logits = prefill_pass(runner, [token_ids], cache)
    return logits[0], cached_layers(cache)


def cached_layers(cache: DynamicCache, row: int = 0, tokens: int | None = None) -> list[LayerKV]:
    """Row `row`'s KV per layer, its first `tokens` positions (all by default): a batched pass's rows are padded."""
    return [(layer.keys[row, :, :tokens], layer.values[row, :, :tokens])  # type: ignore[union-attr,index]
            for layer in cache.layers]


@torch.inference_mode()
def decode_step(runner: LoadedModel, cache: PagedKVCache, input_ids: list[int], tables: list[list[int]],
                positions: list[int]) -> torch.Tensor:
    """One token for each sequence: row i's blocks are tables[i] and its new token goes at positions[i] (the
    tokens it holds so far). Returns logits (B, vocab)."""
    batch = cache.decode_batch(tables, positions)
    return runner.runner.step(torch.tensor(input_ids, dtype=torch.long, device=runner.device), batch, cache)


def warm_up(runner: LoadedModel) -> None:
    """One short prefill, a decode step and its greedy pick, so the first request does not pay for lazy kernel setup
    (~1 s; a kernel's first build on a machine, several seconds each)."""
    spec = runner.spec
    _, kv = prefill(runner, [0, 0])
    cache = PagedKVCache(spec.num_layers, 1, spec.num_kv_heads, spec.head_dim, runner.dtype, runner.device)
    blocks = cache.allocate(3)
    cache.load(blocks, pieces_of(kv), 2)
    best_logits(decode_step(runner, cache, [0], [blocks], [2]))
