"""Causal prefill attention: the C++ kernel (each of its paths) against a float64 reference and torch SDPA, on
GQA and plain heads, head dims 64 and 128, with and without a cached prefix, on strided views as the runner
passes them; chunk and thread-count invariance bit for bit; the fallbacks."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

from model_runner import prefill_attention
from model_runner.prefill_attention import causal_attention, reference_attention

TOLERANCE = {torch.float32: 1e-5, torch.bfloat16: 1e-2}  # of the outputs' magnitude
HAS_COMPILER = shutil.which(os.environ.get("CXX", "c++")) is not None


def make_inputs(tokens: int, start: int = 0, q_heads: int = 9, kv_heads: int = 3, head_dim: int = 64,
                dtype: torch.dtype = torch.float32, seed: int = 0,
                q_scale: float = 1.0) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """q, k, v as the runner passes them: q (Hq, T, D) sliced out of rows that also hold the k heads (strides
    (D, (Hq + Hkv) D, 1)); k, v (Hkv, start + T, D) the first start + T positions of a longer cache."""
    gen = torch.Generator().manual_seed(seed)
    rows = torch.randn(tokens, q_heads + kv_heads, head_dim, generator=gen) * q_scale
    q = rows.to(dtype)[:, :q_heads].transpose(0, 1)
    cache = torch.randn(2, kv_heads, start + tokens + 7, head_dim, generator=gen).to(dtype)
    return q, cache[0, :, : start + tokens], cache[1, :, : start + tokens]


def float64_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float, start: int) -> torch.Tensor:
    """The definition, in float64: query t sees keys 0..start + t; q head h uses kv head h // (Hq // Hkv)."""
    group = q.shape[0] // k.shape[0]
    k64 = k.double().repeat_interleave(group, 0)
    v64 = v.double().repeat_interleave(group, 0)
    scores = q.double() @ k64.transpose(1, 2) * scale  # (Hq, T, start + T)
    tokens = q.shape[1]
    visible = torch.ones(tokens, start + tokens, dtype=torch.bool).tril(start)
    return torch.softmax(scores.masked_fill(~visible, float("-inf")), dim=-1) @ v64


def assert_close(out: torch.Tensor, expected: torch.Tensor, dtype: torch.dtype) -> None:
    scale = max(1.0, expected.abs().max().item())
    torch.testing.assert_close(out.double(), expected.double(), atol=TOLERANCE[dtype] * scale, rtol=0)


@pytest.fixture(scope="module")
def kernel() -> None:
    if not HAS_COMPILER:
        pytest.skip("no C++ compiler: the kernel can't be built here")
    assert prefill_attention.load_kernel(), "the kernel failed to build (see the warning logged above)"


@pytest.fixture(params=["auto", "avx512", "avx2", "portable"])
def path(request: pytest.FixtureRequest, kernel: None, monkeypatch: pytest.MonkeyPatch) -> Iterator[str]:
    """Each of the kernel's paths this CPU can run: auto is the fastest (AVX512-BF16 dot products for
    bfloat16 where the CPU has them), avx512 leaves those out, avx2 is what CPUs without AVX-512 run, portable
    the scalar loops of other CPUs."""
    monkeypatch.setenv("PDSERVE_PREFILL_ATTENTION", request.param)
    if request.param not in ("auto", "portable") and prefill_attention.kernel_path(64, torch.float32) != request.param:
        pytest.skip(f"this CPU has no {request.param} path")
    assert prefill_attention.kernel_path(64, torch.float32) != "torch"  # auto: a vector path on any x86-64 CPU
    yield request.param


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("tokens", [1, 7, 64, 65, 300])
@pytest.mark.parametrize("start", [0, 5, 256])
@pytest.mark.parametrize(("q_heads", "kv_heads", "head_dim"), [(9, 3, 64), (4, 4, 64), (6, 2, 128), (2, 2, 128)])
def test_matches_reference(path: str, dtype: torch.dtype, tokens: int, start: int, q_heads: int, kv_heads: int,
                           head_dim: int) -> None:
    q, k, v = make_inputs(tokens, start, q_heads, kv_heads, head_dim, dtype)
    scale = head_dim**-0.5
    out = causal_attention(q, k, v, scale, start)
    assert out.dtype == dtype and out.shape == q.shape
    assert_close(out, float64_attention(q, k, v, scale, start), dtype)


