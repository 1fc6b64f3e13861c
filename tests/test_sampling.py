"""Sampling: every temperature the API accepts picks a token; logits that rank no token are refused, not sampled."""

from __future__ import annotations

import math
from pathlib import Path

import pytest
import torch

from model_runner import sampling
from model_runner.sampling import SAMPLING_EPS, best_logits, sample
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


def _rows(dtype: torch.dtype) -> torch.Tensor:
    """Rows a greedy pick can get wrong: ties (the first index must win, also across the kernel's 16 lanes and
    in the tail past the last full 16), NaN anywhere, +inf, nothing but -inf, lengths that are no multiple of 16."""
    generator = torch.Generator().manual_seed(0)
    n = 49152 + 13  # a vocabulary's worth and a tail
    rows = torch.randn(12, n, generator=generator).to(dtype)
    rows[1, [7, 4000, 4001, n - 3]] = 9.0  # tie: lanes 7 and 0 and 1, and the tail
    rows[2, [n - 5, n - 2]] = 9.0  # tie in the tail alone
    rows[3, 20000] = math.nan
    rows[4, 5], rows[4, 3000] = math.nan, 50.0  # NaN before the best
    rows[5, n - 1] = math.nan  # NaN in the tail
    rows[6, 100] = math.inf
    rows[7] = -math.inf
    rows[8, 0] = 100.0  # the very first element
    rows[9, :-1] = -math.inf  # only the last is finite
    rows[10, 16 * 7 + 3] = rows[10, 16 * 9 + 3] = 8.0  # tie within one lane
    rows[11] = 1.0  # all equal: index 0
    return rows


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("mode", ["auto", "portable", "torch"])
def test_greedy_picks_for_a_batch_are_torch_s_max_and_first_argmax(
    dtype: torch.dtype, mode: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("PDSERVE_GREEDY", mode)
    rows = _rows(dtype)
    values, indices = best_logits(rows)
    want_values, want_indices = rows.float().amax(-1).tolist(), rows.float().argmax(-1).tolist()
    assert indices == want_indices
    assert [math.isnan(v) for v in values] == [math.isnan(v) for v in want_values]
    assert [v for v in values if not math.isnan(v)] == [v for v in want_values if not math.isnan(v)]
    # and each row alone, and a single short row: a row's pick does not depend on its batch
    for row, index in zip(rows, indices):
        assert best_logits(row[None])[1] == [index]
    assert best_logits(rows[:1, :5])[1] == [int(rows[0, :5].float().argmax())]
    if mode != "torch":
        assert sampling.kernel_path() == ("portable" if mode == "portable" or not _has_avx512() else "avx512")


def _has_avx512() -> bool:
    return "avx512f" in Path("/proc/cpuinfo").read_text() if Path("/proc/cpuinfo").exists() else False


def test_greedy_picks_agree_with_sample_on_finite_rows() -> None:
    rows = torch.randn(5, 1000, generator=torch.Generator().manual_seed(1)).bfloat16()
    values, indices = best_logits(rows)
    assert indices == [sample(row, SamplingParams(temperature=0.0), 0) for row in rows]
    assert all(math.isfinite(v) for v in values)


def test_an_unknown_greedy_mode_is_refused(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("PDSERVE_GREEDY", "fast")
    with pytest.raises(ValueError, match="PDSERVE_GREEDY"):
        best_logits(torch.zeros(1, 4))
