"""Prefix reuse: the KV of token-block prefixes a prefill worker computed before, so a prompt that starts with one
only runs the forward pass over what follows.

A prompt is cut into blocks of `block_tokens`; block i is named by a hash chained from the start of the sequence
(hash of block i-1's name and block i's tokens), so a name stands for the whole prefix up to and including that
block, and equal names mean equal prefixes. A request's cache salt seeds the chain (by default the gateway gives
each API key its own), so a prompt only ever matches blocks cached under its own salt. The cache maps names to
that block's KV (every layer's keys and values for its positions), within a byte budget, evicting the least
recently used block first. A lookup takes the longest run of cached blocks from the start, and always leaves at
least one token to compute: the last position's logits give the first token. Lookups and inserts refresh a
prefix's blocks deepest first, so a block is always more recent than the blocks after it: eviction takes leaves
first, and a shared root outlives the branches that hang from it.

Only a prompt whose prefill completed is inserted (never a cancelled one's partial KV). A block evicted while a
queued prompt still counts on it stays alive through that prompt's reference until its first pass copies it.

Every block lives in one pool of equal slots, made at the first insert and as large as the budget, as vLLM's and
SGLang's prefix caches live in their KV pools: on a CPU a private mapping committed as it is first written
(host_memory), slots handed out from the low end and freed ones reused first, so the pool is resident only up to
the most slots ever held. A block's slot is freed when the block is gone: evicted and no longer held by a queued
prompt. Before the pool, each block was a tensor of its own in the C heap. Evictions then left holes among the
heap's other allocations: under `bench soak` the prefill worker's free heap grew to ~470 MB, and its RSS net of
the cache swung by up to 270 MB as protobuf's periodic malloc_trim released those pages and new blocks touched
them again (docs/benchmarks.md, "soak").
"""

from __future__ import annotations

import collections
import weakref
from collections.abc import Sequence
from dataclasses import dataclass

import torch
from transformers import DynamicCache

from model_runner import host_memory
from model_runner.forward import LayerKV
from protos.types import block_names  # the gateway names blocks the same way to route by prefix


@dataclass(eq=False)
class Block:
    name: bytes
    kv: torch.Tensor  # (layers, 2, kv_heads, block_tokens, head_dim): keys then values of every layer
    slot: int  # kv is the pool's slot `slot`

    @property
    def nbytes(self) -> int:
        return self.kv.numel() * self.kv.element_size()


