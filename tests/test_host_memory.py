"""The CPU memory a decode step streams (model_runner/host_memory.py): the packed weights and the paged KV pool sit
in mappings that transparent huge pages may back, and hold the values put there."""

from __future__ import annotations

import gc
from pathlib import Path

import pytest
import torch

from model_runner import gemm, host_memory
from model_runner.loading import LoadedModel
from model_runner.paged_cache import PagedKVCache

_THP = Path("/sys/kernel/mm/transparent_hugepage/enabled")


def _mapping_of(address: int) -> dict[str, str]:
    """The /proc/self/smaps fields of the mapping that holds `address`."""
    fields: dict[str, str] = {}
    inside = False
    for line in Path("/proc/self/smaps").read_text().splitlines():
        head = line.split()[0]
        if "-" in head and not head.endswith(":"):  # a mapping's first line: start-end perms ...
            start, end = (int(part, 16) for part in head.split("-"))
            inside = start <= address < end
        elif inside:
            name, _, value = line.partition(":")
            fields[name] = value.strip()
    return fields


def _assert_huge_page_eligible(tensor: torch.Tensor) -> None:
    """The mapping under `tensor` is one THP may back: the kernel reports it eligible."""
    if not _THP.exists() or "[never]" in _THP.read_text():
        pytest.skip("transparent huge pages are off on this machine")
    fields = _mapping_of(tensor.data_ptr())
    if "THPeligible" not in fields:
        pytest.skip("this kernel's smaps does not report THPeligible")
    assert fields["THPeligible"] == "1", fields


def test_zeros_start_on_a_huge_page_and_hold_what_is_written() -> None:
    pool = host_memory.zeros((3, 5, 1 << 18), torch.float32)  # 15 MB
    assert pool.shape == (3, 5, 1 << 18) and pool.dtype == torch.float32 and pool.is_contiguous()
    assert pool.data_ptr() % host_memory.HUGE_PAGE == 0
    assert not pool.any()
    pool[1, 2].fill_(1.5)
    assert pool.sum().item() == 1.5 * (1 << 18)
    _assert_huge_page_eligible(pool)
    assert host_memory.zeros((0, 4), torch.bfloat16).shape == (0, 4)


def test_arena_copies_are_contiguous_aligned_and_outlive_the_arena() -> None:
    arena = host_memory.Arena()
    sources = [torch.randn(37, 11), torch.randn(64, 3).t(), torch.randn(5).to(torch.bfloat16),
               torch.randn(17 << 20)]  # the last one (68 MB) is larger than a chunk: a mapping of its own
    copies = [arena.copy(source) for source in sources]
    del arena
    gc.collect()
    spans = []
    for source, copy in zip(sources, copies):
        assert copy.is_contiguous() and copy.dtype == source.dtype and torch.equal(copy, source)
        assert copy.data_ptr() % 64 == 0
        spans.append((copy.data_ptr(), copy.data_ptr() + copy.numel() * copy.element_size()))
        _assert_huge_page_eligible(copy)
    spans.sort()
    assert all(end <= start for (_, end), (start, _) in zip(spans, spans[1:])), "copies overlap"
    # the first three share one mapping, in the order they were copied
    assert copies[0].data_ptr() < copies[1].data_ptr() < copies[2].data_ptr() < copies[0].data_ptr() + (64 << 20)


def test_runner_weights_and_kv_pool_are_on_huge_page_mappings(tiny_runner: LoadedModel) -> None:
    runner = tiny_runner.fast
    assert runner is not None
    if not gemm.kernel_available():
        pytest.skip("no GEMM kernel here: the weights stay as torch gave them")
    linears = [lin for layer in runner.layers for lin in (layer.qkv, layer.o, layer.gate, layer.up, layer.down)]
    for linear in [*linears, runner.lm_head]:
        assert linear.weight.blocked
        _assert_huge_page_eligible(linear.weight.data)
    # one after another, in the order a step reads them
    starts = [linear.weight.data.data_ptr() for linear in linears]
    assert starts == sorted(starts)
    cache = PagedKVCache(num_layers=2, num_blocks=512, num_kv_heads=2, head_dim=64, dtype=torch.float32,
                         device=torch.device("cpu"))  # 8 MB: a mapping smaller than 2 MB is never eligible
    assert not cache.kv.any()
    _assert_huge_page_eligible(cache.kv)
