"""Decode GEMMs: y = x @ W.T (+ bias) for x of a few rows, at the speed the weight streams from memory.

`pack` lays a weight out once, at load, in the order the kernel (csrc/tinygemm.cpp) reads it: outputs in blocks
of 16, one 64-byte line per k (float32) or per pair of k (bfloat16). `linear` then reads each line once for all
rows of x and can apply SiLU, a product or a residual add to the output before it is stored. A row's output has
the same bits alone or in any batch, at any thread count: every output is summed over k in order of k.

The kernel is compiled on first use, not on import, and cached in torch's extension directory. Where it cannot be
built, on other devices, and with PDSERVE_GEMM=torch, F.linear serves instead (not batch invariant).
PDSERVE_GEMM=avx512 keeps the kernel but leaves out its AVX512-BF16 instructions, =avx2 runs the 8-lane code that
CPUs without AVX-512 run, and =portable the scalar loops of other CPUs. PDSERVE_GEMM is read when a weight is
packed; the weight keeps that choice.

Prompt GEMMs (`prompt=True`: many rows, compute-bound) of bfloat16 weights can go elsewhere (`prompt_gemm()`,
PDSERVE_PROMPT_GEMM): by default (auto), on CPUs with AMX-BF16, to oneDNN's AMX kernels, 6-13x faster than the
kernel above at prompt shapes (docs/kernels.md, "Prompt GEMMs on AMX"). With PDSERVE_PROMPT_GEMM=fp32, to torch's
float32 GEMM on a float32 copy of the weight: 1.3-1.6x the kernel's rate on a CPU without AVX512-BF16 in blocks of
64 rows, which pays for a long prompt's passes but not for a single chat prompt's or 32-token chunks', padded to
64 rows (docs/kernels.md, "Prompt GEMMs in float32"); auto chooses it for a prefill worker whose kernel runs
AVX-512 without AVX512-BF16. Both stay batch and chunk invariant: every call multiplies a
fixed number of rows (the last block zero-padded), so a row's bits depend only on the row, never on how many rows
came with it or where it sits in its block (tested). Each bfloat16 weight then has a second copy, reordered for
oneDNN or in float32 (twice its bytes: float32 copies stop once they would take more than a quarter of the memory
available at load; the LM head, whose prompt GEMMs take a row per prompt, has none). =kernel keeps prompts on the
kernel.
"""

from __future__ import annotations

import functools
import os
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn.functional as F

from model_runner import host_memory, kernels

# -ffp-contract=off: the portable loops round every product and sum where the source says, never fused.
KERNEL = kernels.Kernel("tinygemm.cpp", "tinygemm kernel", "F.linear", "PDSERVE_GEMM", cflags=("-ffp-contract=off",))
_POSTS = ("none", "silu", "mul", "add")
BLOCK = 16  # outputs per block of the packed layout
PROMPT_ROWS = 64  # rows in every oneDNN call of a prompt GEMM: a multiple of AMX's 16-row tiles
FP32_PROMPT_ROWS = 64  # rows in every float32 prompt GEMM (torch's sgemm reaches ~100-130 GFLOP/s here, ~80 at 32)


@dataclass(frozen=True)
class PackedWeight:
    """A (out_features, in_features) weight, laid out for the kernel, or as given where F.linear serves."""

    data: torch.Tensor  # blocked: (N/16, ceil(K/2), 16, 2) bf16 or (N/16, K, 16) fp32, N padded; else (N, K)
    out_features: int
    in_features: int
    mode: str | None  # the kernel's PDSERVE_GEMM mode (auto, avx512, avx2, portable); None: data is (N, K) for F.linear
    prompt: torch.Tensor | None = None  # for prompt GEMMs: reordered for oneDNN's AMX kernels, or float32 (N, K)

    @property
    def blocked(self) -> bool:
        return self.mode is not None

    @property
    def dtype(self) -> torch.dtype:
        return self.data.dtype

    @property
    def nbytes(self) -> int:
        return self.data.numel() * self.data.element_size()


