"""Decode GEMMs (model_runner/gemm.py): each of the kernel's paths against F.linear in float64, with bias and every
post-op, at row counts in and past one tile, N not a multiple of the block and K not a multiple of anything;
batch invariance bit for bit; the packed layout; the fallbacks."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from model_runner import gemm
from model_runner.gemm import PackedWeight, linear, pack, reference_linear, unpack

ROWS = [1, 2, 3, 7, 8, 13, 16, 17, 33]
SHAPES = [(100, 40), (100, 1536), (576, 576), (33, 7)]  # (N, K): N=100 and 33 end in a partial block, K=7 is odd
POSTS = ["none", "silu", "mul", "add"]
HAS_COMPILER = shutil.which(os.environ.get("CXX", "c++")) is not None


@pytest.fixture(scope="module")
def kernel() -> None:
    if not HAS_COMPILER:
        pytest.skip("no C++ compiler: the kernel can't be built here")
    assert gemm.load_kernel(), "the kernel failed to build (see the warning logged above)"


@pytest.fixture(params=["auto", "avx512", "avx2", "portable"])
def path(request: pytest.FixtureRequest, kernel: None, monkeypatch: pytest.MonkeyPatch) -> Iterator[str]:
    """Each of the kernel's paths this CPU can run (weights packed under the fixture take it): auto is the
    fastest (AVX512-BF16 dot products for bfloat16 where the CPU has them), avx512 leaves those out, avx2 is
    what CPUs without AVX-512 run, portable the scalar loops of other CPUs."""
    monkeypatch.setenv("PDSERVE_GEMM", request.param)
    if request.param in ("avx512", "avx2") and gemm.kernel_path(torch.float32) != request.param:
        pytest.skip(f"this CPU has no {request.param} path")
    yield request.param


def make(n: int, k: int, m: int, dtype: torch.dtype, seed: int = 0) -> tuple[torch.Tensor, ...]:
    """weight (n, k), x (m, k), bias (n,), other (m, n) in dtype, at the scale of a model's activations"""
    gen = torch.Generator().manual_seed(seed)
    weight = torch.randn(n, k, generator=gen) * k**-0.5
    x = torch.randn(m, k, generator=gen)
    bias = torch.randn(n, generator=gen) * 0.1
    other = torch.randn(m, n, generator=gen)
    return tuple(t.to(dtype) for t in (weight, x, bias, other))


def expected(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, post: str,
             other: torch.Tensor) -> torch.Tensor:
    """The exact answer (float64) for the given (already rounded) inputs."""
    y = F.linear(x.double(), weight.double(), None if bias is None else bias.double())
    if post == "silu":
        return F.silu(y)
    if post == "mul":
        return y * other.double()
    if post == "add":
        return y + other.double()
    return y