class PrefixCache:
    """Not thread-safe: the prefill engine calls it under its own lock. (A slot is freed from whichever thread drops
    its block's last reference; that is one list append.)"""

    def __init__(self, block_tokens: int, budget_bytes: int) -> None:
        if block_tokens < 1 or budget_bytes < 0:
            raise ValueError("block_tokens must be >= 1 and budget_bytes >= 0")
        self.block_tokens, self.budget_bytes = block_tokens, budget_bytes
        self._blocks: collections.OrderedDict[bytes, Block] = collections.OrderedDict()  # least recent first
        self.bytes = 0  # of the blocks cached (evicted ones still held by a queued prompt not counted)
        self._pool: torch.Tensor | None = None  # (slots, *a block's kv shape), made at the first insert
        self._free: list[int] = []  # slots written before and free again, reused first
        self._written = 0  # slots 0.._written-1 have been handed out at least once

    def __len__(self) -> int:
        return len(self._blocks)

    @property
    def pool_bytes(self) -> int:
        """The pool as far as it has been written: what it adds to the process's resident memory."""
        return 0 if self._pool is None else self._written * self._pool[0].numel() * self._pool.element_size()

    def match(self, tokens: Sequence[int], salt: str = "") -> list[Block]:
        """The longest run of cached blocks `tokens` starts with under `salt`, leaving at least one token uncached."""
        found = []
        for name in block_names(tokens[: len(tokens) - 1], self.block_tokens, salt):
            block = self._blocks.get(name)
            if block is None:
                break
            found.append(block)
        for block in reversed(found):  # deepest first: the root ends most recent, evicted last
            self._blocks.move_to_end(block.name)
        return found

    def insert(self, tokens: Sequence[int], layers: list[LayerKV], salt: str = "") -> int:
        """Cache the full blocks of a prompt whose prefill completed, under `salt`; `layers` is its KV, (kv_heads,
        tokens, head_dim) per layer. Returns the blocks placed (a cache smaller than the prompt may have evicted some
        of them again, its deepest first)."""
        names = block_names(tokens, self.block_tokens, salt)
        if not names or not self._ready(layers):
            return 0
        placed: list[tuple[int, int, bytes]] = []  # (block index, slot, name) of each block added
        for index in reversed(range(len(names))):  # deepest first, as in match
            name = names[index]
            if name in self._blocks:
                self._blocks.move_to_end(name)
                continue
            slot = self._take_slot()
            if slot is None:  # every slot is held by a queued prompt's evicted blocks
                break
            self._add(name, slot)  # (no reference kept here: evicted by a later take, its slot is free at once)
            placed.append((index, slot, name))
        # Then their KV, one copy per layer's keys and values. A small cache may have evicted some of them again
        # (and handed their slots on): only the blocks still cached are written.
        kept = [(index, slot, name) for index, slot, name in placed
                if (cached := self._blocks.get(name)) is not None and cached.slot == slot]
        if kept:
            assert self._pool is not None
            indices = torch.tensor([index for index, _, _ in kept], device=self._pool.device)
            slots = torch.tensor([slot for _, slot, _ in kept], device=self._pool.device)
            try:
                for layer, pair in enumerate(layers):
                    for which, kv in enumerate(pair):  # (kv_heads, tokens, dim) -> (blocks, kv_heads, block, dim)
                        blocks = kv[:, : len(names) * self.block_tokens].unflatten(1, (len(names), self.block_tokens))
                        self._pool[slots, layer, which] = blocks[:, indices].transpose(0, 1)
            except BaseException:  # (out of memory on a GPU, say): no block stays cached without its KV
                for _, _, name in kept:
                    self.bytes -= self._blocks.pop(name).nbytes
                raise
        return len(placed)

    def _add(self, name: bytes, slot: int) -> None:
        assert self._pool is not None
        block = Block(name, self._pool[slot], slot)
        weakref.finalize(block, self._free.append, slot).atexit = False  # the slot is free once the block is gone
        self._blocks[name] = block  # at the end: the shallower blocks, added after it, end more recent
        self.bytes += block.nbytes

    def _ready(self, layers: list[LayerKV]) -> bool:
        """Make the pool at the first insert, sized by the budget in blocks of this KV's shape; False if the budget
        holds no block."""
        keys = layers[0][0]
        shape = (len(layers), 2, keys.shape[0], self.block_tokens, keys.shape[2])
        if self._pool is None:
            slots = self.budget_bytes // (torch.Size(shape).numel() * keys.element_size())
            if slots == 0:
                return False
            self._pool = host_memory.zeros((slots, *shape), keys.dtype, keys.device)
        if self._pool.shape[1:] != shape or self._pool.dtype != keys.dtype:
            raise ValueError(f"prefix cache: KV of shape {shape} and {keys.dtype} after "
                             f"{tuple(self._pool.shape[1:])} and {self._pool.dtype}")
        return True

    def _take_slot(self) -> int | None:
        """A free slot: one freed before, else one never written, else what evicting the least recent blocks
        frees; None when every slot is held."""
        assert self._pool is not None
        while True:
            if self._free:
                return self._free.pop()
            if self._written < self._pool.shape[0]:
                self._written += 1
                return self._written - 1
            if not self._blocks:
                return None
            self._evict()

    def _evict(self) -> None:
        _, block = self._blocks.popitem(last=False)
        self.bytes -= block.nbytes
        # its slot is freed here unless a queued prompt holds the block


def continuation(blocks: list[Block], cache: DynamicCache) -> None:
    """Fill an empty `cache` with the blocks' KV, so a forward pass continues after them."""
    for layer in range(blocks[0].kv.shape[0]):
        keys = torch.cat([block.kv[layer, 0] for block in blocks], dim=1)[None]
        values = torch.cat([block.kv[layer, 1] for block in blocks], dim=1)[None]
        cache.update(keys, values, layer)
