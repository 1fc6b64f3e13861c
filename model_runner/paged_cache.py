"""The decode worker's KV cache: fixed-size blocks of one pool, shared by every sequence (paged, as vLLM and
SGLang keep it).

A sequence holds the blocks its prompt + max_tokens need (its reservation already counted those bytes against
the worker's KV budget, so a join never waits for blocks and nothing is ever preempted). Concurrency is then
bounded by KV memory, not by slots sized for the whole context. Decode attention reads each sequence's blocks
only to its own length (model_runner/attention.py).

Layout: kv (layers, 2 (keys, values), num_blocks, block_size, kv_heads, head_dim). A token's keys for all heads
are contiguous, so a decode step writes each sequence's new token with one indexed copy per layer and kind.
"""

from __future__ import annotations

import torch
from transformers.cache_utils import Cache, CacheLayerMixin

from model_runner import attention, host_memory
from model_runner.llama import DecodeBatch

# A prompt's KV as it arrived, ready to be copied into blocks: for each tensor (index layer * 2, + 1 for the
# values), pieces of its flat (num_kv_heads, num_tokens, head_dim) elements as (index of the first element,
# 1-D tensor). One piece per tensor when the KV is contiguous; several when the pieces are the received messages.
KVPieces = list[list[tuple[int, torch.Tensor]]]

BLOCK_SIZE = 16  # tokens a block holds: vLLM's default; at most 15 tokens a sequence are allocated unused


def pieces_of(layers: list[tuple[torch.Tensor, torch.Tensor]]) -> KVPieces:
    """Per-layer (keys, values) tensors as KVPieces."""
    return [[(0, tensor.reshape(-1))] for keys, values in layers for tensor in (keys, values)]


class OutOfBlocks(Exception):
    """The pool has fewer free blocks than a sequence needs."""


