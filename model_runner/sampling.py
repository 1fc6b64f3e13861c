"""Token sampling whose randomness is keyed by (seed, position), never by batch layout or thread timing.

Greedy rows are picked for a whole batch at once (`best_logits`): on the CPU by the C++ kernel
`model_runner/csrc/greedy.cpp`, one pass over each row, where torch's copy, max and argmax take ~5% of a decode
step. Where the kernel cannot be built, and with PDSERVE_GREEDY=torch, torch picks them; PDSERVE_GREEDY=portable
keeps the kernel but leaves out its AVX-512 loop.
"""

from __future__ import annotations

import torch

from model_runner import kernels
from protos.types import SamplingParams

_MIX = 0x9E3779B97F4A7C15  # golden-ratio constant: spreads consecutive positions over the seed space
# Temperatures below this are greedy, as in vLLM (its _SAMPLING_EPS): there a float32 softmax already gives exactly 0
# to every token more than ~1e-3 behind the best one, and dividing by a denormal overflows to inf.
SAMPLING_EPS = 1e-5

KERNEL = kernels.Kernel("greedy.cpp", "greedy kernel", "torch's argmax", "PDSERVE_GREEDY",
                        modes=("auto", "torch", "avx512", "portable"))


def best_logits(logits: torch.Tensor) -> tuple[list[float], list[int]]:
    """Each row's largest logit of logits (rows, vocab), NaN where the row holds one, and the first index that
    holds it: a greedy row's token where that value is finite. On a GPU in one copy back for the whole batch."""
    mode = KERNEL.serves(logits.device.type, logits.dtype)
    if mode is not None:
        values, indices = torch.ops.pdserve_greedy.best(logits, mode)
        return values.tolist(), indices.tolist()
    rows = logits.float()
    # argmax as float32 is exact below 2^24 tokens; one stacked copy syncs with a GPU once
    best, tokens = torch.stack([rows.amax(-1), rows.argmax(-1).float()]).cpu().tolist()
    return best, [int(token) for token in tokens]


def kernel_path() -> str:
    """Which code picks greedy rows on the CPU now: "avx512", "portable" or "torch"."""
    mode = KERNEL.serves()
    if mode is None:
        return "torch"
    path: str = torch.ops.pdserve_greedy.path_for(mode)
    return path


def sample(logits: torch.Tensor, params: SamplingParams, position: int) -> int:
    """Pick the token at sequence index `position` from logits (vocab,). Raises ValueError when the logits hold NaN
    or +inf, or nothing but -inf: no token can be told from another then."""
    logits = logits.float()
    top = logits.max()  # NaN when any logit is
    if not torch.isfinite(top):
        raise ValueError(f"cannot sample position {position}: its logits are not finite (max {top.item()})")
    if params.temperature < SAMPLING_EPS:
        return int(torch.argmax(logits))
    scores = (logits - top) / params.temperature  # all <= 0: exp cannot overflow, whatever the temperature
    if params.top_k:
        kth = torch.topk(scores, min(params.top_k, scores.numel())).values[-1]
        scores = scores.masked_fill(scores < kth, float("-inf"))
    probs = torch.softmax(scores, dim=-1)
    if params.top_p < 1:
        sorted_probs, order = torch.sort(probs, descending=True)
        # keep the smallest prefix whose mass reaches top_p (the token that crosses it stays)
        drop = torch.cumsum(sorted_probs, dim=-1) - sorted_probs >= params.top_p
        sorted_probs[drop] = 0
        probs = torch.zeros_like(probs).scatter_(0, order, sorted_probs)
    generator = torch.Generator().manual_seed((params.seed * _MIX + position) % (1 << 63))
    return int(torch.multinomial(probs.cpu(), 1, generator=generator))
