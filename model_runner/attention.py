"""Decode attention over a paged KV cache: each sequence reads its own blocks, and only up to its own length.

On the CPU a C++ kernel (csrc/paged_attention.cpp) does the work; it is compiled on first use, not on import,
and cached in torch's extension directory. On a CUDA device a Triton kernel does it
(model_runner/triton_kernels.py). Where neither can run, and with PDSERVE_ATTENTION=torch, the pure-torch
reference serves instead. PDSERVE_ATTENTION=avx512 keeps the CPU kernel but leaves out its AVX512-BF16
instructions, =avx2 runs the 8-lane code that CPUs without AVX-512 run, and =portable the scalar loops of other
CPUs.
"""

from __future__ import annotations

import functools
import logging
from collections.abc import Callable
from typing import Any, NamedTuple

import torch

from model_runner import kernels

log = logging.getLogger(__name__)

KERNEL = kernels.Kernel("paged_attention.cpp", "paged attention kernel", "the torch reference", "PDSERVE_ATTENTION")


def paged_decode_attention(q: torch.Tensor, key_cache: torch.Tensor, value_cache: torch.Tensor,
                           block_tables: torch.Tensor, context_lens: torch.Tensor, scale: float) -> torch.Tensor:
    """q: (B, Hq, D); key_cache/value_cache: (num_blocks, block_size, Hkv, D), one layer's cache (a view into a
    bigger contiguous tensor of shape (layers, 2, num_blocks, block_size, Hkv, D); any strides with the last dim
    contiguous serve: LlamaRunner.replay passes a prompt's contiguous (Hkv, T, D) cache as one block of T tokens,
    transposed); block_tables: int32 (B, max_blocks), block ids of each sequence in order (entries past its
    length are padding, arbitrary); context_lens: int32 (B,), tokens each sequence attends to (its current token's
    K/V is already written in the cache). Hq is a multiple of Hkv (GQA: q head h uses kv head h // (Hq // Hkv)).
    Returns (B, Hq, D) in q's dtype. A sequence of length 0 gets zeros."""
    mode = KERNEL.serves(q.device.type, q.dtype)
    if mode is not None:
        return torch.ops.pdserve_attention.paged_decode_attention(
            q, key_cache, value_cache, block_tables, context_lens, scale, mode)
    return reference_decode_attention(q, key_cache, value_cache, block_tables, context_lens, scale)


class DecodeOps(NamedTuple):
    """A decode layer's attention and small ops, resolved once per step: the C++ kernels on the CPU, torch
    elsewhere (same signatures either way)."""

    # (q (B, Hq, D), key_cache, value_cache, block_tables, context_lens, scale) -> (B, Hq, D)
    attend: Callable[..., torch.Tensor]
    # (qkv (B, (Hq + 2 Hkv) D), cos (B, D), sin (B, D) with its first half negated, key_cache, value_cache,
    #  slots (B,) int64, Hq, Hkv) -> q (B, Hq, D) rotated; k rotated and v stored at the slots
    rope_and_store: Callable[..., torch.Tensor]
    rms_norm: Callable[[torch.Tensor, torch.Tensor, float], torch.Tensor]  # (x (R, H), weight (H,), eps)


def decode_ops(device: torch.device, dtype: torch.dtype) -> DecodeOps:
    mode = KERNEL.serves(device.type, dtype)
    if mode is not None:
        ops = torch.ops.pdserve_attention
        return DecodeOps(attend=lambda *args: ops.paged_decode_attention(*args, mode),
                         rope_and_store=ops.rope_and_store, rms_norm=ops.rms_norm)
    gpu = gpu_kernels() if KERNEL.mode() != "torch" and device.type == "cuda" else None
    if gpu is not None:
        return DecodeOps(attend=gpu.paged_decode_attention, rope_and_store=gpu.rope_and_store, rms_norm=_rms_norm)
    return DecodeOps(attend=reference_decode_attention, rope_and_store=reference_rope_and_store, rms_norm=_rms_norm)


def decode_layers_op(device: torch.device, dtype: torch.dtype) -> Callable[..., torch.Tensor] | None:
    """A decode step's layers in one C++ call (`torch.ops.pdserve_attention.decode_layers`, the attention path
    bound) where decode_ops runs the C++ kernels; None elsewhere."""
    mode = KERNEL.serves(device.type, dtype)
    if mode is not None:
        return functools.partial(torch.ops.pdserve_attention.decode_layers, attention_path=mode)
    return None


