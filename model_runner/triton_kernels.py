"""The fast runner's decode kernels on a GPU, in Triton (the CPU has its C++ kernels, model_runner/csrc):
- paged decode attention that reads each sequence's blocks only up to its own length;
- rotary positions on q and k with the store of the new token's keys and values into the paged cache, one launch
  where torch takes a dozen small ones (a decode step of a small model is bound by its launches, not its bytes).

Attention: one program per (sequence, kv head, split of the sequence) walks its part of the block table BLOCK_N
tokens at a time with an online softmax in float32, so it reads each cached key and value once, and all q heads of
the group share those reads; a second kernel merges the splits in order. The group's q heads are padded to 16 rows
so that both products run on the tensor cores (tl.dot needs 16); the padding costs arithmetic, which decode
attention has to spare. A sequence's result depends on its own blocks and the split length alone, never on the
batch around it, and it has a fixed order of reduction.

Imported only where a CUDA device serves: the CPU build of torch ships no Triton. Under TRITON_INTERPRET=1 the
same kernels run on CPU tensors (slowly, and in float32 only), which is how they can be checked without a GPU.
"""

from __future__ import annotations

import functools

import torch
import triton
import triton.language as tl

BLOCK_N = 64  # tokens per iteration: 4 of the cache's 16-token blocks
MIN_SPLIT = 128  # tokens per split at least (two iterations)
MAX_PARTIALS = 4096  # (sequence, split) pairs of a call at most: bounds the partial results' memory


@triton.jit
def _paged_decode_split_kernel(q_ptr, k_ptr, v_ptr, acc_ptr, best_ptr, total_ptr, out_ptr, tables_ptr, lens_ptr,
                               scale, stride_lens, stride_qb, stride_qh, stride_kb, stride_kt, stride_kh, stride_tb,
                               stride_ob, stride_oh, GROUP: tl.constexpr, GROUP_PAD: tl.constexpr,
                               HEAD_DIM: tl.constexpr, D_PAD: tl.constexpr, CACHE_BLOCK: tl.constexpr,
                               BLOCK_N: tl.constexpr, SPLIT: tl.constexpr, SPLITS: tl.constexpr,
                               IEEE: tl.constexpr):
    """One split of one sequence for one kv head: the unnormalised sum of p * v over its tokens, with the max
    score and the sum of p it is relative to, for every q head of the group. With one split (SPLITS == 1) it
    writes the normalised output itself, and no merge runs."""
    seq = tl.program_id(0)
    kv_head = tl.program_id(1)
    split = tl.program_id(2)
    length = tl.load(lens_ptr + seq * stride_lens)
    first = split * SPLIT
    g = tl.arange(0, GROUP_PAD)
    d = tl.arange(0, D_PAD)
    heads = kv_head * GROUP + g
    q_mask = (g < GROUP)[:, None] & (d < HEAD_DIM)[None, :]
    if SPLITS == 1 and length == 0:  # a sequence of length 0 gets zeros
        zeros = tl.zeros([GROUP_PAD, D_PAD], tl.float32).to(out_ptr.dtype.element_ty)
        tl.store(out_ptr + seq * stride_ob + heads[:, None] * stride_oh + d[None, :], zeros, mask=q_mask)
    if first < length:  # splits past the sequence's end write nothing, and the merge reads nothing of them
        q = tl.load(q_ptr + seq * stride_qb + heads[:, None] * stride_qh + d[None, :], mask=q_mask, other=0.0)
        best = tl.full([GROUP_PAD], float("-inf"), tl.float32)
        total = tl.zeros([GROUP_PAD], tl.float32)
        acc = tl.zeros([GROUP_PAD, D_PAD], tl.float32)
        for start in range(first, tl.minimum(first + SPLIT, length), BLOCK_N):
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
        if SPLITS == 1:
            tl.store(out_ptr + seq * stride_ob + heads[:, None] * stride_oh + d[None, :],
                     (acc / total[:, None]).to(out_ptr.dtype.element_ty), mask=q_mask)
        else:
            at = (seq * GROUP * tl.num_programs(1) + heads) * SPLITS + split  # (sequence, q head, split)
            tl.store(acc_ptr + at[:, None] * D_PAD + d[None, :], acc, mask=q_mask)
            tl.store(best_ptr + at, best, mask=g < GROUP)
            tl.store(total_ptr + at, total, mask=g < GROUP)