def pack(weight: torch.Tensor, arena: host_memory.Arena | None = None, few_prompt_rows: bool = False) -> PackedWeight:
    """Lays out a (N, K) float32 or bfloat16 CPU weight for `linear` (a copy, in `arena` if given; the weight can
    be freed). Other weights, and all of them where the kernel is off or cannot be built, are kept as they are.
    `few_prompt_rows`: its prompt GEMMs take a row or two (the LM head): no float32 copy, which would only double
    what they read."""
    n, k = weight.shape
    mode = KERNEL.serves(weight.device.type, weight.dtype)
    if mode is None:
        return PackedWeight(weight, n, k, mode=None)
    blocks = -(-n // BLOCK)
    if weight.dtype == torch.bfloat16:
        pairs = -(-k // 2)
        padded = F.pad(weight, (0, 2 * pairs - k, 0, blocks * BLOCK - n))  # zeros
        data = padded.view(blocks, BLOCK, pairs, 2).transpose(1, 2)  # (blocks, pairs, 16, 2)
    else:
        padded = F.pad(weight, (0, 0, 0, blocks * BLOCK - n))
        data = padded.view(blocks, BLOCK, k).transpose(1, 2)  # (blocks, K, 16)
    prompt = None
    if weight.dtype == torch.bfloat16 and prompt_gemm() == "amx":
        prompt = torch.ops.mkldnn._reorder_linear_weight(weight.contiguous(), PROMPT_ROWS)
    elif weight.dtype == torch.bfloat16 and prompt_gemm() == "fp32" and not few_prompt_rows:
        prompt = _fp32_copy(weight)
    return PackedWeight(data.contiguous() if arena is None else arena.copy(data), n, k, mode, prompt)


def unpack(w: PackedWeight) -> torch.Tensor:
    """The (N, K) weight back."""
    if not w.blocked:
        return w.data
    if w.data.dim() == 4:
        plain = w.data.transpose(1, 2).reshape(-1, 2 * w.data.shape[1])
    else:
        plain = w.data.transpose(1, 2).reshape(-1, w.data.shape[1])
    return plain[: w.out_features, : w.in_features]


def linear(x: torch.Tensor, w: PackedWeight, bias: torch.Tensor | None = None, *, post: str = "none",
           other: torch.Tensor | None = None, prompt: bool = False) -> torch.Tensor:
    """x (M, K) in w's dtype (rows may be strided; a last dim that isn't contiguous is copied) -> (M, N):
    x @ W.T + bias, then per `post`: "none", "silu" (silu(y)), "mul" (y * other) or "add" (y + other), other
    (M, N) with its last dim contiguous. Sums, bias and post-op in float32, rounded once to the output dtype.
    bias (N,) and other may be float32 or w's dtype. `prompt`: a prompt pass's GEMM (AMX where there is one)."""
    if prompt and w.prompt is not None and x.is_cpu and x.dtype == torch.bfloat16:
        if w.prompt.dtype == torch.float32:
            return _prompt_linear_fp32(x, w.prompt, bias, post, other)
        return _prompt_linear(x, w, bias, post, other)
    if w.mode is not None and x.is_cpu and x.dtype == w.data.dtype:  # (is_cpu: x.device costs ~0.3 us)
        out: torch.Tensor = torch.ops.pdserve_gemm.linear(x, w.data, w.out_features, bias, post, other, w.mode)
        return out
    if post == "add" and x.is_cuda and bias is None and other is not None and other.dtype == x.dtype:
        return torch.addmm(other, x, w.data.t())  # the residual add in cuBLAS's epilogue: one launch, not two
    return reference_linear(x, w, bias, post=post, other=other)


def reference_linear(x: torch.Tensor, w: PackedWeight, bias: torch.Tensor | None = None, *, post: str = "none",
                     other: torch.Tensor | None = None) -> torch.Tensor:
    """linear with F.linear in x's dtype (post-op after rounding); any device."""
    if post not in _POSTS:
        raise ValueError(f"post={post!r}: expected one of {', '.join(_POSTS)}")
    weight = unpack(w).to(x.dtype)
    y = F.linear(x, weight, None if bias is None else bias.to(x.dtype))
    if post == "silu":
        return F.silu(y)
    if post in ("mul", "add"):
        if other is None:
            raise ValueError(f"post={post!r} needs other")
        return y * other if post == "mul" else y + other
    return y


_ONEDNN_POSTS = {"none": "none", "silu": "swish"}


def _prompt_linear(x: torch.Tensor, w: PackedWeight, bias: torch.Tensor | None, post: str,
                   other: torch.Tensor | None) -> torch.Tensor:
    """oneDNN (AMX) in blocks of exactly PROMPT_ROWS rows; the post-op fused where oneDNN has it, else after."""
    bias = None if bias is None else bias.to(torch.bfloat16)
    out = torch.empty(x.shape[0], w.out_features, dtype=x.dtype)
    for start, taken, block in _fixed_blocks(x, PROMPT_ROWS):
        if post in _ONEDNN_POSTS:
            y = torch.ops.mkldnn._linear_pointwise(block.contiguous(), w.prompt, bias, _ONEDNN_POSTS[post], [], "")
        else:
            y = torch.ops.mkldnn._linear_pointwise(block.contiguous(), w.prompt, bias, "none", [], "")
        out[start : start + taken] = y[:taken]
    if post in ("mul", "add"):
        if other is None:
            raise ValueError(f"post={post!r} needs other")
        if post == "mul":
            out *= other
        else:
            out += other
    return out


def _fixed_blocks(x: torch.Tensor, block_rows: int) -> Iterator[tuple[int, int, torch.Tensor]]:
    """(first row, rows taken, a block of exactly `block_rows` rows) over x, the last block zero-padded: every GEMM
    call then has the same shape, so a row's bits never depend on how many rows came with it."""
    for start in range(0, x.shape[0], block_rows):
        block = x[start : start + block_rows]
        taken = block.shape[0]
        if taken < block_rows:
            block = F.pad(block, (0, 0, 0, block_rows - taken))
        yield start, taken, block


def _prompt_linear_fp32(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, post: str,
                        other: torch.Tensor | None) -> torch.Tensor:
    """torch's float32 GEMM in blocks of exactly FP32_PROMPT_ROWS rows on the weight's float32 copy; bias and
    post-op in float32, rounded once to bfloat16, as the kernel does."""
    if post in ("mul", "add") and other is None:
        raise ValueError(f"post={post!r} needs other")
    bias32 = None if bias is None else bias.float()
    out = torch.empty(x.shape[0], weight.shape[0], dtype=x.dtype)
    for start, taken, block in _fixed_blocks(x, FP32_PROMPT_ROWS):
        y = F.linear(block.float(), weight, bias32)[:taken]
        if post == "silu":
            y = F.silu(y)
        elif post == "mul":
            y = y * other[start : start + taken].float()  # type: ignore[index]
        elif post == "add":
            y = y + other[start : start + taken].float()  # type: ignore[index]
        out[start : start + taken] = y
    return out


_fp32_left = [-1]  # bytes float32 prompt copies may still take (-1: not yet read)


def _fp32_copy(weight: torch.Tensor) -> torch.Tensor | None:
    """The weight in float32 for prompt GEMMs, while copies stay within a quarter of the memory available when the
    first was made; None past that (those weights' prompts stay on the kernel)."""
    if _fp32_left[0] < 0:
        _fp32_left[0] = host_memory.available_bytes() // 4
    size = weight.numel() * 4
    if size > _fp32_left[0]:
        return None
    _fp32_left[0] -= size
    return weight.float().contiguous()


PROMPT_GEMMS = ("auto", "kernel", "amx", "fp32")
_chosen: list[tuple[str, bool]] = []  # a worker's --prompt-gemm and role (choose_prompt_gemm); none: the environment


def choose_prompt_gemm(choice: str | None, prompt_worker: bool = False) -> None:
    """Prompt GEMMs of weights packed from now on go where `choice` (one of PROMPT_GEMMS: a worker's --prompt-gemm,
    as ModelConfig checked it) says, as far as the CPU allows (`prompt_gemm`), for a worker whose passes are
    mostly long prompts (`prompt_worker`: a prefill worker) or not; None: where PDSERVE_PROMPT_GEMM says, as in a
    process that loads no ModelConfig (a benchmark, a test)."""
    _chosen[:] = [] if choice is None else [(choice, prompt_worker)]
    prompt_gemm.cache_clear()


@functools.cache
def prompt_gemm() -> str:
    """Where prompt GEMMs of bfloat16 weights go: "amx" (oneDNN's AMX kernels), "fp32" (torch's float32 GEMM on a
    float32 copy) or "kernel" (the kernel above), as chosen and as the CPU allows. auto: amx where the CPU has it;
    else, for a prefill worker, fp32 where the kernel runs AVX-512 without AVX512-BF16 (there it prefills a long
    prompt ~1.2x faster, docs/kernels.md); else kernel."""
    asked, prompt_worker = _chosen[0] if _chosen else (os.environ.get("PDSERVE_PROMPT_GEMM", "auto"), False)
    if asked not in PROMPT_GEMMS:
        raise ValueError(f"prompt GEMMs {asked!r} (--prompt-gemm, PDSERVE_PROMPT_GEMM): expected one of "
                         f"{', '.join(PROMPT_GEMMS)}")
    if asked == "kernel" or not KERNEL.load():
        return "kernel"
    if asked in ("auto", "amx") and amx_prompts():
        return "amx"
    if asked == "auto" and prompt_worker and kernel_path(torch.bfloat16) == "avx512":
        return "fp32"
    return "fp32" if asked == "fp32" else "kernel"


@functools.cache
def amx_prompts() -> bool:
    """Whether prompt GEMMs can go to oneDNN's AMX kernels: a CPU with AMX-BF16 and oneDNN in torch (whether they
    do: `prompt_gemm`)."""
    if not torch.backends.mkldnn.is_available():
        return False
    try:
        flags = Path("/proc/cpuinfo").read_text()
    except OSError:
        return False
    return " amx_bf16" in flags and hasattr(torch.ops.mkldnn, "_reorder_linear_weight")


def load_kernel() -> bool:
    """Builds (or finds the cached build of) the C++ kernel now rather than on first use; True if it loaded."""
    return KERNEL.load()


def kernel_available() -> bool:
    """Whether `pack` lays weights out for the C++ kernel now (building it if not built yet)."""
    return KERNEL.serves() is not None


def kernel_path(dtype: torch.dtype) -> str:
    """Which code serves CPU calls on weights packed now: "avx512_bf16" (bfloat16 dot products), "avx512",
    "avx2", "portable" or "torch"."""
    mode = KERNEL.serves("cpu", dtype)
    if mode is None:
        return "torch"
    path: str = torch.ops.pdserve_gemm.path_for(dtype == torch.bfloat16, mode)
    return path

