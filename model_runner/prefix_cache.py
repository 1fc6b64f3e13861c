"""Prefix reuse: the KV of token-block prefixes a prefill worker computed before, so a prompt that starts with one
only runs the forward pass over what follows.

A prompt is cut into blocks of `block_tokens`; block i is named by a hash chained from the start of the sequence
(hash of block i-1's name and block i's tokens), so a name stands for the whole prefix up to and including that
block, and equal names mean equal prefixes. The cache maps names to that block's KV (every layer's keys and
values for its positions), within a byte budget, evicting the least recently used block first. A lookup takes
the longest run of cached blocks from the start, and always leaves at least one token to compute: the last
position's logits give the first token. Lookups and inserts refresh a prefix's blocks deepest first, so a block
is always more recent than the blocks after it: eviction takes leaves first, and a shared root outlives the
branches that hang from it.

Only a prompt whose prefill completed is inserted (never a cancelled one's partial KV). A block evicted while a
queued prompt still counts on it stays alive through that prompt's reference until its prefill has run.
"""

from __future__ import annotations

import collections
from collections.abc import Sequence
from dataclasses import dataclass

import torch
from transformers import DynamicCache

from model_runner.forward import LayerKV
from protos.types import block_names  # the gateway names blocks the same way to route by prefix


@dataclass(eq=False)
class Block:
    name: bytes
    kv: torch.Tensor  # (layers, 2, kv_heads, block_tokens, head_dim): keys then values of every layer

    @property
    def nbytes(self) -> int:
        return self.kv.numel() * self.kv.element_size()


class PrefixCache:
    """Not thread-safe: the prefill engine calls it under its own lock."""

    def __init__(self, block_tokens: int, budget_bytes: int) -> None:
        if block_tokens < 1 or budget_bytes < 0:
            raise ValueError("block_tokens must be >= 1 and budget_bytes >= 0")
        self.block_tokens, self.budget_bytes = block_tokens, budget_bytes
        self._blocks: collections.OrderedDict[bytes, Block] = collections.OrderedDict()  # least recent first
        self.bytes = 0

    def __len__(self) -> int:
        return len(self._blocks)

    def match(self, tokens: Sequence[int]) -> list[Block]:
        """The longest run of cached blocks `tokens` starts with, leaving at least one token uncached."""
        found = []
        for name in block_names(tokens[: len(tokens) - 1], self.block_tokens):
            block = self._blocks.get(name)
            if block is None:
                break
            found.append(block)
        for block in reversed(found):  # deepest first: the root ends most recent, evicted last
            self._blocks.move_to_end(block.name)
        return found

    def insert(self, tokens: Sequence[int], layers: list[LayerKV]) -> int:
        """Cache the full blocks of a prompt whose prefill completed; `layers` is its KV, (kv_heads, tokens,
        head_dim) per layer. Returns the blocks added."""
        names = block_names(tokens, self.block_tokens)
        added = 0
        for index in reversed(range(len(names))):  # deepest first, as in match
            name = names[index]
            if name in self._blocks:
                self._blocks.move_to_end(name)
                continue
            span = slice(index * self.block_tokens, (index + 1) * self.block_tokens)
            kv = torch.stack([torch.stack((keys[:, span], values[:, span])) for keys, values in layers]).clone()
            block = Block(name, kv)
            if block.nbytes > self.budget_bytes:
                return added
            while self.bytes + block.nbytes > self.budget_bytes:
                self._evict()
            self._blocks[name] = block  # at the end: the shallower blocks, added after it, end more recent
            self.bytes += block.nbytes
            added += 1
        return added

    def _evict(self) -> None:
        _, block = self._blocks.popitem(last=False)
        self.bytes -= block.nbytes


def continuation(blocks: list[Block], cache: DynamicCache) -> None:
    """Fill an empty `cache` with the blocks' KV, so a forward pass continues after them."""
    for layer in range(blocks[0].kv.shape[0]):
        keys = torch.cat([block.kv[layer, 0] for block in blocks], dim=1)[None]
        values = torch.cat([block.kv[layer, 1] for block in blocks], dim=1)[None]
        cache.update(keys, values, layer)
