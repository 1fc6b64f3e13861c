"""Prefix reuse: the cache's bookkeeping, prompts that hit it getting exactly their own KV and first token, and
prefix-aware routing in a real cluster."""

from __future__ import annotations

import asyncio
import signal
import threading
import tracemalloc
from array import array
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
import xxhash
from hypothesis import given, settings
from hypothesis import strategies as st

from engine.core import EngineCore
from engine.prompts import Abandoned, Prefilled
from gateway.prefix_index import PrefixIndex
from gateway.workers import Pool
from model_runner import forward
from model_runner.loading import LoadedModel
from model_runner.prefix_cache import PrefixCache
from pdserve.client import generate
from pdserve.cluster import Cluster
from protos import worker_pb2
from protos.types import block_names
from serving.metrics import scrape
from tests.helpers import Recorder, assert_nothing_held, hf_greedy, start_cluster, wait_until, worker_info

BLOCK = 4
LAYERS, HEADS, DIM = 2, 1, 2
BLOCK_BYTES = LAYERS * 2 * HEADS * BLOCK * DIM * 4  # float32


def _kv(tokens: list[int]) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Fake KV whose every value names its token, so a block's content can be checked."""
    keys = torch.tensor(tokens, dtype=torch.float32)[None, :, None].expand(HEADS, len(tokens), DIM)
    return [(keys + layer, -keys - layer) for layer in range(LAYERS)]


def test_a_match_is_the_longest_cached_block_prefix_and_leaves_a_token_to_compute() -> None:
    cache = PrefixCache(BLOCK, budget_bytes=100 * BLOCK_BYTES)
    prompt = list(range(10, 22))  # 3 full blocks
    assert cache.match(prompt) == []
    assert cache.insert(prompt, _kv(prompt)) == 3
    assert len(cache.match(prompt)) == 2  # the third block would leave nothing to compute: the last token runs
    longer = prompt + [99, 98]
    hit = cache.match(longer)
    assert len(hit) == 3 and torch.equal(hit[2].kv[1, 0, 0, :, 0], torch.tensor([18.0, 19, 20, 21]) + 1)
    assert len(cache.match(prompt[:8] + [0, 0, 0, 0, 0])) == 2  # diverges in the third block
    assert cache.match([0] + prompt) == []  # the same tokens, shifted: a different prefix
    assert cache.insert(longer, _kv(longer)) == 0  # its full blocks are cached already


def test_eviction_takes_the_least_recent_leaves_first_and_keeps_shared_roots() -> None:
    cache = PrefixCache(BLOCK, budget_bytes=4 * BLOCK_BYTES)
    root = [1, 2, 3, 4]
    first, second = root + [5, 6, 7, 8, 9, 10, 11, 12], root + [20, 21, 22, 23]
    cache.insert(first, _kv(first))  # 3 blocks
    cache.insert(second, _kv(second))  # 1 new block: 4 in all, the budget
    third = root + [30, 31, 32, 33]
    cache.insert(third, _kv(third))  # over budget: `first`'s deepest block goes, never the shared root
    assert cache.bytes == 4 * BLOCK_BYTES
    assert len(cache.match(first + [0])) == 2 and len(cache.match(second + [0])) == 2
    assert len(cache.match(third + [0])) == 2


@settings(max_examples=60, deadline=None)
@given(st.lists(st.tuples(st.integers(0, 3), st.integers(1, 14)), min_size=1, max_size=25),
       st.integers(0, 9))
def test_the_cache_never_exceeds_its_byte_budget(prompts: list[tuple[int, int]], budget_blocks: int) -> None:
    cache = PrefixCache(BLOCK, budget_bytes=budget_blocks * BLOCK_BYTES)
    for prefix, length in prompts:  # four shared prefixes, various lengths: hits, partial hits and evictions
        tokens = [prefix * 100 + i for i in range(length)]
        cache.match(tokens)
        cache.insert(tokens, _kv(tokens))
        assert cache.bytes <= cache.budget_bytes
        assert cache.bytes == len(cache) * BLOCK_BYTES
        # what a later prompt would reuse is this prompt's own KV, though slots were freed and reused on the way
        for i, block in enumerate(cache.match(tokens + [-1])):
            assert torch.equal(block.kv[1, 1, 0, :, 0], -torch.tensor(tokens[i * BLOCK : (i + 1) * BLOCK]) - 1.0)