class PagedKVCache:
    def __init__(self, num_layers: int, num_blocks: int, num_kv_heads: int, head_dim: int, dtype: torch.dtype,
                 device: torch.device, block_size: int = BLOCK_SIZE) -> None:
        self.block_size, self.num_kv_heads, self.head_dim = block_size, num_kv_heads, head_dim
        self.dtype, self.device = dtype, device
        # one spare block past the last, never handed out: a CUDA graph's padding rows write their keys there
        # (model_runner/cuda_graphs.py)
        # zeros, not empty: the reference runner's attention reads padded positions under a mask, and a NaN bit
        # pattern left in uninitialised memory survives a zero attention weight (NaN * 0 = NaN)
        self.kv = host_memory.zeros((num_layers, 2, num_blocks + 1, block_size, num_kv_heads, head_dim), dtype,
                                    device)
        # a stack, lowest ids on top: freed blocks are reused first, so the pages in use stay warm and few
        self._free = list(range(num_blocks - 1, -1, -1))

    @property
    def num_blocks(self) -> int:
        return int(self.kv.shape[2]) - 1

    @property
    def free_blocks(self) -> int:
        return len(self._free)

    def blocks_for(self, tokens: int) -> int:
        return -(-tokens // self.block_size)

    def allocate(self, tokens: int) -> list[int]:
        need = self.blocks_for(tokens)
        if need > len(self._free):
            raise OutOfBlocks(f"{tokens} tokens need {need} KV blocks; {len(self._free)} of {self.num_blocks} free")
        return [self._free.pop() for _ in range(need)]

    def free(self, blocks: list[int]) -> None:
        self._free.extend(reversed(blocks))

    def commit(self, nbytes: int) -> None:
        """Write (zeros to) the first blocks now, up to `nbytes`: the CPU pool's pages are committed on first write,
        and a join that lands on fresh pages would pay for the faults inside a decode step."""
        per_block = self.kv[:, :, 0].numel() * self.kv.element_size()
        self.kv[:, :, : min(self.num_blocks, nbytes // per_block)].zero_()

    def slots(self, blocks: list[int], start: int, end: int) -> torch.Tensor:
        """The flat slot (block * block_size + offset) of positions start..end-1 of a sequence."""
        positions = torch.arange(start, end)
        table = torch.tensor(blocks, dtype=torch.long)
        return (table[positions // self.block_size] * self.block_size + positions % self.block_size).to(self.device)

    def load(self, blocks: list[int], kv: KVPieces, length: int) -> None:
        """Copy a `length`-token prompt's KV, (kv_heads, length, head_dim) per layer and kind, into its blocks."""
        numel = self.num_kv_heads * length * self.head_dim
        # (heads, tokens, dim) per layer and kind, onto the pool's device, cast if the wire's dtype differs
        sources = [(pieces[0][1] if len(pieces) == 1 and pieces[0][1].numel() == numel else _joined(pieces, numel))
                   .view(self.num_kv_heads, length, self.head_dim).to(self.device, self.dtype) for pieces in kv]
        if attention.store_prompt(self.kv, sources, blocks):
            return
        slots = self.slots(blocks, 0, length)
        flat = self.kv.view(self.kv.shape[0], 2, -1, self.num_kv_heads, self.head_dim)
        for index, source in enumerate(sources):  # (heads, tokens, dim) -> (tokens, heads, dim) at the slots
            flat[index // 2, index % 2].index_copy_(0, slots, source.transpose(0, 1))

    def read(self, blocks: list[int], length: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """A sequence's first `length` positions, (kv_heads, length, head_dim) keys and values per layer (copies)."""
        flat = self.kv.view(self.kv.shape[0], 2, -1, self.num_kv_heads, self.head_dim)
        slots = self.slots(blocks, 0, length)
        return [(layer[0, slots].transpose(0, 1), layer[1, slots].transpose(0, 1)) for layer in flat]

    def decode_batch(self, tables: list[list[int]], positions: list[int]) -> DecodeBatch:
        """A step's metadata: row i writes its new token at positions[i] of the sequence in blocks tables[i].

        On the CPU, int32 tables and lengths, as the C++ kernels take them. On a GPU, one int64 tensor (B, 3 + width)
        of rows (position, slot, length, table...), made in pinned memory and copied over at once: one transfer
        per step instead of four, and the layout the CUDA graphs' static buffer has (model_runner/cuda_graphs.py)."""
        if self.device.type != "cpu":
            return self._packed_batch(tables, positions)
        width = max(map(len, tables))
        table = torch.zeros(len(tables), width, dtype=torch.int32)
        for row, blocks in enumerate(tables):
            table[row, : len(blocks)] = torch.tensor(blocks, dtype=torch.int32)
        pos = torch.tensor(positions, dtype=torch.long)
        block = table.long().gather(1, (pos // self.block_size)[:, None])[:, 0]
        slots = block * self.block_size + pos % self.block_size
        return DecodeBatch(positions=pos.to(self.device), slots=slots.to(self.device),
                           block_tables=table.to(self.device), context_lens=(pos + 1).to(torch.int32).to(self.device))

    def _packed_batch(self, tables: list[list[int]], positions: list[int]) -> DecodeBatch:
        width = max(map(len, tables))
        rows = [[position, blocks[position // self.block_size] * self.block_size + position % self.block_size,
                 position + 1, *blocks, *[0] * (width - len(blocks))] for blocks, position in zip(tables, positions)]
        meta = torch.tensor(rows, dtype=torch.long).pin_memory()
        return DecodeBatch.packed(meta.to(self.device, non_blocking=True))


def _joined(pieces: list[tuple[int, torch.Tensor]], numel: int) -> torch.Tensor:
    out = torch.empty(numel, dtype=pieces[0][1].dtype)
    for start, piece in pieces:
        out[start : start + piece.numel()].copy_(piece)
    return out


class PagedHFCache(Cache):
    """The paged pool seen through Hugging Face's Cache interface, for the reference runner's decode steps: each
    layer writes the step's new keys and values into their slots, then gathers every row's positions padded to
    the longest (a copy the fast runner never makes; the reference runner is for verification)."""

    def __init__(self, paged: PagedKVCache, batch: DecodeBatch) -> None:
        self.paged, self.batch = paged, batch
        longest = int(batch.context_lens.max())
        positions = torch.arange(longest, device=paged.device)
        table = batch.block_tables.long()
        block = table.gather(1, (positions // paged.block_size)[None].expand(table.shape[0], -1).clamp(
            max=table.shape[1] - 1))
        self.gather = block * paged.block_size + positions % paged.block_size  # (B, longest) slots
        self.visible = positions[None, :] < batch.context_lens[:, None].long()  # (B, longest)
        super().__init__(layers=[_PagedLayer(self, i) for i in range(paged.kv.shape[0])])

    def mask(self) -> torch.Tensor:
        """The additive attention mask (B, 1, 1, longest): 0 where a row may look, the dtype's min elsewhere."""
        mask = torch.zeros(self.visible.shape, dtype=self.paged.dtype, device=self.paged.device)
        return mask.masked_fill_(~self.visible, torch.finfo(self.paged.dtype).min)[:, None, None, :]


class _PagedLayer(CacheLayerMixin):
    is_sliding = False

    def __init__(self, owner: PagedHFCache, index: int) -> None:
        super().__init__()
        self.owner, self.index = owner, index
        self.is_initialized = True

    def lazy_initialization(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        raise AssertionError("paged layers are allocated up front")

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args: object,
               **kwargs: object) -> tuple[torch.Tensor, torch.Tensor]:
        paged, slots = self.owner.paged, self.owner.batch.slots
        assert key_states.shape[2] == 1, "the paged cache serves single-token decode steps"
        out = []
        for kind, states in enumerate((key_states, value_states)):
            flat = paged.kv[self.index, kind].view(-1, paged.num_kv_heads, paged.head_dim)
            flat.index_copy_(0, slots, states[:, :, 0])  # (B, H, D)
            out.append(flat[self.owner.gather].transpose(1, 2))  # (B, H, longest, D)
        return out[0], out[1]

    def get_mask_sizes(self, query_length: int) -> tuple[int, int]:
        return self.owner.gather.shape[1], 0

    def get_seq_length(self) -> int:
        return int(self.owner.gather.shape[1])

    def get_max_length(self) -> int:
        return -1
