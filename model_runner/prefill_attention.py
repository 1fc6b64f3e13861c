"""Causal attention over a prompt (prefill), with grouped-query heads and an optional cached prefix.

On CPUs with AVX-512 a C++ kernel (csrc/prefill_attention.cpp) does the work for float32 and bfloat16 with head
dims that are multiples of 64; it is compiled on first use, not on import, and cached in torch's extension
directory. Elsewhere (other CPUs, head dims, devices and dtypes, no compiler) and with
PDSERVE_PREFILL_ATTENTION=torch, torch's scaled_dot_product_attention serves instead.
PDSERVE_PREFILL_ATTENTION=avx512 keeps the kernel but leaves out its AVX512-BF16 instructions, and =portable
runs its scalar loops (any CPU, any head dim; for tests: many times slower than SDPA).

The kernel's output row t is a function of q_t and keys 0..start+t alone (its key tiles sit at fixed absolute
positions), so a prompt attended whole or in chunks (start > 0) gives the same bits.
"""

from __future__ import annotations

import fcntl
import functools
import hashlib
import logging
import os
import shutil
import sys
import threading
import time
from pathlib import Path

import torch
import torch.nn.functional as F

log = logging.getLogger(__name__)

_SOURCE = Path(__file__).parent / "csrc" / "prefill_attention.cpp"
# No -march: the AVX-512 code is compiled for AVX-512 by function attribute and picked at run time, so one
# cached build runs on any x86-64 CPU. -fopenmp makes at::parallel_for use torch's OpenMP pool. No FMA
# contraction: a row's arithmetic must not depend on which inlined copy of the code computed it.
_CFLAGS = ["-O3", "-fopenmp", "-ffp-contract=off"]
_LDFLAGS = ["-fopenmp"]
_KERNEL_DTYPES = (torch.float32, torch.bfloat16)
_MODES = ("auto", "torch", "avx512", "portable")
_ENV = "PDSERVE_PREFILL_ATTENTION"

_lock = threading.Lock()
_loaded = False
_failed = False


def causal_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float,
                     start: int = 0) -> torch.Tensor:
    """q (Hq, T, D); k, v (Hkv, start + T, D), views with any strides. Hq is a multiple of Hkv (GQA: q head h
    uses kv head h // (Hq // Hkv)). Query t sits at position start + t and attends keys 0..start + t. Returns
    (Hq, T, D) in q's dtype; from the kernel that is a transposed view of a contiguous (T, Hq, D) tensor, so
    `out.transpose(0, 1).reshape(T, Hq * D)` copies nothing."""
    mode = _mode()
    if q.device.type == "cpu" and scale > 0 and kernel_path(q.shape[-1], q.dtype) != "torch":
        out: torch.Tensor = torch.ops.pdserve_prefill.causal_attention(q, k, v, scale, start, mode)
        return out
    return reference_attention(q, k, v, scale, start)


def reference_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float,
                        start: int = 0) -> torch.Tensor:
    """causal_attention by torch's scaled_dot_product_attention; any device and dtype."""
    tokens = q.shape[1]
    mask = None
    if start:  # bottom-right causal: query t sees keys 0..start + t
        mask = torch.ones(tokens, start + tokens, dtype=torch.bool, device=q.device).tril(start)
    out = F.scaled_dot_product_attention(q[None], k[None], v[None], attn_mask=mask, is_causal=mask is None,
                                         scale=scale, enable_gqa=True)
    return out[0]


def load_kernel() -> bool:
    """Builds (or finds the cached build of) the C++ kernel now rather than on the first call; True if it loaded."""
    return _load()


def kernel_path(head_dim: int, dtype: torch.dtype) -> str:
    """Which code serves a CPU call: "avx512_bf16" (bfloat16 dot products), "avx512", "portable" (only when
    asked for: scalar loops, far slower than SDPA) or "torch"."""
    mode = _mode()
    if mode == "torch" or dtype not in _KERNEL_DTYPES or not _load():
        return "torch"
    return _path_for(head_dim, dtype == torch.bfloat16, mode)


@functools.cache
def _path_for(head_dim: int, bf16: bool, mode: str) -> str:
    path: str = torch.ops.pdserve_prefill.path_for(head_dim, bf16, mode)
    # Where this CPU or head dim has no vector path, SDPA (vectorised for any x86 CPU) beats the scalar loops
    return "torch" if path == "portable" and mode != "portable" else path


def _mode() -> str:
    mode = os.environ.get(_ENV, "auto").lower() or "auto"
    if mode not in _MODES:
        raise ValueError(f"{_ENV}={mode!r}: expected one of {', '.join(_MODES)}")
    return mode


def _load() -> bool:
    global _loaded, _failed
    if _loaded or _failed:
        return _loaded
    with _lock:
        if not _loaded and not _failed:
            try:
                _build()
                _loaded = True
            except Exception as e:  # no compiler, no ninja, a compile error: SDPA still works
                _failed = True
                log.warning("prefill attention kernel unavailable, using torch SDPA: %s", str(e)[-2000:])
    return _loaded


def build_directory() -> Path:
    """Where the kernel is built and cached: torch's extension directory, in a folder named for the source, the
    flags and torch, so builds of different versions never share (and rebuild over) one directory."""
    from torch.utils import cpp_extension  # imports setuptools: only when a build is wanted

    digest = hashlib.sha256(b"\0".join([_SOURCE.read_bytes(), " ".join(_CFLAGS + _LDFLAGS).encode(),
                                        torch.__version__.encode()])).hexdigest()[:12]
    root = os.environ.get("TORCH_EXTENSIONS_DIR") or cpp_extension.get_default_build_root()
    python = f"py{sys.version_info.major}{sys.version_info.minor}_cpu"
    return Path(root) / python / f"pdserve_prefill_attention_{digest}"


def _build() -> None:
    from torch.utils import cpp_extension

    build_dir = build_directory()
    build_dir.mkdir(parents=True, exist_ok=True)
    _put_ninja_on_path()
    began = time.perf_counter()
    # torch serialises builds with a lock file that outlives a builder killed mid-build, leaving every later
    # process waiting forever. An flock is let go when its holder dies: whoever holds it is the only builder,
    # so a torch lock file it finds is stale.
    with open(build_dir / "pdserve.lock", "w") as lock_file:
        fcntl.flock(lock_file, fcntl.LOCK_EX)
        (build_dir / "lock").unlink(missing_ok=True)
        # Registers torch.ops.pdserve_prefill (TORCH_LIBRARY, not a Python module: lighter headers, and torch
        # releases the GIL around the op)
        cpp_extension.load(name=build_dir.name, sources=[str(_SOURCE)], extra_cflags=_CFLAGS,
                           extra_ldflags=_LDFLAGS, build_directory=str(build_dir), is_python_module=False,
                           verbose=False)
    log.info("prefill attention kernel loaded in %.1f s (%s)", time.perf_counter() - began, build_dir)


def _put_ninja_on_path() -> None:
    # torch runs `ninja` from PATH; pip's ninja sits beside the venv's python, off PATH unless it is activated
    if shutil.which("ninja") is None:
        try:
            import ninja
        except ImportError:
            return
        os.environ["PATH"] = ninja.BIN_DIR + os.pathsep + os.environ.get("PATH", "")