def test_blocks_live_in_one_pool_whose_slots_are_reused_so_it_stays_within_the_budget() -> None:
    cache = PrefixCache(BLOCK, budget_bytes=3 * BLOCK_BYTES)
    assert cache.pool_bytes == 0  # nothing is mapped before the first insert
    for start in range(0, 400, 8):  # 50 prompts of 2 blocks each through a cache of 3: evictions all along
        prompt = list(range(start, start + 8))
        assert cache.insert(prompt, _kv(prompt)) == 2
        assert cache.pool_bytes == (3 if start else 2) * BLOCK_BYTES
    last = cache.match(list(range(392, 400)) + [0])  # the last prompt's blocks hold its own KV
    assert [torch.equal(block.kv[0, 0, 0, :, 0], torch.arange(392.0 + 4 * i, 396 + 4 * i))
            for i, block in enumerate(last)] == [True, True]
    # every block's KV is a view of the same pool, not a tensor of its own
    storages = {block.kv.untyped_storage().data_ptr() for block in cache._blocks.values()}
    assert len(storages) == 1


def test_a_prompt_longer_than_the_cache_keeps_its_shallowest_blocks_with_their_own_kv() -> None:
    cache = PrefixCache(BLOCK, budget_bytes=2 * BLOCK_BYTES)
    prompt = list(range(500, 516))  # 4 blocks through 2 slots: the deepest two are placed, then evicted again
    assert cache.insert(prompt, _kv(prompt)) == 4
    hit = cache.match(prompt + [0])
    assert len(hit) == 2 and len(cache) == 2 and cache.pool_bytes == 2 * BLOCK_BYTES
    for i, block in enumerate(hit):
        assert torch.equal(block.kv[0, 0, 0, :, 0], torch.arange(500.0 + 4 * i, 504 + 4 * i))


def test_a_cache_of_one_block_keeps_the_root() -> None:
    cache = PrefixCache(BLOCK, budget_bytes=BLOCK_BYTES)
    prompt = list(range(600, 612))
    assert cache.insert(prompt, _kv(prompt)) == 3
    (root,) = cache.match(prompt + [0])  # the block a later prompt can start from
    assert torch.equal(root.kv[0, 0, 0, :, 0], torch.arange(600.0, 604))


def test_an_evicted_block_a_queued_prompt_holds_keeps_its_slot_until_released() -> None:
    cache = PrefixCache(BLOCK, budget_bytes=2 * BLOCK_BYTES)
    first = list(range(100, 108))
    cache.insert(first, _kv(first))
    held = cache.match(first + [0])  # a queued prompt counts on both blocks
    second = list(range(200, 208))
    assert cache.insert(second, _kv(second)) == 0  # both of first's blocks are evicted, but their slots are held
    assert len(cache) == 0 and cache.bytes == 0 and cache.pool_bytes == 2 * BLOCK_BYTES
    for i, block in enumerate(held):  # still first's KV, not overwritten by second's
        assert torch.equal(block.kv[1, 1, 0, :, 0], -torch.tensor(range(100 + 4 * i, 104 + 4 * i)) - 1.0)
    del held, block  # the prompt ran: the slots are free again
    assert cache.insert(second, _kv(second)) == 2
    assert len(cache.match(second + [0])) == 2 and cache.pool_bytes == 2 * BLOCK_BYTES


