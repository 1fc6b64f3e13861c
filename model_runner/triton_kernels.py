"""The fast runner's decode kernels on a GPU, in Triton (the CPU has its C++ kernels, model_runner/csrc):
- paged decode attention that reads each sequence's blocks only up to its own length;
- rotary positions on q and k with the store of the new token's keys and values into the paged cache, one launch
  where torch takes a dozen small ones (a decode step of a small model is bound by its launches, not its bytes).

Attention: one program per (sequence, kv head) walks the sequence's block table BLOCK_N tokens at a time with an
online softmax in float32, so it reads each cached key and value once, and all q heads of the group share those
reads. The group's q heads are padded to 16 rows so that both products run on the tensor cores (tl.dot needs 16);
the padding costs arithmetic, which decode attention has to spare. A sequence's result depends on its own blocks
alone, never on the batch around it, and it has a fixed order of reduction.

Imported only where a CUDA device serves: the CPU build of torch ships no Triton. Under TRITON_INTERPRET=1 the
same kernels run on CPU tensors (slowly, and in float32 only), which is how they can be checked without a GPU.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

BLOCK_N = 64  # tokens per iteration: 4 of the cache's 16-token blocks


@triton.jit
def _paged_decode_kernel(q_ptr, k_ptr, v_ptr, out_ptr, tables_ptr, lens_ptr, scale, stride_lens,
                         stride_qb, stride_qh, stride_kb, stride_kt, stride_kh, stride_tb, stride_ob, stride_oh,
                         GROUP: tl.constexpr, GROUP_PAD: tl.constexpr, HEAD_DIM: tl.constexpr, D_PAD: tl.constexpr,
                         CACHE_BLOCK: tl.constexpr, BLOCK_N: tl.constexpr, IEEE: tl.constexpr):
    seq = tl.program_id(0)
    kv_head = tl.program_id(1)
    length = tl.load(lens_ptr + seq * stride_lens)
    g = tl.arange(0, GROUP_PAD)
    d = tl.arange(0, D_PAD)
    heads = kv_head * GROUP + g
    q_mask = (g < GROUP)[:, None] & (d < HEAD_DIM)[None, :]
    q = tl.load(q_ptr + seq * stride_qb + heads[:, None] * stride_qh + d[None, :], mask=q_mask, other=0.0)
    best = tl.full([GROUP_PAD], float("-inf"), tl.float32)
    total = tl.zeros([GROUP_PAD], tl.float32)
    acc = tl.zeros([GROUP_PAD, D_PAD], tl.float32)
    for start in range(0, length, BLOCK_N):
        t = start + tl.arange(0, BLOCK_N)
        live = t < length
        block = tl.load(tables_ptr + seq * stride_tb + t // CACHE_BLOCK, mask=live, other=0).to(tl.int64)
        rows = block * stride_kb + (t % CACHE_BLOCK) * stride_kt + kv_head * stride_kh
        kv_mask = live[:, None] & (d < HEAD_DIM)[None, :]
        k = tl.load(k_ptr + rows[:, None] + d[None, :], mask=kv_mask, other=0.0)  # (BLOCK_N, D_PAD)
        if IEEE:
            scores = tl.dot(q, tl.trans(k), input_precision="ieee")
        else:
            scores = tl.dot(q, tl.trans(k))
        scores = tl.where(live[None, :], scores * scale, float("-inf"))  # (GROUP_PAD, BLOCK_N)
        new_best = tl.maximum(best, tl.max(scores, axis=1))
        rescale = tl.exp(best - new_best)
        p = tl.exp(scores - new_best[:, None])
        total = total * rescale + tl.sum(p, axis=1)
        v = tl.load(v_ptr + rows[:, None] + d[None, :], mask=kv_mask, other=0.0)
        if IEEE:
            acc = acc * rescale[:, None] + tl.dot(p, v, input_precision="ieee")
        else:
            acc = acc * rescale[:, None] + tl.dot(p.to(v.dtype), v)
        best = new_best
    out = tl.where(total[:, None] > 0, acc / total[:, None], 0.0)  # a sequence of length 0 gets zeros
    tl.store(out_ptr + seq * stride_ob + heads[:, None] * stride_oh + d[None, :],
             out.to(out_ptr.dtype.element_ty), mask=q_mask)


def paged_decode_attention(q: torch.Tensor, key_cache: torch.Tensor, value_cache: torch.Tensor,
                           block_tables: torch.Tensor, context_lens: torch.Tensor, scale: float) -> torch.Tensor:
    """model_runner/attention.paged_decode_attention's contract: q (B, Hq, D); key_cache/value_cache
    (num_blocks, block_size, Hkv, D) with unit stride in D; block_tables (B, max_blocks) and context_lens (B,),
    int32 or int64, any row strides (a GPU batch's are views of one packed tensor). Returns (B, Hq, D) in q's
    dtype. float32 runs its products in IEEE float32, not TF32."""
    batch, hq, head_dim = q.shape
    block_size, hkv = key_cache.shape[1], key_cache.shape[2]
    q = q.contiguous()
    out = torch.empty_like(q)
    group = hq // hkv
    _paged_decode_kernel[(batch, hkv)](
        q, key_cache, value_cache, out, block_tables, context_lens, scale, context_lens.stride(0),
        q.stride(0), q.stride(1), key_cache.stride(0), key_cache.stride(1), key_cache.stride(2),
        block_tables.stride(0), out.stride(0), out.stride(1),
        GROUP=group, GROUP_PAD=max(16, triton.next_power_of_2(group)), HEAD_DIM=head_dim,
        D_PAD=max(16, triton.next_power_of_2(head_dim)), CACHE_BLOCK=block_size, BLOCK_N=BLOCK_N,
        IEEE=q.dtype == torch.float32, num_warps=4)
    return out


@triton.jit
def _rope_and_store_kernel(qkv_ptr, cos_ptr, sin_ptr, q_out_ptr, k_ptr, v_ptr, slots_ptr,
                           stride_qkv, stride_cos, stride_slots, stride_qb, stride_qh, stride_slot, stride_kh,
                           HQ: tl.constexpr, HKV: tl.constexpr, HEAD_DIM: tl.constexpr, D_PAD: tl.constexpr):
    row = tl.program_id(0)
    head = tl.program_id(1)  # q heads, then k heads (each with its v head)
    d = tl.arange(0, D_PAD)
    live = d < HEAD_DIM
    at = qkv_ptr + row * stride_qkv + head * HEAD_DIM
    x = tl.load(at + d, mask=live, other=0.0).to(tl.float32)
    # rotate_half(x) = cat(-x2, x1): the halves swapped, with the sign in sin (its first half negated)
    swapped = tl.load(at + (d + HEAD_DIM // 2) % HEAD_DIM, mask=live, other=0.0).to(tl.float32)
    cos = tl.load(cos_ptr + row * stride_cos + d, mask=live, other=0.0).to(tl.float32)
    sin = tl.load(sin_ptr + row * stride_cos + d, mask=live, other=0.0).to(tl.float32)
    rotated = (x * cos + swapped * sin).to(q_out_ptr.dtype.element_ty)
    if head < HQ:
        tl.store(q_out_ptr + row * stride_qb + head * stride_qh + d, rotated, mask=live)
    else:
        slot = tl.load(slots_ptr + row * stride_slots).to(tl.int64)
        kv_head = head - HQ
        tl.store(k_ptr + slot * stride_slot + kv_head * stride_kh + d, rotated, mask=live)
        v = tl.load(qkv_ptr + row * stride_qkv + (HQ + HKV + kv_head) * HEAD_DIM + d, mask=live)
        tl.store(v_ptr + slot * stride_slot + kv_head * stride_kh + d, v, mask=live)


def rope_and_store(qkv: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, key_cache: torch.Tensor,
                   value_cache: torch.Tensor, slots: torch.Tensor, hq: int, hkv: int) -> torch.Tensor:
    """model_runner/attention.DecodeOps.rope_and_store's contract: qkv (B, (Hq + 2 Hkv) D) with unit stride in
    its last dim; cos/sin (B, D), sin's first half negated; slots (B,) int64, any stride. Returns the rotated q
    (B, Hq, D); the rotated k and the v go to their slots of key_cache/value_cache (num_blocks, block_size, Hkv,
    D). The rotation runs in float32, rounded once, as the torch reference does it."""
    batch, head_dim = qkv.shape[0], key_cache.shape[-1]
    q = torch.empty(batch, hq, head_dim, dtype=qkv.dtype, device=qkv.device)
    cos, sin = cos.contiguous(), sin.contiguous()
    _rope_and_store_kernel[(batch, hq + hkv)](
        qkv, cos, sin, q, key_cache, value_cache, slots,
        qkv.stride(0), cos.stride(0), slots.stride(0), q.stride(0), q.stride(1), key_cache.stride(1),
        key_cache.stride(2), HQ=hq, HKV=hkv, HEAD_DIM=head_dim, D_PAD=triton.next_power_of_2(head_dim), num_warps=1)
    return q
