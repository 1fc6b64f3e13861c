"""Token sampling whose randomness is keyed by (seed, position), never by batch layout or thread timing."""

from __future__ import annotations

import torch

from protos.types import SamplingParams

_MIX = 0x9E3779B97F4A7C15  # golden-ratio constant: spreads consecutive positions over the seed space
# Temperatures below this are greedy, as in vLLM (its _SAMPLING_EPS): there a float32 softmax already gives exactly 0
# to every token more than ~1e-3 behind the best one, and dividing by a denormal overflows to inf.
SAMPLING_EPS = 1e-5


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
