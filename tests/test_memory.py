"""The heap setting every pdserve process makes (serving/memory.py): KV-sized blocks come from the warm heap."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

# In a fresh interpreter: tune (or not), then allocate a KV chunk's worth of bytes and ask glibc where it went.
_PROBE = """
import ctypes, json, sys
from serving import memory
tuned = memory.keep_heap_warm() if sys.argv[1] == "tune" else False

class MallInfo2(ctypes.Structure):
    _fields_ = [(name, ctypes.c_size_t) for name in
                ("arena", "ordblks", "smblks", "hblks", "hblkhd", "usmblks", "fsmblks", "uordblks", "fordblks",
                 "keepcost")]

libc = ctypes.CDLL(None)
libc.mallinfo2.restype = MallInfo2
before = libc.mallinfo2().hblkhd
chunk = bytes(4 << 20)  # one message of a KV stream (chunks are 768 KiB by default, 4 MiB at most)
mapped = libc.mallinfo2().hblkhd - before
del chunk
print(json.dumps({"tuned": tuned, "mmapped": mapped}))
"""


def _probe(mode: str, **env: str) -> dict:
    environment = {k: v for k, v in os.environ.items() if not k.startswith("MALLOC_")} | env
    done = subprocess.run([sys.executable, "-c", _PROBE, mode], capture_output=True, text=True, env=environment,
                          timeout=60, check=True)
    return json.loads(done.stdout)


def _has_mallinfo2() -> bool:
    import ctypes

    return hasattr(ctypes.CDLL(None), "mallinfo2")


@pytest.mark.skipif(not sys.platform.startswith("linux") or not _has_mallinfo2(), reason="glibc >= 2.33 only")
def test_kv_sized_blocks_come_from_the_heap_once_tuned_and_from_fresh_mappings_otherwise() -> None:
    untuned = _probe("as-is")
    assert untuned["tuned"] is False and untuned["mmapped"] >= 4 << 20  # glibc's default: a mapping of its own
    assert _probe("tune") == {"tuned": True, "mmapped": 0}


@pytest.mark.skipif(not sys.platform.startswith("linux") or not _has_mallinfo2(), reason="glibc >= 2.33 only")
def test_an_operator_malloc_setting_wins() -> None:
    assert _probe("tune", MALLOC_TRIM_THRESHOLD_="131072")["tuned"] is False


_FREEZE_PROBE = """
import gc, json
import torch, transformers  # what a worker holds once loaded (its model's tensors are few objects)
from serving import memory
tracked = len(gc.get_objects())
memory.freeze_startup_objects()
print(json.dumps({"tracked": tracked, "frozen": gc.get_freeze_count(), "left": len(gc.get_objects())}))
"""


def test_startup_objects_are_frozen_out_of_every_later_collection() -> None:
    done = subprocess.run([sys.executable, "-c", _FREEZE_PROBE], capture_output=True, text=True, timeout=120,
                          check=True)
    found = json.loads(done.stdout)
    # a full collection walks only what was made after startup, not torch's and transformers' objects
    assert found["tracked"] > 50_000 and found["frozen"] > 0.9 * found["tracked"]
    assert found["left"] < 1_000
