"""Sampling: every temperature the API accepts picks a token; logits that rank no token are refused, not sampled."""

from __future__ import annotations

import math

import pytest
import torch

from model_runner.sampling import SAMPLING_EPS, sample
from protos.types import SamplingParams

LOGITS = torch.tensor([1.0, 3.0, 2.5, -1.0, -math.inf])  # token 1 is the best


@pytest.mark.parametrize("temperature", [0.0, 5e-324, 1e-45, 1e-40, 1e-30, 1e-6, SAMPLING_EPS / 2])
def test_a_temperature_below_the_epsilon_is_greedy(temperature: float) -> None:
    """1e-40 is a float32 denormal (the gateway's field is a float), 5e-324 a float64 one: logits divided by either
    were inf, their softmax NaN, and multinomial raised."""
    for position in range(20):
        assert sample(LOGITS, SamplingParams(temperature=temperature, seed=position), position) == 1


@pytest.mark.parametrize("temperature", [SAMPLING_EPS, 1e-4, 2.0])
def test_huge_logits_at_any_temperature_sample_a_finite_distribution(temperature: float) -> None:
    logits = torch.tensor([0.0, 1e36, -1e36, 1e36 - 1e30])  # 1e36 / 1e-5 overflows float32 unless the max goes first
    picks = {sample(logits, SamplingParams(temperature=temperature, seed=3), position) for position in range(20)}
    assert picks == {1}  # token 3 is ~1e30 behind: probability 0, even at temperature 2


def test_just_above_the_epsilon_a_tie_is_still_sampled() -> None:
    logits = torch.tensor([5.0, 5.0, -2.0])
    picks = {sample(logits, SamplingParams(temperature=1e-4, seed=11), position) for position in range(40)}
    assert picks == {0, 1}


@pytest.mark.parametrize("bad", [math.nan, math.inf])
@pytest.mark.parametrize("temperature", [0.0, 0.8])
def test_logits_with_nan_or_inf_are_refused_with_the_position(bad: float, temperature: float) -> None:
    logits = torch.tensor([1.0, bad, 0.5])
    with pytest.raises(ValueError, match="position 9: its logits are not finite"):
        sample(logits, SamplingParams(temperature=temperature), 9)
    with pytest.raises(ValueError, match="not finite"):
        sample(torch.full((4,), -math.inf), SamplingParams(temperature=temperature), 9)  # every token masked


def test_a_nan_temperature_is_refused() -> None:
    with pytest.raises(ValueError, match="temperature"):
        SamplingParams(temperature=math.nan)
