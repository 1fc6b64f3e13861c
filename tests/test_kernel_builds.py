"""A kernel's build folder is named for everything compiled into it: its source, the shared header, the flags."""

import shutil
from pathlib import Path

import pytest

from model_runner import kernels


@pytest.fixture
def csrc(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    copy = tmp_path / "csrc"
    shutil.copytree(kernels.CSRC, copy)
    monkeypatch.setattr(kernels, "CSRC", copy)
    return copy


def test_a_change_to_the_shared_header_renames_every_kernel_s_build(csrc: Path) -> None:
    # 1. Each kernel that includes simd.h, before the change
    sources = ["paged_attention.cpp", "prefill_attention.cpp", "tinygemm.cpp", "greedy.cpp"]
    assert all('#include "simd.h"' in (csrc / s).read_text() for s in sources)
    before = [kernels.Kernel(s, s, "torch").build_directory() for s in sources]
    # 2. A change to the header alone: a stale build would otherwise be loaded with the old helpers in it
    header = csrc / "simd.h"
    header.write_text(header.read_text() + "\n// changed\n")
    after = [kernels.Kernel(s, s, "torch").build_directory() for s in sources]
    assert all(b != a for b, a in zip(before, after))
    # 3. The same inputs name the same folder (a later process finds the build)
    assert after == [kernels.Kernel(s, s, "torch").build_directory() for s in sources]