def assert_no_worse_than_sdpa(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float, start: int) -> None:
    """Within the error torch's own kernel makes (or a little more), against the float64 definition."""
    expected = float64_attention(q, k, v, scale, start)
    ours = (causal_attention(q, k, v, scale, start).double() - expected).abs().max().item()
    theirs = (reference_attention(q, k, v, scale, start).double() - expected).abs().max().item()
    assert ours <= 2 * theirs + 1e-6, (ours, theirs)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_no_worse_than_sdpa(path: str, dtype: torch.dtype) -> None:
    q, k, v = make_inputs(300, 256, dtype=dtype, seed=1)
    assert_no_worse_than_sdpa(q, k, v, 0.125, 256)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_large_scores_stay_finite(path: str, dtype: torch.dtype) -> None:
    """Scores in the hundreds, growing along the prompt: the running max moves many times (float32 itself
    then loses digits: the bound is SDPA's error)."""
    q, k, v = make_inputs(300, 5, dtype=dtype, seed=2, q_scale=30.0)
    k = k * torch.linspace(0.1, 3.0, k.shape[1])[None, :, None].to(dtype)
    assert torch.isfinite(causal_attention(q, k, v, 0.125, 5)).all()
    assert_no_worse_than_sdpa(q, k, v, 0.125, 5)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_chunk_and_thread_invariant(path: str, dtype: torch.dtype) -> None:
    """A prompt attended whole, or in chunks over the cache of the ones before (start > 0), at 1 or 2 threads,
    gives the same bits."""
    tokens = 333
    q, k, v = make_inputs(tokens, dtype=dtype, seed=3)
    whole = causal_attention(q, k, v, 0.125)
    threads = torch.get_num_threads()
    try:
        for n in (1, 2):
            torch.set_num_threads(n)
            assert torch.equal(causal_attention(q, k, v, 0.125), whole)
            for cuts in ([0, 1, 64, 65, 200, tokens], [0, 100, 237, tokens], [0, 320, tokens]):
                for lo, hi in zip(cuts, cuts[1:]):
                    chunk = causal_attention(q[:, lo:hi], k[:, :hi], v[:, :hi], 0.125, lo)
                    assert torch.equal(chunk, whole[:, lo:hi]), (n, lo, hi)
    finally:
        torch.set_num_threads(threads)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_any_strides(path: str, dtype: torch.dtype) -> None:
    """Contiguous inputs, and a last dim that is not contiguous, give what the runner's views give."""
    q, k, v = make_inputs(70, 30, dtype=dtype, seed=4)
    out = causal_attention(q, k, v, 0.125, 30)
    assert torch.equal(causal_attention(q.contiguous(), k.contiguous(), v.contiguous(), 0.125, 30), out)
    k_strided = k.transpose(1, 2).contiguous().transpose(1, 2)  # stride 1 on the position dim
    assert torch.equal(causal_attention(q, k_strided, v, 0.125, 30), out)


def test_output_is_a_view_of_token_major_rows(kernel: None) -> None:
    """(Hq, T, D) whose transpose(0, 1) is contiguous: the runner's reshape to (T, Hq * D) copies nothing."""
    q, k, v = make_inputs(40, dtype=torch.bfloat16, seed=5)
    out = causal_attention(q, k, v, 0.125)
    assert out.transpose(0, 1).is_contiguous()


def test_no_tokens(path: str) -> None:
    q, k, v = make_inputs(0, 5)
    assert causal_attention(q, k, v, 0.125, 5).shape == (9, 0, 64)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_head_dim_without_a_vector_path(path: str, dtype: torch.dtype) -> None:
    """D = 80: SDPA serves, unless the portable loops are asked for."""
    assert prefill_attention.kernel_path(80, dtype) == ("portable" if path == "portable" else "torch")
    q, k, v = make_inputs(50, 3, 4, 2, 80, dtype, seed=6)
    assert_close(causal_attention(q, k, v, 80**-0.5, 3), float64_attention(q, k, v, 80**-0.5, 3), dtype)


def test_bad_shapes_are_refused(kernel: None) -> None:
    q, k, v = make_inputs(10, 4)
    with pytest.raises(RuntimeError, match="start \\+ T"):
        causal_attention(q, k, v, 0.125, 3)
    with pytest.raises(RuntimeError, match="multiple of Hkv"):
        causal_attention(q[:8], k[:3], v[:3], 0.125, 4)
    with pytest.raises(RuntimeError, match="share a dtype"):
        causal_attention(q, k.double(), v, 0.125, 4)


def test_torch_mode_is_sdpa(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("PDSERVE_PREFILL_ATTENTION", "torch")
    q, k, v = make_inputs(30, 6, seed=7)
    assert prefill_attention.kernel_path(64, torch.float32) == "torch"
    assert torch.equal(causal_attention(q, k, v, 0.125, 6), reference_attention(q, k, v, 0.125, 6))
    assert_close(reference_attention(q, k, v, 0.125, 6), float64_attention(q, k, v, 0.125, 6), torch.float32)
    monkeypatch.setenv("PDSERVE_PREFILL_ATTENTION", "fast")
    with pytest.raises(ValueError, match="PDSERVE_PREFILL_ATTENTION"):
        causal_attention(q, k, v, 0.125, 6)


def test_other_dtypes_use_sdpa(kernel: None) -> None:
    q, k, v = make_inputs(30, 6, dtype=torch.float16, seed=8)
    assert prefill_attention.kernel_path(64, torch.float16) == "torch"
    assert torch.equal(causal_attention(q, k, v, 0.125, 6), reference_attention(q, k, v, 0.125, 6))


_CHILD = """
import logging, torch
logging.basicConfig(level=logging.INFO)
from model_runner import prefill_attention
from tests.test_prefill_attention import float64_attention, make_inputs
q, k, v = make_inputs(100, 20)
out = prefill_attention.causal_attention(q, k, v, 0.125, 20)
assert torch.allclose(out.double(), float64_attention(q, k, v, 0.125, 20), atol=1e-5)
print(prefill_attention.kernel_path(64, torch.float32))
"""


def test_no_compiler_falls_back_to_sdpa(tmp_path: Path) -> None:
    """A fresh process that tries to build the kernel (into tmp_path, not the shared cache) with no compiler."""
    env = {**os.environ, "TORCH_EXTENSIONS_DIR": str(tmp_path), "CXX": "/nonexistent/c++"}
    env.pop("PDSERVE_PREFILL_ATTENTION", None)
    child = subprocess.run([sys.executable, "-c", _CHILD], env=env, text=True, capture_output=True, timeout=300,
                           cwd=Path(__file__).parent.parent)
    assert child.returncode == 0, child.stderr
    assert child.stdout.strip() == "torch"
    assert child.stderr.count("prefill attention kernel unavailable") == 1  # warned once
