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


def test_the_same_source_in_another_checkout_builds_in_a_folder_of_its_own(tmp_path: Path,
                                                                           monkeypatch: pytest.MonkeyPatch) -> None:
    """Torch's build file names the source's path and torch's include paths: two checkouts (or environments) sharing
    one build folder would each make ninja compile again over the other's build, and a service loading the kernel
    meanwhile waits on the build lock for minutes."""
    here = kernels.Kernel("greedy.cpp", "greedy", "torch").build_directory()
    copy = tmp_path / "csrc"
    shutil.copytree(kernels.CSRC, copy)
    assert (copy / "greedy.cpp").read_bytes() == (kernels.CSRC / "greedy.cpp").read_bytes()
    monkeypatch.setattr(kernels, "CSRC", copy)
    there = kernels.Kernel("greedy.cpp", "greedy", "torch").build_directory()
    assert here != there and here.parent == there.parent
