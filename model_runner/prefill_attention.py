"""Causal attention over a prompt (prefill), with grouped-query heads and an optional cached prefix.

On x86-64 CPUs with AVX-512, or with AVX2 and FMA, a C++ kernel (csrc/prefill_attention.cpp) does the work for
float32 and bfloat16 with head dims that are multiples of 64; it is compiled on first use, not on import, and
cached in torch's extension directory. Elsewhere (other CPUs, head dims, devices and dtypes, no compiler) and
with PDSERVE_PREFILL_ATTENTION=torch, torch's scaled_dot_product_attention serves instead.
PDSERVE_PREFILL_ATTENTION=avx512 keeps the kernel but leaves out its AVX512-BF16 instructions, =avx2 runs its
8-lane float32 path, and =portable runs its scalar loops (any CPU, any head dim; for tests: many times slower
than SDPA).

The kernel's output row t is a function of q_t and keys 0..start+t alone (its key tiles sit at fixed absolute
positions), so a prompt attended whole or in chunks (start > 0) gives the same bits.
"""

from __future__ import annotations

import functools

import torch
import torch.nn.functional as F

from model_runner import kernels

# No FMA contraction: a row's arithmetic must not depend on which inlined copy of the code computed it.
KERNEL = kernels.Kernel("prefill_attention.cpp", "prefill attention kernel", "torch SDPA",
                        "PDSERVE_PREFILL_ATTENTION", cflags=("-ffp-contract=off",))


def causal_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float,
                     start: int = 0) -> torch.Tensor:
    """q (Hq, T, D); k, v (Hkv, start + T, D), views with any strides. Hq is a multiple of Hkv (GQA: q head h
    uses kv head h // (Hq // Hkv)). Query t sits at position start + t and attends keys 0..start + t. Returns
    (Hq, T, D) in q's dtype; from the kernel that is a transposed view of a contiguous (T, Hq, D) tensor, so
    `out.transpose(0, 1).reshape(T, Hq * D)` copies nothing."""
    mode = KERNEL.mode()
    if q.device.type == "cpu" and scale > 0 and kernel_path(q.shape[-1], q.dtype) != "torch":
        out: torch.Tensor = torch.ops.pdserve_prefill.causal_attention(q, k, v, scale, start, mode)
        return out
    return reference_attention(q, k, v, scale, start)


def reference_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float,
                        start: int = 0) -> torch.Tensor:
    """causal_attention by torch's scaled_dot_product_attention; any device and dtype."""
    tokens = q.shape[1]
    mask = None
    if start:  # bottom-right causal: query t sees keys 0..start + t
        mask = torch.ones(tokens, start + tokens, dtype=torch.bool, device=q.device).tril(start)
    out = F.scaled_dot_product_attention(q[None], k[None], v[None], attn_mask=mask, is_causal=mask is None,
                                         scale=scale, enable_gqa=True)
    return out[0]


def load_kernel() -> bool:
    """Builds (or finds the cached build of) the C++ kernel now rather than on the first call; True if it loaded."""
    return KERNEL.load()


def kernel_path(head_dim: int, dtype: torch.dtype) -> str:
    """Which code serves a CPU call: "avx512_bf16" (bfloat16 dot products), "avx512", "avx2" (float32 8-lane
    vectors), "portable" (only when asked for: scalar loops, far slower than SDPA) or "torch"."""
    mode = KERNEL.serves("cpu", dtype)
    if mode is None:
        return "torch"
    return _path_for(head_dim, dtype == torch.bfloat16, mode)


@functools.cache
def _path_for(head_dim: int, bf16: bool, mode: str) -> str:
    path: str = torch.ops.pdserve_prefill.path_for(head_dim, bf16, mode)
    # Where this CPU or head dim has no vector path, SDPA (vectorised for any x86 CPU) beats the scalar loops
    return "torch" if path == "portable" and mode != "portable" else path

