"""CUDA graphs of the fast runner's decode step: one graph per batch bucket, replayed instead of launching a
step's ~10 kernels per layer one by one from Python (as vLLM and SGLang capture theirs).

A step's inputs are copied into static buffers the graphs were captured over: token ids, and one int64 row per
sequence holding its position, slot, context length and block table (model_runner/paged_cache.py packs a
device batch that way, so that it crosses to the GPU in one copy). A batch is padded up to its bucket with rows of
context length 0 whose keys and values go to the pool's spare slot, which no sequence ever holds; the attention
kernel reads each row only to its own length, so the table width in the graph costs nothing.

Graphs are captured lazily, the first time a bucket is needed, and over one KV pool: a step over another pool
drops them and captures anew (a worker has one pool; a test or a benchmark may make several). Batches above the
largest bucket, or with tables wider than max_model_len needs, run eagerly.
"""

from __future__ import annotations

import gc
from collections.abc import Callable
from typing import Any

import torch

BUCKETS = (1, 2, 4, 8, 16, 24, 32, 48, 64, 96, 128, 160, 192, 256)

# (input_ids (B,), batch, kv) -> logits (B, vocab): the runner's eager step
Step = Callable[[torch.Tensor, Any, torch.Tensor], torch.Tensor]


class DecodeGraphs:
    def __init__(self, step: Step, make_batch: Callable[[torch.Tensor], Any], max_len: int,
                 device: torch.device) -> None:
        """`make_batch(meta)` views a packed (B, 3 + blocks) int64 tensor as the step's DecodeBatch; `max_len`
        is the longest sequence served, which sets the widest block table a graph takes."""
        self.step, self.make_batch = step, make_batch
        self.max_len, self.device = max_len, device
        largest = BUCKETS[-1]
        self.ids = torch.zeros(largest, dtype=torch.long, device=device)
        self.meta = torch.zeros(0, 3, dtype=torch.long, device=device)  # (largest, 3 + max blocks), made by _reset
        self._graphs: dict[int, tuple[torch.cuda.CUDAGraph, torch.Tensor]] = {}
        self._pool: Any = None
        self._kv: torch.Tensor | None = None
        self._pad = torch.zeros(largest, 3, dtype=torch.long, device=device)  # position 0, spare slot, length 0

    def __call__(self, input_ids: torch.Tensor, meta: torch.Tensor, kv: torch.Tensor) -> torch.Tensor:
        """input_ids (B,); meta (B, 3 + width) packed as model_runner/paged_cache.PagedKVCache.decode_batch packs
        it on a GPU; kv the pool (layers, 2, blocks, block_size, Hkv, D). Returns logits (B, vocab)."""
        rows, width = meta.shape[0], meta.shape[1] - 3
        bucket = next((size for size in BUCKETS if size >= rows), 0)
        if kv is not self._kv:
            self._reset(kv)
        if not bucket or 3 + width > self.meta.shape[1]:
            return self.step(input_ids, self.make_batch(meta), kv)
        self.ids[:rows].copy_(input_ids, non_blocking=True)
        self.meta[:rows, : 3 + width].copy_(meta, non_blocking=True)
        if bucket > rows:
            self.meta[rows:bucket, :3].copy_(self._pad[: bucket - rows])
        if bucket not in self._graphs:
            self._graphs[bucket] = self._capture(bucket, kv)
        graph, logits = self._graphs[bucket]
        graph.replay()
        return logits[:rows]

    def _reset(self, kv: torch.Tensor) -> None:
        self._graphs.clear()
        self._pool = None
        self._kv = kv
        blocks = -(-self.max_len // kv.shape[3])
        self.meta = torch.zeros(BUCKETS[-1], 3 + blocks, dtype=torch.long, device=self.device)
        self._pad[:, 1] = kv.shape[2] * kv.shape[3] - 1  # the last slot of the spare (last) block

    def _capture(self, bucket: int, kv: torch.Tensor) -> tuple[torch.cuda.CUDAGraph, torch.Tensor]:
        ids, batch = self.ids[:bucket], self.make_batch(self.meta[:bucket])
        stream = torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):  # warm-up off the capture: lazy initialisation, kernel autotuning
            for _ in range(2):
                self.step(ids, batch, kv)
        torch.cuda.current_stream().wait_stream(stream)
        graph = torch.cuda.CUDAGraph()
        # Thread-local capture: another thread's CUDA work (a prompt pass, a pinned copy of arriving KV) goes on
        # and does not invalidate it. No garbage collection inside it either: a collection could free an old
        # graph on this thread, which a capture does not permit.
        collecting = gc.isenabled()
        gc.disable()
        try:
            with torch.cuda.graph(graph, pool=self._pool, capture_error_mode="thread_local"):
                logits = self.step(ids, batch, kv)
        finally:
            if collecting:
                gc.enable()
        if self._pool is None:
            self._pool = graph.pool()
        return graph, logits
