"""Building and loading the runner's C++ kernels (`model_runner/csrc/*.cpp`), one shared way.

Each source registers its ops with TORCH_LIBRARY (torch.ops.<namespace>.*: lighter headers than a pybind
module, and torch releases the GIL around the ops). A kernel is built on its first use, never on import, with
torch.utils.cpp_extension and ninja, into torch's extension directory, in a folder named for the source, the
flags and torch, so builds of different versions never share one; later processes load it in ~0.1 s. Where it
cannot be built (no compiler, no ninja), `Kernel.load()` says False once, with a warning, and its caller falls
back to torch.
"""

from __future__ import annotations

import fcntl
import hashlib
import logging
import os
import shutil
import sys
import threading
import time
from pathlib import Path

import torch

log = logging.getLogger(__name__)

CSRC = Path(__file__).parent / "csrc"
# No -march: AVX-512 code is compiled by function attribute and picked at run time, so one cached build runs on
# any x86-64 CPU. -fopenmp makes at::parallel_for use torch's OpenMP pool (without it the loop runs serially);
# libgomp.so.1 resolves to the copy torch already loaded, so torch.set_num_threads applies.
CFLAGS = ["-O3", "-fopenmp"]
LDFLAGS = ["-fopenmp"]


KERNEL_DTYPES = (torch.float32, torch.bfloat16)


class Kernel:
    """One source file's ops: `load()` builds them once per machine (or finds the build) and says if they run;
    `serves(device, dtype)` is the one dispatch every op makes: the code path its environment variable asks for
    (`variable`, one of `modes`; "torch" turns the kernel off) where the kernel runs for that device and dtype,
    else None, and the caller's torch fallback serves."""

    def __init__(self, source: str, what: str, fallback: str, variable: str = "",
                 modes: tuple[str, ...] = ("auto", "torch", "avx512", "avx2", "portable"),
                 cflags: tuple[str, ...] = ()) -> None:
        self.source = CSRC / source
        self.cflags = CFLAGS + list(cflags)
        self.what, self.fallback = what, fallback  # for the one warning when it cannot be built
        self.variable, self.modes = variable, modes
        self._lock = threading.Lock()
        self._state: bool | None = None  # None: not tried yet

    def mode(self) -> str:
        """The code path the kernel's variable asks for ("auto" when unset, or when it has none)."""
        return mode(self.variable, self.modes) if self.variable else "auto"

    def serves(self, device: str = "cpu", dtype: torch.dtype | None = None) -> str | None:
        """The kernel's mode for a call on `device` in `dtype` (None: any), or None where torch serves it: another
        device, a dtype the kernel lacks, the mode "torch", or a kernel that cannot be built."""
        chosen = self.mode()
        if chosen == "torch" or device != "cpu" or (dtype is not None and dtype not in KERNEL_DTYPES):
            return None
        return chosen if self.load() else None

    def load(self) -> bool:
        if self._state is None:
            with self._lock:
                if self._state is None:
                    try:
                        self._build()
                        self._state = True
                    except Exception as e:  # no compiler, no ninja, a compile error: torch still works
                        self._state = False
                        log.warning("%s unavailable, using %s: %s", self.what, self.fallback, str(e)[-2000:])
        return self._state

    def build_directory(self) -> Path:
        from torch.utils import cpp_extension  # imports setuptools: only when a build is wanted

        # the headers too: ninja would rebuild on a header change, but the folder is named for what it holds. And
        # where the source and torch live: torch's build file names both (the source, torch's include paths), so
        # two checkouts or environments sharing one folder would each make ninja compile the other's build again
        # (minutes at -O3, every process that loads the kernel meanwhile waiting on the build lock)
        headers = [h.read_bytes() for h in sorted(CSRC.glob("*.h"))]
        flags = " ".join(self.cflags + LDFLAGS).encode()
        where = f"{self.source.resolve()}\0{Path(torch.__file__).resolve().parent}".encode()
        hashed = hashlib.sha256(b"\0".join([self.source.read_bytes(), *headers, flags, torch.__version__.encode(),
                                             where]))
        digest = hashed.hexdigest()[:12]
        root = os.environ.get("TORCH_EXTENSIONS_DIR") or cpp_extension.get_default_build_root()
        python = f"py{sys.version_info.major}{sys.version_info.minor}_cpu"
        return Path(root) / python / f"pdserve_{self.source.stem}_{digest}"

    def _build(self) -> None:
        from torch.utils import cpp_extension

        build_dir = self.build_directory()
        build_dir.mkdir(parents=True, exist_ok=True)
        _put_ninja_on_path()
        began = time.perf_counter()
        # torch serialises builds with a lock file that outlives a builder killed mid-build, leaving every later
        # process waiting forever. An flock is let go when its holder dies: whoever holds it is the only builder,
        # so a torch lock file it finds is stale.
        with open(build_dir / "pdserve.lock", "w") as lock_file:
            fcntl.flock(lock_file, fcntl.LOCK_EX)
            (build_dir / "lock").unlink(missing_ok=True)
            # copies: torch appends its own flags to the lists it is given, and LDFLAGS names the next build's
            # directory (a container compiled every kernel anew at start when loaded in another order)
            cpp_extension.load(name=build_dir.name, sources=[str(self.source)], extra_cflags=list(self.cflags),
                               extra_ldflags=list(LDFLAGS), build_directory=str(build_dir), is_python_module=False,
                               verbose=False)
        log.info("%s loaded in %.1f s (%s)", self.what, time.perf_counter() - began, build_dir)


def mode(variable: str, modes: tuple[str, ...]) -> str:
    """The kernel path an environment variable asks for ("auto" when unset)."""
    value = os.environ.get(variable, "auto").lower() or "auto"
    if value not in modes:
        raise ValueError(f"{variable}={value!r}: expected one of {', '.join(modes)}")
    return value


def _put_ninja_on_path() -> None:
    # torch runs `ninja` from PATH; pip's ninja sits beside the venv's python, off PATH unless it is activated
    if shutil.which("ninja") is None:
        try:
            import ninja
        except ImportError:
            return
        os.environ["PATH"] = ninja.BIN_DIR + os.pathsep + os.environ.get("PATH", "")
