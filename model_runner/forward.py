"""The two forward passes pdserve runs: a whole prompt (prefill) and one token per sequence (decode)."""

from __future__ import annotations

from collections.abc import Callable

import torch
from transformers import DynamicCache

from model_runner.kv_cache import SlotKVCache, pieces_of
from model_runner.loading import LoadedModel

LayerKV = tuple[torch.Tensor, torch.Tensor]  # keys, values: (kv_heads, tokens, head_dim) each


class _LayerWatchingCache(DynamicCache):
    """A DynamicCache that reports each layer's KV the moment the forward pass has produced it."""

    def __init__(self, on_layer: Callable[[int, torch.Tensor, torch.Tensor], None]) -> None:
        super().__init__()
        self._on_layer = on_layer

    def update(  # type: ignore[override]
        self, key_states: torch.Tensor, value_states: torch.Tensor, layer_idx: int, *args: object, **kwargs: object
    ) -> tuple[torch.Tensor, torch.Tensor]:
        keys, values = super().update(key_states, value_states, layer_idx, *args, **kwargs)
        self._on_layer(layer_idx, keys[0], values[0])
        return keys, values


@torch.inference_mode()
def prefill(
    runner: LoadedModel,
    token_ids: list[int],
    on_layer: Callable[[int, torch.Tensor, torch.Tensor], None] | None = None,
) -> tuple[torch.Tensor, list[LayerKV]]:
    """Run the prompt; returns the last position's logits (vocab,) and every layer's KV.

    `on_layer(layer, keys, values)` is called from inside the forward pass as each layer finishes; it may raise
    to abandon the pass (a cancelled request stops at the next layer boundary).
    """
    input_ids = torch.tensor([token_ids], dtype=torch.long, device=runner.device)
    cache = _LayerWatchingCache(on_layer) if on_layer else DynamicCache()
    out = runner.model(input_ids=input_ids, past_key_values=cache, use_cache=True, logits_to_keep=1)
    return out.logits[0, -1], cached_layers(cache)


@torch.inference_mode()
def prefill_chunk(runner: LoadedModel, token_ids: list[int], cache: DynamicCache) -> torch.Tensor:
    """Continue a prompt's prefill with the next `token_ids`, after the tokens `cache` already holds; returns
    the last position's logits (vocab,). Chunked prefill: a long prompt runs as several bounded passes."""
    start = cache.get_seq_length()
    positions = torch.arange(start, start + len(token_ids), device=runner.device)[None]
    input_ids = torch.tensor([token_ids], dtype=torch.long, device=runner.device)
    out = runner.model(input_ids=input_ids, position_ids=positions, past_key_values=cache, use_cache=True,
                       logits_to_keep=1)
    return out.logits[0, -1]


def cached_layers(cache: DynamicCache) -> list[LayerKV]:
    """A batch-of-one DynamicCache's KV, per layer."""
    return [(layer.keys[0], layer.values[0]) for layer in cache.layers]  # type: ignore[union-attr,index]


@torch.inference_mode()
def decode_step(runner: LoadedModel, cache: SlotKVCache, input_ids: list[int], lengths: list[int]) -> torch.Tensor:
    """One token for each of rows 0..B-1 of `cache`; returns logits (B, vocab)."""
    mask = cache.prepare_step(lengths)
    out = runner.model(
        input_ids=torch.tensor(input_ids, dtype=torch.long, device=runner.device)[:, None],
        position_ids=torch.tensor(lengths, dtype=torch.long, device=runner.device)[:, None],
        attention_mask=mask,
        past_key_values=cache,
        use_cache=True,
    )
    return out.logits[:, -1]


def warm_up(runner: LoadedModel) -> None:
    """One short prefill and decode step, so the first request does not pay for lazy kernel setup (~1 s)."""
    spec = runner.spec
    _, kv = prefill(runner, [0, 0])
    cache = SlotKVCache(spec.num_layers, 1, spec.num_kv_heads, 4, spec.head_dim, runner.model.dtype, runner.device)
    cache.load(0, pieces_of(kv), 2)
    decode_step(runner, cache, [0], [2])