@triton.jit
def _merge_splits_kernel(acc_ptr, best_ptr, total_ptr, out_ptr, lens_ptr, stride_lens, stride_ob, stride_oh,
                         HEAD_DIM: tl.constexpr, D_PAD: tl.constexpr, SPLIT: tl.constexpr, SPLITS: tl.constexpr,
                         SPLITS_PAD: tl.constexpr):
    """One sequence's q head: its splits' partial results rescaled to the largest max score and summed, in split
    order. A sequence of length 0 gets zeros."""
    seq = tl.program_id(0)
    head = tl.program_id(1)
    length = tl.load(lens_ptr + seq * stride_lens)
    s = tl.arange(0, SPLITS_PAD)
    d = tl.arange(0, D_PAD)
    used = s < tl.cdiv(length, SPLIT)
    at = (seq * tl.num_programs(1) + head) * SPLITS + s
    best = tl.load(best_ptr + at, mask=used, other=float("-inf"))
    weight = tl.where(used, tl.exp(best - tl.max(best, axis=0)), 0.0)
    total = tl.sum(tl.load(total_ptr + at, mask=used, other=0.0) * weight, axis=0)
    acc = tl.load(acc_ptr + at[:, None] * D_PAD + d[None, :], mask=used[:, None], other=0.0)
    out = tl.sum(acc * weight[:, None], axis=0)
    out = tl.where(length > 0, out / total, 0.0)
    tl.store(out_ptr + seq * stride_ob + head * stride_oh + d, out.to(out_ptr.dtype.element_ty), mask=d < HEAD_DIM)


@functools.cache
def _multiprocessors(device: torch.device) -> int:
    if device.type != "cuda":
        return 132  # under TRITON_INTERPRET=1, on CPU tensors: as many as an H100's
    return int(torch.cuda.get_device_properties(device).multi_processor_count)


def paged_decode_attention(q: torch.Tensor, key_cache: torch.Tensor, value_cache: torch.Tensor,
                           block_tables: torch.Tensor, context_lens: torch.Tensor, scale: float) -> torch.Tensor:
    """model_runner/attention.paged_decode_attention's contract: q (B, Hq, D); key_cache/value_cache
    (num_blocks, block_size, Hkv, D) with unit stride in D; block_tables (B, max_blocks) and context_lens (B,),
    int32 or int64, any row strides (a GPU batch's are views of one packed tensor). Returns (B, Hq, D) in q's
    dtype. float32 runs its products in IEEE float32, not TF32.

    Split over the sequence (flash-decoding) where the batch is too small to fill the GPU with one program per
    sequence and kv head: each sequence's tokens are cut into splits of MIN_SPLIT tokens or more that run as
    programs of their own, then merged in order. The split length depends on the batch size, the kv heads and the
    table's width alone, never on the lengths; in CUDA graphs the width is fixed, so a sequence's bits can change
    only with its batch's bucket."""
    batch, hq, head_dim = q.shape
    block_size, hkv = key_cache.shape[1], key_cache.shape[2]
    q = q.contiguous()
    out = torch.empty_like(q)
    d_pad = max(16, triton.next_power_of_2(head_dim))
    tokens = block_tables.shape[1] * block_size
    split = tokens  # one split a sequence where the programs already fill the GPU twice over
    if batch * hkv < 2 * _multiprocessors(q.device):
        split = max(MIN_SPLIT, triton.next_power_of_2(-(-tokens * batch // MAX_PARTIALS)))
    splits = -(-tokens // split)
    acc = best = total = out  # unused with one split
    if splits > 1:
        acc = torch.empty(batch, hq, splits, d_pad, dtype=torch.float32, device=q.device)
        best = torch.empty(batch, hq, splits, dtype=torch.float32, device=q.device)
        total = torch.empty_like(best)
    group = hq // hkv
    _paged_decode_split_kernel[(batch, hkv, splits)](
        q, key_cache, value_cache, acc, best, total, out, block_tables, context_lens, scale, context_lens.stride(0),
        q.stride(0), q.stride(1), key_cache.stride(0), key_cache.stride(1), key_cache.stride(2),
        block_tables.stride(0), out.stride(0), out.stride(1), GROUP=group,
        GROUP_PAD=max(16, triton.next_power_of_2(group)), HEAD_DIM=head_dim, D_PAD=d_pad, CACHE_BLOCK=block_size,
        BLOCK_N=BLOCK_N, SPLIT=split, SPLITS=splits, IEEE=q.dtype == torch.float32, num_warps=4)
    if splits > 1:
        _merge_splits_kernel[(batch, hq)](
            acc, best, total, out, context_lens, context_lens.stride(0), out.stride(0), out.stride(1),
            HEAD_DIM=head_dim, D_PAD=d_pad, SPLIT=split, SPLITS=splits, SPLITS_PAD=triton.next_power_of_2(splits),
            num_warps=1)
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