def cancelling(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """other (float32) for post="add" that cancels x @ W.T to its rounding error: the output is then the float32
    sum's error itself, so a bfloat16 output shows every bit in which two sums differ."""
    return -F.linear(x.double(), weight.double()).float()


def assert_close_to(out: torch.Tensor, exact: torch.Tensor) -> None:
    """float32: within 1e-4 of the output's scale. bfloat16: the float32 answer rounded once can be off by one
    unit in the last place from the exact one rounded, so within 2 ulps, or within float32 error of zero."""
    scale = exact.abs().max().item()
    if out.dtype == torch.float32:
        torch.testing.assert_close(out.double(), exact, rtol=1e-4, atol=1e-5 * scale)
        return
    rounded = exact.to(torch.bfloat16).double()
    ulp = torch.exp2(torch.floor(torch.log2(rounded.abs().clamp_min(1e-30))) - 7)  # bfloat16: 8 significant bits
    err = (out.double() - rounded).abs()
    assert bool((err <= torch.maximum(2 * ulp, torch.full_like(ulp, 1e-5 * scale))).all()), (
        f"max {(err / ulp).max().item():.1f} ulps")


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("post", POSTS)
@pytest.mark.parametrize(("n", "k"), SHAPES)
def test_matches_float64(path: str, dtype: torch.dtype, post: str, n: int, k: int) -> None:
    weight, x, bias, other = make(n, k, max(ROWS), dtype)
    w = pack(weight)
    assert w.blocked and (path != "portable" or gemm.kernel_path(dtype) == "portable")
    for m in ROWS:
        for b in (None, bias):
            out = linear(x[:m], w, b, post=post, other=other[:m])
            assert out.dtype == dtype and out.shape == (m, n)
            assert_close_to(out, expected(x[:m], weight, b, post, other[:m]))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize(("n", "k"), [(100, 1536), (576, 576), (33, 7)])
def test_batch_invariant(path: str, dtype: torch.dtype, n: int, k: int) -> None:
    """A row's output is the same bits alone, in any batch (within a tile or past it), at any position, at any
    thread count."""
    weight, x, bias, other = make(n, k, 40, dtype, seed=1)
    w = pack(weight)
    threads = torch.get_num_threads()
    try:
        for post, b, o in [("none", bias, other), ("silu", bias, other), ("mul", bias, other),
                           ("add", None, cancelling(x, weight))]:
            alone = torch.cat([linear(x[i : i + 1], w, b, post=post, other=o[i : i + 1]) for i in range(40)])
            for t in (1, 2):
                torch.set_num_threads(t)
                for m in (2, 3, 8, 9, 16, 17, 33, 40):
                    assert torch.equal(linear(x[:m], w, b, post=post, other=o[:m]), alone[:m]), (post, m)
                rows = [39, 0, 17, 5]
                assert torch.equal(linear(x[rows], w, b, post=post, other=o[rows]), alone[rows])
            if post == "add":
                assert alone.ne(0).any()  # the errors are there to see
    finally:
        torch.set_num_threads(threads)


def test_bfloat16_paths_agree(kernel: None, monkeypatch: pytest.MonkeyPatch) -> None:
    """vdpbf16ps adds a pair's second product, then its first, each exact in float32; the other
    paths (avx2, portable) add them in that order too, so all of them give the same bits (on normal numbers)."""
    weight, x, _, _ = make(576, 1536, 9, torch.bfloat16, seed=2)
    outs = []
    for mode in ("auto", "avx512", "avx2", "portable"):
        monkeypatch.setenv("PDSERVE_GEMM", mode)
        outs.append(linear(x, pack(weight), post="add", other=cancelling(x, weight)))
    assert outs[0].ne(0).float().mean() > 0.5
    assert all(torch.equal(outs[0], out) for out in outs[1:])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_layout(kernel: None, dtype: torch.dtype) -> None:
    weight = make(100, 41, 1, dtype)[0]
    w = pack(weight)
    assert w.data.shape == ((7, 21, 16, 2) if dtype == torch.bfloat16 else (7, 41, 16))
    assert w.data[6, :, 4:].eq(0).all()  # the last block's rows past N=100 are zeros
    assert torch.equal(unpack(w), weight) and w.nbytes == w.data.numel() * w.data.element_size()


def test_views_and_mixed_dtypes(kernel: None) -> None:
    """x and other as column slices of wider tensors (rows strided), a float32 bias and other with bfloat16."""
    weight, x, bias, other = make(100, 64, 5, torch.bfloat16, seed=3)
    w = pack(weight)
    wide_x = torch.cat([x, x], dim=1)[:, 64:]
    wide_other = torch.cat([other.float(), other.float()], dim=1)[:, :100]
    out = linear(wide_x, w, bias.float(), post="mul", other=wide_other)
    assert_close_to(out, expected(x, weight, bias, "mul", other))
    transposed = x.t().contiguous().t()  # last dim not contiguous: copied
    assert torch.equal(linear(transposed, w), linear(x, w))
    assert linear(x[:0], w).shape == (0, 100)


def test_bad_arguments_are_refused(kernel: None) -> None:
    weight, x, _, other = make(100, 64, 5, torch.float32)
    w = pack(weight)
    with pytest.raises(RuntimeError, match="post must be"):
        linear(x, w, post="gelu")
    with pytest.raises(RuntimeError, match="needs other"):
        linear(x, w, post="mul")
    with pytest.raises(RuntimeError, match="does not match"):
        linear(x[:, :32], w)


def test_other_dtypes_and_torch_mode_use_f_linear(kernel: None, monkeypatch: pytest.MonkeyPatch) -> None:
    weight, x, bias, other = make(100, 64, 5, torch.float32)
    half = pack(weight.half())
    assert not half.blocked
    torch.testing.assert_close(linear(x.half(), half, bias.half(), post="add", other=other.half()),
                               (F.linear(x, weight, bias) + other).half(), atol=1e-2, rtol=1e-2)
    w = pack(weight)
    assert torch.equal(linear(x.double(), w), reference_linear(x.double(), w))  # x in another dtype than w
    monkeypatch.setenv("PDSERVE_GEMM", "torch")
    plain = pack(weight)
    assert plain == PackedWeight(weight, 100, 64, None) and gemm.kernel_path(torch.float32) == "torch"
    assert not gemm.kernel_available()
    assert torch.equal(linear(x, plain, bias, post="silu"), F.silu(F.linear(x, weight, bias)))
    monkeypatch.setenv("PDSERVE_GEMM", "fast")
    with pytest.raises(ValueError, match="PDSERVE_GEMM"):
        pack(weight)


_CHILD = """
import logging, torch
logging.basicConfig(level=logging.INFO)
from model_runner import gemm
w, x = torch.randn(100, 64), torch.randn(3, 64)
out = gemm.linear(x, gemm.pack(w), post="silu")
assert torch.allclose(out, torch.nn.functional.silu(x @ w.T), atol=1e-5)
print("kernel" if gemm.kernel_available() else "F.linear")
"""


def _child(tmp_path: Path, **env: str) -> subprocess.Popen[str]:
    """A fresh process that builds the kernel (into tmp_path, not the shared cache) and runs one call."""
    full_env = {**os.environ, "TORCH_EXTENSIONS_DIR": str(tmp_path), **env}
    full_env.pop("PDSERVE_GEMM", None)
    return subprocess.Popen([sys.executable, "-c", _CHILD], env=full_env, text=True, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, cwd=Path(__file__).parent.parent)


def test_no_compiler_falls_back_to_f_linear(tmp_path: Path) -> None:
    child = _child(tmp_path, CXX="/nonexistent/c++")
    stdout, stderr = child.communicate(timeout=300)
    assert child.returncode == 0, stderr
    assert stdout.strip() == "F.linear"
    assert stderr.count("tinygemm kernel unavailable") == 1  # warned once


def test_rounds_to_nearest_even(path: str) -> None:
    """y = 0 @ W.T + bias is exactly the float32 bias, so the bfloat16 output must be torch's rounding of it:
    ties to even, overflow to inf, subnormals kept, NaN a NaN."""
    values = [1 + 2**-8, 1 + 3 * 2**-8, 1 + 2**-8 + 2**-20, -(1 + 2**-8), 3.4e38, float("inf"), float("-inf"),
              1e-40, 2**-126 * 1.00390625, 12345.678, float("nan")]
    bias = torch.tensor(values + [0.0] * (32 - len(values)))
    w = pack(torch.zeros(32, 2, dtype=torch.bfloat16))
    out = linear(torch.zeros(3, 2, dtype=torch.bfloat16), w, bias)
    rounded = bias.to(torch.bfloat16).expand(3, -1)
    assert torch.equal(out[:, :10].view(torch.int16), rounded[:, :10].view(torch.int16))
    assert out[:, 10].isnan().all() and torch.equal(out[:, 11:], rounded[:, 11:])


@pytest.fixture(params=["amx", "fp32"])
def prompt_path(request: pytest.FixtureRequest) -> Iterator[str]:
    """Each path prompt GEMMs of bfloat16 weights can take besides the kernel (--prompt-gemm), where the CPU
    has it: float32 everywhere, AMX on CPUs with AMX."""
    if request.param == "amx" and not gemm.amx_prompts():
        pytest.skip("prompt GEMMs go to oneDNN's AMX kernels only on CPUs with AMX")
    gemm.choose_prompt_gemm(request.param)
    try:
        assert gemm.prompt_gemm() == request.param
        yield request.param
    finally:
        gemm.choose_prompt_gemm(None)


@pytest.mark.parametrize("post", ["none", "silu", "mul", "add"])
def test_prompt_gemms_give_a_row_the_same_bits_in_any_company(prompt_path: str, post: str) -> None:
    torch.manual_seed(0)
    weight = torch.randn(200, 96).bfloat16()
    packed = gemm.pack(weight)
    assert packed.prompt is not None and (packed.prompt.dtype == torch.float32) == (prompt_path == "fp32")
    assert gemm.pack(weight, few_prompt_rows=True).prompt is None or prompt_path == "amx"  # an LM head: no copy
    x, other = torch.randn(150, 96).bfloat16(), torch.randn(150, 200).bfloat16()
    bias = torch.randn(200).bfloat16()

    def rows(start: int, end: int) -> torch.Tensor:
        return gemm.linear(x[start:end], packed, bias, post=post, other=other[start:end], prompt=True)

    whole = rows(0, 150)
    for start, end in ((7, 150), (0, 1), (64, 65), (100, 137), (3, 70)):  # other counts, other block positions
        assert torch.equal(rows(start, end), whole[start:end]), (start, end)
    expected = gemm.reference_linear(x, packed, bias, post=post, other=other)
    assert torch.allclose(whole.float(), expected.float(), rtol=0.05, atol=0.1 * expected.float().abs().max().item())


def test_loading_the_kernels_leaves_their_flags_and_build_directories_as_they_were(kernel: None) -> None:
    """torch appends its own flags to the lists it is given; ours name the build directories, so a kernel loaded
    after another must not find them grown (every container compiled its kernels anew at start)."""
    from model_runner import attention, kernels, prefill_attention

    modules = (gemm, attention, prefill_attention)
    directories = [m.KERNEL.build_directory() for m in modules]
    for m in modules:
        assert m.KERNEL.load()
    assert kernels.LDFLAGS == ["-fopenmp"] and gemm.KERNEL.cflags == ["-O3", "-fopenmp", "-ffp-contract=off"]
    assert [m.KERNEL.build_directory() for m in modules] == directories