def test_an_insert_that_fails_part_way_leaves_no_block_without_its_kv() -> None:
    cache = PrefixCache(BLOCK, budget_bytes=4 * BLOCK_BYTES)
    prompt = list(range(700, 708))
    broken = _kv(prompt)
    broken[1] = (broken[1][0][:, :3], broken[1][1][:, :3])  # the second layer's KV is cut short: its copy fails
    with pytest.raises(RuntimeError):
        cache.insert(prompt, broken)
    assert len(cache) == 0 and cache.bytes == 0 and cache.match(prompt + [0]) == []
    assert cache.insert(prompt, _kv(prompt)) == 2  # the slots are free again
    assert torch.equal(cache.match(prompt + [0])[1].kv[1, 0, 0, :, 0], torch.arange(704.0, 708) + 1)


def test_kv_of_another_shape_is_refused() -> None:
    cache = PrefixCache(BLOCK, budget_bytes=4 * BLOCK_BYTES)
    prompt = list(range(8))
    cache.insert(prompt, _kv(prompt))
    with pytest.raises(ValueError, match="prefix cache: KV of shape"):
        cache.insert([9] * 8, [(keys.double(), values.double()) for keys, values in _kv(prompt)])


def _assert_its_own(runner: LoadedModel, recorder: Recorder, outcome: Prefilled) -> None:
    """The prompt's delivered KV and first token are those of the same prompt prefilled alone, with no cache."""
    logits, kv = forward.prefill(runner, recorder.job.token_ids)
    assert outcome.first_token == int(torch.argmax(logits))
    assert sorted(recorder.layers) == list(range(len(kv)))
    for layer, (keys, values) in enumerate(kv):
        torch.testing.assert_close(recorder.layers[layer][0], keys, atol=1e-4, rtol=1e-4)
        torch.testing.assert_close(recorder.layers[layer][1], values, atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("layer_streaming", [True, False], ids=["streamed", "after-pass"])
def test_hits_partial_hits_and_evictions_give_each_prompt_exactly_its_own_kv_and_first_token(
    runner: LoadedModel, layer_streaming: bool
) -> None:
    system = list(range(1000, 1040))  # 40 tokens: 2 blocks of 16, and 8 more
    block_bytes = runner.spec.kv_bytes_per_token * 16
    cache = PrefixCache(16, budget_bytes=5 * block_bytes)  # small: the later prompts evict earlier blocks
    engine = EngineCore(runner, chunk_tokens=32, layer_streaming=layer_streaming, prefix_cache=cache)
    engine.start()
    prompts = [
        (system + [5, 6, 7], 0),  # cold: computes all 43, caches 2 blocks
        (system + [8, 9], 32),  # hit: both blocks
        (system[:20] + [3] * 30, 16),  # partial hit: diverges in the second block
        (list(range(3000, 3050)), 0),  # another prefix: 3 new blocks; the cache holds 5, so 2 are evicted
        (system + [1, 2, 3, 4], 16),  # the system prompt's second block went (least recent), its root did not
    ]
    try:
        for prompt, expected_cached in prompts:
            recorder = Recorder(prompt)
            engine.submit(recorder.job)
            outcome = recorder.wait()
            assert isinstance(outcome, Prefilled), outcome
            assert outcome.cached_tokens == expected_cached
            assert recorder.job.prefix == []  # its first pass copied the blocks and let their slots go
            _assert_its_own(runner, recorder, outcome)
            assert cache.bytes <= cache.budget_bytes
        assert (engine.queued_tokens, engine.live_jobs) == (0, 0)
    finally:
        engine.close()


@pytest.fixture
def cached_engine(runner: LoadedModel) -> Iterator[tuple[EngineCore, PrefixCache]]:
    """An engine with a roomy prefix cache, running 16-token chunks: 48 tokens are three passes and three blocks."""
    cache = PrefixCache(16, budget_bytes=1 << 30)
    engine = EngineCore(runner, chunk_tokens=16, prefix_cache=cache)
    engine.start()
    yield engine, cache
    engine.close()


def test_prompts_queued_together_reuse_the_prefix_the_first_one_computes(
    runner: LoadedModel, cached_engine: tuple[EngineCore, PrefixCache]
) -> None:
    engine, _ = cached_engine
    system = list(range(600, 640))  # 2 full blocks and 8 tokens
    hold = threading.Event()
    blocker = Recorder([1, 2, 3], hold)
    engine.submit(blocker.job)
    assert blocker.entered.wait(30)
    burst = [Recorder(system + [n] * 10) for n in (7, 8, 9)]  # a burst: all miss when they arrive
    for recorder in burst:
        engine.submit(recorder.job)
    hold.set()
    outcomes = [recorder.wait() for recorder in burst]
    assert all(isinstance(o, Prefilled) for o in outcomes)
    # The first computes the prefix; the others look again as they start, and find it.
    assert [o.cached_tokens for o in outcomes] == [0, 32, 32]  # type: ignore[union-attr]
    for recorder, outcome in zip(burst, outcomes):
        _assert_its_own(runner, recorder, outcome)  # type: ignore[arg-type]
    assert (engine.queued_tokens, engine.live_jobs) == (0, 0)


def test_a_cancelled_prompt_leaves_no_entry(cached_engine: tuple[EngineCore, PrefixCache]) -> None:
    engine, cache = cached_engine
    hold = threading.Event()
    doomed = Recorder(list(range(500, 548)), hold)  # 3 chunks; held inside its last chunk's first layer
    engine.submit(doomed.job)
    assert doomed.entered.wait(30)
    doomed.job.abandon.set()  # cancelled mid-pass
    hold.set()
    assert isinstance(doomed.wait(), Abandoned)
    assert (len(cache), cache.bytes) == (0, 0)  # nothing half-built
    kept = Recorder(list(range(500, 548)))
    engine.submit(kept.job)
    assert isinstance(kept.wait(), Prefilled) and len(cache) == 3


def test_the_gateway_s_prefix_index_keeps_its_capacity_and_reports_what_it_holds() -> None:
    index = PrefixIndex(capacity=1000)
    prompts = [list(range(start, start + 10 * BLOCK)) for start in range(0, 300 * 10 * BLOCK, 10 * BLOCK)]
    tracemalloc.start()
    try:
        before = tracemalloc.get_traced_memory()[0]
        for prompt in prompts:  # 300 prompts of 10 blocks: 3,000 names through an index of 1,000
            index.record("prefill-a", block_names(prompt, BLOCK))
        held = tracemalloc.get_traced_memory()[0] - before
    finally:
        tracemalloc.stop()
    assert index.best([("prefill-a", block_names(prompts[-1], BLOCK))]) == "prefill-a"
    assert index.best([("prefill-a", block_names(prompts[0], BLOCK))]) is None  # forgotten, least recent first
    assert index.nbytes == pytest.approx(held, rel=0.1)  # the gauge the soak takes as a bounded cache


def test_block_names_chain_from_the_start() -> None:
    a, b = block_names([1, 2, 3, 4, 5, 6, 7, 8], 4), block_names([9, 9, 9, 9, 5, 6, 7, 8], 4)
    assert len(a) == 2 and a[1] != b[1]  # equal blocks after different prefixes have different names
    assert block_names([1, 2, 3], 4) == []


def test_salts_name_every_block_apart_and_no_salt_names_blocks_as_before() -> None:
    tokens = list(range(100, 112))
    chain, unsalted = b"", []  # the names without salt: the chain from b"", as gateways and workers always made it
    for start in range(0, 12, BLOCK):
        chain = xxhash.xxh3_128_digest(chain + array("q", tokens[start : start + BLOCK]).tobytes())
        unsalted.append(chain)
    assert block_names(tokens, BLOCK) == block_names(tokens, BLOCK, "") == block_names(tokens, BLOCK, b"") == unsalted
    a, b = block_names(tokens, BLOCK, "tenant-a"), block_names(tokens, BLOCK, "tenant-b")
    assert len(a) == len(b) == 3 and a == block_names(tokens, BLOCK, b"tenant-a")
    assert not set(a) & set(b) and not set(a) & set(unsalted)  # not one block name in common, the root's included


def test_a_prefix_cached_under_one_salt_is_a_miss_under_any_other() -> None:
    cache = PrefixCache(BLOCK, budget_bytes=100 * BLOCK_BYTES)
    prompt = list(range(10, 22))  # 3 full blocks
    assert cache.insert(prompt, _kv(prompt), salt="a") == 3
    assert cache.match(prompt + [0], "b") == [] and cache.match(prompt + [0]) == []
    assert len(cache.match(prompt + [0], "a")) == 3
    assert cache.insert(prompt, _kv(prompt), salt="b") == 3  # b computes and keeps its own copy
    assert len(cache.match(prompt + [0], "b")) == 3 and len(cache) == 6


def test_the_engine_reuses_a_prefix_only_under_the_salt_that_cached_it(
    runner: LoadedModel, cached_engine: tuple[EngineCore, PrefixCache]
) -> None:
    engine, _ = cached_engine
    system = list(range(700, 740))  # 2 full blocks and 8 tokens

    def cached(salt: str, question: int) -> int:
        recorder = Recorder(system + [question] * 10)
        recorder.job.cache_salt = salt
        engine.submit(recorder.job)
        outcome = recorder.wait()
        assert isinstance(outcome, Prefilled), outcome
        _assert_its_own(runner, recorder, outcome)
        return outcome.cached_tokens

    # a's prompt is cached; b, sending the same prefix, is told nothing of it; a still finds it
    assert [cached("a", 1), cached("b", 2), cached("a", 3), cached("", 4), cached("b", 5)] == [0, 0, 32, 0, 32]
    assert (engine.queued_tokens, engine.live_jobs) == (0, 0)


def test_the_gateway_routes_a_prompt_by_its_own_salt_s_prefixes_only() -> None:
    async def scenario() -> None:
        pool = Pool("prefill", ["127.0.0.1:9000", "127.0.0.1:9001"], prefix_balance_tokens=1000)
        for worker in pool.workers:
            worker.info = worker_pb2.WorkerInfo(role="prefill", prefix_block_tokens=16)
        prompt = list(range(5000, 5100))
        home = pool.in_turn(prompt=prompt, cache_salt="a")[0]  # both idle: a's prefix goes to whichever is first
        other = next(w for w in pool.workers if w is not home)
        assert home.info is not None
        home.info.queued_tokens = 100  # busier, within the balance: a's prefix still draws a's requests there
        assert pool.in_turn(prompt=prompt, cache_salt="a")[0] is home
        # b's same prompt goes by load alone: b's names match none of a's, so the index points nowhere
        assert pool.prefixes.best([(home.address, block_names(prompt, 16, "b"))]) is None
        assert pool.in_turn(prompt=prompt, cache_salt="b")[0] is other
        assert pool.in_turn(prompt=prompt, cache_salt="")[0] is other  # nor does the unsalted namespace see a's
        await pool.close()

    asyncio.run(scenario())


SYSTEM = list(range(2000, 2100))  # 100 tokens shared by every request below


def _prefill_tokens(cluster: Cluster) -> list[float]:
    return [scrape(worker.metrics)["pdserve_prompt_tokens_total"] for worker in cluster.prefill]


def test_shared_prefixes_land_on_the_worker_that_has_them_until_it_is_too_far_ahead(tiny_model_dir: Path) -> None:
    # Polls are rare here: the routing under test reads the gateway's own in-flight counts, not a poll.
    cluster = start_cluster(tiny_model_dir, prefill=2, decode=1, decode_args=("--max-seqs=8",),
                            gateway_args=("--prefix-balance-tokens=150", "--poll-interval=60"))
    try:
        address = cluster.gateway.address
        for question in range(4):  # one at a time: each finds the prefix where the first one left it
            completion = generate(address, 60, token_ids=SYSTEM + [question + 1] * 10, max_tokens=2, temperature=0)
            assert completion.usage.cached_tokens == (0 if question == 0 else 96)  # type: ignore[union-attr]
        counts = _prefill_tokens(cluster)
        home = max(range(2), key=lambda i: counts[i])
        assert counts[home] == 4 * 110 and counts[1 - home] == 0  # the other worker idled: no need to spill

        # Freeze the home worker: requests sent there stay in flight, so its load grows with each one.
        cluster.prefill[home].process.send_signal(signal.SIGSTOP)
        results: dict[int, object] = {}

        def ask(n: int) -> None:
            results[n] = generate(address, 60, token_ids=SYSTEM + [50 + n] * 10, max_tokens=2, temperature=0)

        # Each request is routed before the next is sent. The gateway picks a prefill worker as decode's reservation
        # reply reaches it, with no await between, so a live reservation on decode means the pick is made: 0 and 1
        # wait for the frozen worker with their reservations live; 2 is prefilled on the other worker.
        def routed(n: int) -> bool:
            if n < 2:
                return worker_info(cluster.decode[0]).live_reservations == n + 1
            return scrape(cluster.prefill[1 - home].metrics)["pdserve_prompt_tokens_total"] == 110

        threads = []
        for n in range(4):
            threads.append(threading.Thread(target=ask, args=(n,)))
            threads[-1].start()
            if n < 3:
                wait_until(lambda: routed(n), f"request {n} to be routed", timeout_s=30)  # noqa: B023 (called now)
        # 0 goes home (0 queued vs 0); 1 too (110 <= 0 + 150); 2 spills (220 > 0 + 150), and 3 follows it to
        # the worker that has the prefix now and is less loaded. Both finish while home is frozen.
        threads[2].join(30)
        threads[3].join(30)
        assert sorted(results) == [2, 3]
        other = scrape(cluster.prefill[1 - home].metrics)  # (the frozen worker cannot answer a scrape)
        assert other["pdserve_prompt_tokens_total"] == 2 * 110 and other["pdserve_prefix_cache_hits_total"] == 96
        cluster.prefill[home].process.send_signal(signal.SIGCONT)
        for thread in threads:
            thread.join(60)
        assert sorted(results) == [0, 1] + [2, 3]
        assert _prefill_tokens(cluster)[home] == 6 * 110
        assert_nothing_held(cluster)
    finally:
        for worker in cluster.prefill:
            worker.process.send_signal(signal.SIGCONT)
        cluster.stop()


def test_greedy_outputs_with_hits_and_partial_hits_match_hugging_face(tiny_cluster: Cluster,
                                                                       tiny_model_dir: Path) -> None:
    system = list(range(4000, 4050))  # 50 tokens: 3 full blocks
    prompts = [system + [7, 8, 9], system + [10, 11], system[:24] + [12] * 20, system + [7, 8, 9]]
    cached = []
    for prompt in prompts:  # a miss, a hit, a partial hit, the first prompt again (a hit)
        completion = generate(tiny_cluster.gateway.address, 60, token_ids=prompt, max_tokens=12, temperature=0,
                              ignore_eos=True)
        assert completion.token_ids == hf_greedy(tiny_model_dir, prompt, 12)  # the reference: no cache at all
        cached.append(completion.usage.cached_tokens)  # type: ignore[union-attr]
    assert cached == [0, 48, 16, 48]
    # the worker's cache holds these blocks in its pool, which is resident only as far as it has been written
    held = [scrape(worker.metrics) for worker in tiny_cluster.prefill]
    assert sum(m["pdserve_prefix_cache_blocks"] for m in held) >= 3 + 1  # the system prompt's, the partial hit's
    for metrics in held:
        assert 0 <= metrics["pdserve_prefix_cache_bytes"] <= metrics["pdserve_prefix_cache_pool_bytes"] < 64 << 20
    assert_nothing_held(tiny_cluster)
