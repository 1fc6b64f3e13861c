"""Paged decode attention: the C++ kernel (each of its paths) against the torch reference, on ragged lengths and
shuffled block tables; batch invariance bit for bit; nothing read past a sequence's length; the fallbacks."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch

from model_runner import attention
from model_runner.attention import paged_decode_attention, reference_decode_attention

BLOCK = 16
LENGTHS = [1, BLOCK - 1, BLOCK, BLOCK + 1, 300]
TOLERANCE = {torch.float32: 1e-5, torch.bfloat16: 1e-2}
HAS_COMPILER = shutil.which(os.environ.get("CXX", "c++")) is not None


@dataclass
class Case:
    q: torch.Tensor  # (B, Hq, D)
    key_cache: torch.Tensor  # (num_blocks, BLOCK, Hkv, D), a view of one layer of a bigger cache
    value_cache: torch.Tensor
    block_tables: torch.Tensor  # int32 (B, max_blocks)
    context_lens: torch.Tensor  # int32 (B,)
    scale: float

    def args(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, float]:
        return self.q, self.key_cache, self.value_cache, self.block_tables, self.context_lens, self.scale


def make_case(lengths: list[int], q_heads: int = 9, kv_heads: int = 3, head_dim: int = 64,
              dtype: torch.dtype = torch.float32, seed: int = 0) -> Case:
    """Random q and cache; each sequence's blocks scattered through the cache in shuffled order, and its table
    padded past its length with ids no block has."""
    gen = torch.Generator().manual_seed(seed)
    per_seq = [-(-n // BLOCK) for n in lengths]
    max_blocks = max(per_seq) + 2
    num_blocks = sum(per_seq) + 5
    # (layers, 2, num_blocks, BLOCK, Hkv, D), as the runner allocates it; the test reads layer 1
    cache = torch.randn(2, 2, num_blocks, BLOCK, kv_heads, head_dim, generator=gen).to(dtype)
    ids = torch.randperm(num_blocks, generator=gen, dtype=torch.int32)
    tables = torch.randint(-10**6, 10**6, (len(lengths), max_blocks), generator=gen, dtype=torch.int32)
    start = 0
    for b, n in enumerate(per_seq):
        tables[b, :n] = ids[start:start + n]
        start += n
    # q as the runner passes it: the q heads sliced out of a row that also holds k and v, so not contiguous
    q = torch.randn(len(lengths), q_heads + 2 * kv_heads, head_dim, generator=gen).to(dtype)[:, :q_heads]
    return Case(q, cache[1, 0], cache[1, 1], tables, torch.tensor(lengths, dtype=torch.int32), head_dim**-0.5)


def subset(case: Case, rows: list[int]) -> Case:
    """The same sequences (same cache) as a batch of their own."""
    return Case(case.q[rows], case.key_cache, case.value_cache, case.block_tables[rows], case.context_lens[rows],
                case.scale)


@pytest.fixture(scope="module")
def kernel() -> None:
    if not HAS_COMPILER:
        pytest.skip("no C++ compiler: the kernel can't be built here")
    assert attention.load_kernel(), "the kernel failed to build (see the warning logged above)"


@pytest.fixture(params=["auto", "avx512", "avx2", "portable"])
def path(request: pytest.FixtureRequest, kernel: None, monkeypatch: pytest.MonkeyPatch) -> Iterator[str]:
    """Each of the kernel's paths this CPU can run: auto is the fastest (AVX512-BF16 dot products for
    bfloat16 where the CPU has them), avx512 leaves those out, avx2 is what CPUs without AVX-512 run, portable
    the scalar loops of other CPUs."""
    monkeypatch.setenv("PDSERVE_ATTENTION", request.param)
    if request.param in ("avx512", "avx2") and attention.kernel_path(64, torch.float32) != request.param:
        pytest.skip(f"this CPU has no {request.param} path")
    yield request.param


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize(("q_heads", "kv_heads", "head_dim"),
                         [(9, 3, 64), (3, 3, 64), (12, 2, 64), (8, 2, 128), (14, 2, 128), (4, 2, 80)])
def test_matches_reference(path: str, dtype: torch.dtype, q_heads: int, kv_heads: int, head_dim: int) -> None:
    case = make_case(LENGTHS, q_heads, kv_heads, head_dim, dtype)
    out = paged_decode_attention(*case.args())
    expected = reference_decode_attention(*case.args())
    assert out.dtype == dtype and out.shape == case.q.shape
    torch.testing.assert_close(out.float(), expected.float(), atol=TOLERANCE[dtype], rtol=0)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_batch_invariant(path: str, dtype: torch.dtype) -> None:
    """A sequence's output is the same bits alone, in a batch of 8, at any position and thread count."""
    case = make_case([300, 1, 17, 16, 15, 64, 129, 250], dtype=dtype, seed=1)
    batched = paged_decode_attention(*case.args())
    threads = torch.get_num_threads()
    try:
        for n in (1, 2):
            torch.set_num_threads(n)
            for b in (0, 3, 7):
                alone = paged_decode_attention(*subset(case, [b]).args())
                assert torch.equal(alone[0], batched[b])
            shuffled = paged_decode_attention(*subset(case, [7, 0, 3]).args())
            assert torch.equal(shuffled, batched[[7, 0, 3]])
    finally:
        torch.set_num_threads(threads)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_reads_nothing_past_the_length(path: str, dtype: torch.dtype) -> None:
    """NaN after each sequence's last token, in its last block and in every block no sequence uses."""
    case = make_case(LENGTHS, dtype=dtype, seed=2)
    unused = torch.ones(case.key_cache.shape[0], dtype=torch.bool)
    for b, n in enumerate(case.context_lens.tolist()):
        blocks = case.block_tables[b, : -(-n // BLOCK)].long()
        unused[blocks] = False
        for cache in (case.key_cache, case.value_cache):
            cache[blocks[-1], (n - 1) % BLOCK + 1:] = float("nan")
    case.key_cache[unused] = float("nan")
    case.value_cache[unused] = float("nan")
    out = paged_decode_attention(*case.args())
    assert torch.isfinite(out).all()
    torch.testing.assert_close(out.float(), reference_decode_attention(*case.args()).float(),
                               atol=TOLERANCE[dtype], rtol=0)


def test_empty_sequence_gives_zeros(path: str) -> None:
    case = make_case([5, 1], seed=3)
    case.context_lens[1] = 0
    out = paged_decode_attention(*case.args())
    assert torch.equal(out[1], torch.zeros_like(out[1]))
    torch.testing.assert_close(out, reference_decode_attention(*case.args()), atol=1e-5, rtol=0)


def test_bad_tables_are_refused(kernel: None) -> None:
    case = make_case([20], seed=4)
    case.block_tables[0, 1] = case.key_cache.shape[0]  # one past the last block
    with pytest.raises(RuntimeError, match="outside"):
        paged_decode_attention(*case.args())
    case = make_case([20], seed=4)
    case.context_lens[0] = case.block_tables.shape[1] * BLOCK + 1
    with pytest.raises(RuntimeError, match="context length"):
        paged_decode_attention(*case.args())


def test_torch_mode_is_the_reference(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("PDSERVE_ATTENTION", "torch")
    case = make_case(LENGTHS, seed=5)
    assert not attention.kernel_available()
    assert attention.kernel_path(64, torch.float32) == "torch"
    assert torch.equal(paged_decode_attention(*case.args()), reference_decode_attention(*case.args()))
    monkeypatch.setenv("PDSERVE_ATTENTION", "fast")
    with pytest.raises(ValueError, match="PDSERVE_ATTENTION"):
        paged_decode_attention(*case.args())


_CHILD = """
import logging, torch
logging.basicConfig(level=logging.INFO)
from model_runner import attention
from tests.test_attention import LENGTHS, make_case
case = make_case(LENGTHS)
out = attention.paged_decode_attention(*case.args())
assert torch.allclose(out, attention.reference_decode_attention(*case.args()), atol=1e-5)
print("kernel" if attention.kernel_available() else "reference")
"""


def _child(tmp_path: Path, **env: str) -> subprocess.Popen[str]:
    """A fresh process that builds the kernel (into tmp_path, not the shared cache) and runs one call."""
    full_env = {**os.environ, "TORCH_EXTENSIONS_DIR": str(tmp_path), **env}
    full_env.pop("PDSERVE_ATTENTION", None)
    return subprocess.Popen([sys.executable, "-c", _CHILD], env=full_env, text=True, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, cwd=Path(__file__).parent.parent)


def test_no_compiler_falls_back_to_the_reference(tmp_path: Path) -> None:
    child = _child(tmp_path, CXX="/nonexistent/c++")
    stdout, stderr = child.communicate(timeout=300)
    assert child.returncode == 0, stderr
    assert stdout.strip() == "reference"
    assert stderr.count("paged attention kernel unavailable") == 1  # warned once


@pytest.mark.slow  # two first builds: ~20 s on 2 cores
@pytest.mark.skipif(not HAS_COMPILER, reason="no C++ compiler")
def test_two_processes_build_at_once(tmp_path: Path) -> None:
    """model_runner/kernels.Kernel, which builds every C++ kernel, shown on this one."""
    # A torch lock file left by a builder that was killed mid-build: it must not make these wait forever.
    stale = attention.KERNEL.build_directory().relative_to(_extensions_root()) / "lock"
    (tmp_path / stale).parent.mkdir(parents=True)
    (tmp_path / stale).touch()
    children = [_child(tmp_path) for _ in range(2)]
    for child in children:
        stdout, stderr = child.communicate(timeout=600)
        assert child.returncode == 0, stderr
        assert stdout.strip() == "kernel", stderr


def _extensions_root() -> Path:
    from torch.utils import cpp_extension

    return Path(os.environ.get("TORCH_EXTENSIONS_DIR") or cpp_extension.get_default_build_root())


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_rope_and_store_and_rms_norm_kernels_match_torch(dtype: torch.dtype) -> None:
    """The decode layer's small ops: the C++ ones agree with the torch ones and write only their rows' slots."""
    from model_runner.attention import decode_ops, reference_rope_and_store

    if not attention.kernel_available():
        pytest.skip("no C++ kernel here")
    kernel = decode_ops(torch.device("cpu"), dtype)
    gen = torch.Generator().manual_seed(0)
    hq, hkv, d, batch = 9, 3, 64, 5
    qkv = torch.randn(batch, (hq + 2 * hkv) * d, generator=gen).to(dtype)
    cos, sin = torch.randn(batch, d, generator=gen).to(dtype), torch.randn(batch, d, generator=gen).to(dtype)
    slots = torch.tensor([3, 17, 0, 40, 9])
    caches = [torch.zeros(2, 4, 16, hkv, d, dtype=dtype) for _ in range(2)]
    q_kernel = kernel.rope_and_store(qkv, cos, sin, caches[0][0], caches[0][1], slots, hq, hkv)
    q_torch = reference_rope_and_store(qkv, cos, sin, caches[1][0], caches[1][1], slots, hq, hkv)
    tolerance = {"atol": 1e-5, "rtol": 1e-5} if dtype == torch.float32 else {"atol": 2e-2, "rtol": 1e-2}
    torch.testing.assert_close(q_kernel, q_torch, **tolerance)
    torch.testing.assert_close(caches[0], caches[1], **tolerance)
    written = caches[0].view(2, -1, hkv * d).abs().sum(-1) > 0
    assert written.nonzero()[:, 1].unique().tolist() == sorted(slots.tolist())
    x, weight = torch.randn(7, 576, generator=gen).to(dtype), torch.randn(576, generator=gen).to(dtype)
    torch.testing.assert_close(kernel.rms_norm(x, weight, 1e-5), torch.rms_norm(x.float(), (576,), weight.float(),
                                                                                  1e-5).to(dtype), **tolerance)
    # a row's result does not depend on the rows beside it
    assert torch.equal(kernel.rms_norm(x, weight, 1e-5)[2:3], kernel.rms_norm(x[2:3], weight, 1e-5))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize(("q_heads", "kv_heads", "head_dim"), [(5, 1, 8), (10, 2, 16), (16, 2, 24), (7, 7, 64)])
def test_odd_blocks_and_strided_caches(path: str, dtype: torch.dtype, q_heads: int, kv_heads: int,
                                       head_dim: int) -> None:
    """Blocks of 5 tokens, small head dims, groups of 1 to 8, and caches whose tokens and heads are strided (the
    heads of a bigger cache): against the reference, and each sequence the same bits alone as in the batch."""
    gen = torch.Generator().manual_seed(6)
    block, lengths = 5, [0, 1, 7, 8, 9, 41]
    per_seq = [-(-n // block) for n in lengths]
    num_blocks = sum(per_seq) + 3
    cache = torch.randn(2, num_blocks, block, kv_heads + 2, head_dim + 8, generator=gen).to(dtype)
    key_cache, value_cache = cache[0, :, :, 1:kv_heads + 1, :head_dim], cache[1, :, :, 1:kv_heads + 1, 8:]
    ids = torch.randperm(num_blocks, generator=gen, dtype=torch.int32)
    tables = torch.zeros(len(lengths), max(per_seq), dtype=torch.int32)
    start = 0
    for b, n in enumerate(per_seq):
        tables[b, :n] = ids[start:start + n]
        start += n
    q = torch.randn(len(lengths), q_heads, head_dim, generator=gen).to(dtype)
    case = Case(q, key_cache, value_cache, tables, torch.tensor(lengths, dtype=torch.int32), head_dim**-0.5)
    out = paged_decode_attention(*case.args())
    torch.testing.assert_close(out.float(), reference_decode_attention(*case.args()).float(),
                               atol=TOLERANCE[dtype], rtol=0)
    for b in range(len(lengths)):
        assert torch.equal(paged_decode_attention(*subset(case, [b]).args())[0], out[b])
