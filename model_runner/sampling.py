"""Token sampling whose randomness is keyed by (seed, position), never by batch layout or thread timing."""

from __future__ import annotations

from dataclasses import dataclass

import torch

_MIX = 0x9E3779B97F4A7C15  # golden-ratio constant: spreads consecutive positions over the seed space


@dataclass(frozen=True)
class SamplingParams:
    temperature: float = 1.0  # 0 means greedy
    top_p: float = 1.0
    top_k: int = 0  # 0 means no top-k cut
    seed: int = 0

    def __post_init__(self) -> None:
        if self.temperature < 0:
            raise ValueError(f"temperature must be >= 0, got {self.temperature}")
        if not 0 < self.top_p <= 1:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")
        if self.top_k < 0:
            raise ValueError(f"top_k must be >= 0, got {self.top_k}")


def sample(logits: torch.Tensor, params: SamplingParams, position: int) -> int:
    """Pick the token at sequence index `position` from logits (vocab,)."""
    if params.temperature == 0:
        return int(torch.argmax(logits))
    scores = logits.float() / params.temperature
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