def store_prompt(kv: torch.Tensor, sources: list[torch.Tensor], blocks: list[int]) -> bool:
    """Copy a prompt's KV into its blocks of the pool kv (layers, 2, num_blocks, block_size, Hkv, D): sources are
    each layer's keys then values, (Hkv, length, D) in kv's dtype. On the CPU by the C++ op
    `torch.ops.pdserve_attention.store_prompt`, block by block (~3x torch's index_copy_ into the slots); False
    where it does not run (another device, no kernel, PDSERVE_ATTENTION=torch): the caller copies with torch."""
    if KERNEL.serves(kv.device.type) is None:
        return False
    torch.ops.pdserve_attention.store_prompt(kv, [s.contiguous() for s in sources],
                                             torch.tensor(blocks, dtype=torch.long))
    return True


def _rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    return torch.rms_norm(x, (x.shape[-1],), weight, eps)


@functools.cache
def gpu_kernels() -> Any:
    """The Triton kernels (model_runner/triton_kernels.py), or None where Triton is missing: the torch references
    serve then, attention one sequence at a time and with a host sync per step, so no CUDA graphs."""
    try:
        from model_runner import triton_kernels
    except ImportError as error:
        log.warning("decode attention on the GPU falls back to the torch reference: %s", error)
        return None
    return triton_kernels


def reference_rope_and_store(qkv: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, key_cache: torch.Tensor,
                             value_cache: torch.Tensor, slots: torch.Tensor, hq: int, hkv: int) -> torch.Tensor:
    """rope_and_store in plain torch (any device)."""
    batch, d = qkv.shape[0], key_cache.shape[-1]
    x = qkv[:, : (hq + hkv) * d].float().view(batch, hq + hkv, d)
    swapped = x.view(batch, hq + hkv, 2, d // 2).flip(2).view(batch, hq + hkv, d)
    rotated = (x * cos.float()[:, None] + swapped * sin.float()[:, None]).to(qkv.dtype)
    key_cache.view(-1, hkv, d).index_copy_(0, slots, rotated[:, hq:])
    value_cache.view(-1, hkv, d).index_copy_(0, slots, qkv[:, (hq + hkv) * d :].view(batch, hkv, d))
    return rotated[:, :hq].contiguous()


def reference_decode_attention(q: torch.Tensor, key_cache: torch.Tensor, value_cache: torch.Tensor,
                               block_tables: torch.Tensor, context_lens: torch.Tensor,
                               scale: float) -> torch.Tensor:
    """paged_decode_attention in plain torch, one sequence at a time, in float32; any device and dtype."""
    batch, hq, d = q.shape
    block_size, hkv = key_cache.shape[1], key_cache.shape[2]
    out = torch.zeros((batch, hq, d), dtype=torch.float32, device=q.device)
    for b, length in enumerate(context_lens.tolist()):
        if length == 0:
            continue
        blocks = block_tables[b, : -(-length // block_size)].long()
        keys = key_cache[blocks].reshape(-1, hkv, d)[:length].float()  # (L, Hkv, D)
        values = value_cache[blocks].reshape(-1, hkv, d)[:length].float()
        queries = q[b].float().reshape(hkv, hq // hkv, d)  # (Hkv, G, D): q head h is group h // G
        scores = torch.einsum("hgd,lhd->hgl", queries, keys) * scale  # (Hkv, G, L)
        probs = torch.softmax(scores, dim=-1)  # subtracts the max
        out[b] = torch.einsum("hgl,lhd->hgd", probs, values).reshape(hq, d)
    return out.to(q.dtype)


def load_kernel() -> bool:
    """Builds (or finds the cached build of) the C++ kernel now rather than on the first call; True if it loaded."""
    return KERNEL.load()


def kernel_available() -> bool:
    """Whether paged_decode_attention runs the C++ kernel for CPU tensors (building it if not built yet)."""
    return KERNEL.serves() is not None


def kernel_path(head_dim: int, dtype: torch.dtype) -> str:
    """Which code serves a CPU call: "avx512_bf16" (bfloat16 dot products), "avx512", "avx2", "portable" or
    "torch"."""
    mode = KERNEL.serves("cpu", dtype)
    if mode is None:
        return "torch"
    path: str = torch.ops.pdserve_attention.path_for(head_dim, dtype == torch.bfloat16, mode)
    return path
