"""The prefill engine in-process: what each pass runs, and that batching and chunking change no prompt's KV."""

from __future__ import annotations

import threading

import pytest
import torch

import engine.prompts as prompts_module
from engine.core import EngineCore
from engine.prompts import Abandoned, Prefilled, PromptJob, QueueFull
from engine.scheduler import PromptScheduler
from model_runner import forward
from model_runner.loading import LoadedModel
from model_runner.prefix_cache import PrefixCache
from protos.types import SamplingParams
from tests.helpers import Recorder

GREEDY = SamplingParams(temperature=0.0)


def _job(length: int) -> PromptJob:
    return PromptJob(list(range(1, length + 1)), GREEDY, lambda *_: None, lambda _: None)


def _lengths(jobs: list[PromptJob]) -> list[int]:
    return [len(job.token_ids) for job in jobs]


def test_short_prompts_share_a_pass_while_the_padded_batch_fits() -> None:
    scheduler: PromptScheduler[PromptJob] = PromptScheduler(batch_tokens=120, chunk_tokens=64)
    for length in (30, 40, 50, 10, 20):
        scheduler.add(_job(length))
    # 30, 40 pad to 2 x 40; 50 would make 3 x 50 > 120; 10 fits (3 x 40); 20 would make 4 x 40 > 120
    assert _lengths(scheduler.next_pass()) == [30, 40, 10]
    assert _lengths(scheduler.next_pass()) == [50, 20]
    assert scheduler.next_pass() == []


def test_a_prompt_wider_than_the_batch_budget_runs_alone() -> None:
    scheduler: PromptScheduler[PromptJob] = PromptScheduler(batch_tokens=16, chunk_tokens=64)
    for length in (40, 8):
        scheduler.add(_job(length))
    assert _lengths(scheduler.next_pass()) == [40]
    assert _lengths(scheduler.next_pass()) == [8]


def test_long_prompts_take_turns_with_short_ones_and_run_oldest_first() -> None:
    scheduler: PromptScheduler[PromptJob] = PromptScheduler(batch_tokens=64, chunk_tokens=32)
    first_long, second_long = _job(100), _job(90)
    scheduler.add(first_long)
    scheduler.add(second_long)
    assert scheduler.next_pass() == [first_long]  # the oldest long prompt, one chunk at a time
    scheduler.add(_job(10))
    assert _lengths(scheduler.next_pass()) == [10]  # a short one waits one chunk, not the whole prompt
    scheduler.add(_job(12))
    assert scheduler.next_pass() == [first_long]  # ... and a stream of short ones never starves the long one
    assert _lengths(scheduler.next_pass()) == [12]
    assert scheduler.next_pass() == [first_long]
    scheduler.finished_long(first_long)
    assert scheduler.next_pass() == [second_long]


def test_abandoned_prompts_leave_the_queue() -> None:
    scheduler: PromptScheduler[PromptJob] = PromptScheduler(batch_tokens=64, chunk_tokens=32)
    kept, gone, gone_long = _job(5), _job(6), _job(50)
    for job in (kept, gone, gone_long):
        scheduler.add(job)
    gone.abandon.set()
    gone_long.abandon.set()
    assert scheduler.drop_abandoned() == [gone, gone_long]
    assert scheduler.next_pass() == [kept]
    assert len(scheduler) == 0


@pytest.mark.parametrize("layer_streaming", [True, False], ids=["streamed", "after-pass"])
def test_batched_and_chunked_prompts_get_exactly_their_own_kv_and_first_token(
    runner: LoadedModel, monkeypatch: pytest.MonkeyPatch, layer_streaming: bool
) -> None:
    passes: list[list[int]] = []

    def counting_pass(runner: LoadedModel, prompts: list[list[int]], cache: object) -> torch.Tensor:
        passes.append([len(prompt) for prompt in prompts])
        return forward.prefill_pass(runner, prompts, cache)  # type: ignore[arg-type]

    monkeypatch.setattr(prompts_module, "prefill_pass", counting_pass)
    engine = EngineCore(runner, batch_tokens=96, chunk_tokens=40, layer_streaming=layer_streaming)
    engine.start()
    try:
        hold = threading.Event()
        blocker = Recorder([1, 2, 3], hold)
        engine.submit(blocker.job)
        assert blocker.entered.wait(30) or blocker.finished.wait(30)
        prompts = [list(range(200, 213)), [504, 1095, 2208, 314, 3595, 28, 1090], list(range(900, 1000)),
                   list(range(5000, 5021))]
        recorders = [Recorder(prompt) for prompt in prompts]
        for recorder in recorders:  # all queued while the engine is held: they share passes
            engine.submit(recorder.job)
        hold.set()
        assert isinstance(blocker.wait(), Prefilled)
        for prompt, recorder in zip(prompts, recorders):
            outcome = recorder.wait()
            assert isinstance(outcome, Prefilled), outcome
            logits, kv = forward.prefill(runner, prompt)  # the same prompt alone
            assert outcome.first_token == int(torch.argmax(logits))
            assert sorted(recorder.layers) == list(range(len(kv)))
            for layer, (keys, values) in enumerate(kv):
                got_keys, got_values = recorder.layers[layer]
                assert got_keys.shape == keys.shape
                torch.testing.assert_close(got_keys, keys, atol=1e-4, rtol=1e-4)
                torch.testing.assert_close(got_values, values, atol=1e-4, rtol=1e-4)
        # 13 + 7 + 21 tokens shared one pass (3 x 21 <= 96); the 100-token prompt ran as chunks of 40
        assert [13, 7, 21] in passes
        assert passes.count([40]) == 2 and [20] in passes
        assert (engine.queued_tokens, engine.live_jobs) == (0, 0)
    finally:
        engine.close()


@pytest.mark.parametrize("layer_streaming", [True, False], ids=["streamed", "after-pass"])
def test_a_prompt_with_a_kv_home_is_computed_straight_into_it(runner: LoadedModel, layer_streaming: bool) -> None:
    """A home is where decode lent its shared-memory segment: the forward pass writes the prompt's KV there, and the
    layers delivered to the sender are views of it; for a prompt alone in its pass, one run as chunks, and one that
    continues a cached prefix."""
    spec = runner.spec
    engine = EngineCore(runner, chunk_tokens=40, layer_streaming=layer_streaming,
                           prefix_cache=PrefixCache(block_tokens=16, budget_bytes=64 << 20))
    engine.start()
    long = list(range(900, 1000))
    try:
        for prompt, cached in ((list(range(200, 213)), 0), (long, 0), ([*long, 5, 6, 7], 96)):
            shape = (spec.num_kv_heads, len(prompt), spec.head_dim)
            homes = [(torch.full(shape, torch.nan), torch.full(shape, torch.nan)) for _ in range(spec.num_layers)]
            recorder = Recorder(prompt)
            recorder.job.kv_home = homes
            engine.submit(recorder.job)
            outcome = recorder.wait()
            assert isinstance(outcome, Prefilled), outcome
            assert outcome.cached_tokens == cached
            logits, kv = forward.prefill(runner, prompt)  # the same prompt alone, into memory of its own
            assert outcome.first_token == int(torch.argmax(logits))
            for layer, ((keys, values), (home_keys, home_values)) in enumerate(zip(kv, homes)):
                assert recorder.addresses[layer] == (home_keys.data_ptr(), home_values.data_ptr())
                torch.testing.assert_close(home_keys, keys, atol=1e-4, rtol=1e-4)  # every position written
                torch.testing.assert_close(home_values, values, atol=1e-4, rtol=1e-4)
        assert (engine.queued_tokens, engine.live_jobs) == (0, 0)
    finally:
        engine.close()


def test_a_full_queue_refuses_and_abandoned_prompts_release_their_tokens(runner: LoadedModel) -> None:
    engine = EngineCore(runner, max_queued_tokens=30)
    engine.start()
    try:
        hold = threading.Event()
        blocker = Recorder([1] * 10, hold)
        engine.submit(blocker.job)
        assert blocker.entered.wait(30)
        queued = Recorder([2] * 15)
        engine.submit(queued.job)
        with pytest.raises(QueueFull, match="25 prompt tokens waiting or running, budget 30"):
            engine.submit(Recorder([3] * 6).job)
        queued.job.abandon.set()  # cancelled while it waits: it never runs
        engine.wake()
        hold.set()
        assert isinstance(blocker.wait(), Prefilled)
        assert isinstance(queued.wait(), Abandoned)
        assert queued.layers == {}
        assert (engine.queued_tokens, engine.live_jobs) == (0, 0)
        fits_now = Recorder([4] * 25)
        engine.submit(fits_now.job)
        assert isinstance(fits_now.wait(), Prefilled)
    finally:
        engine.close()


def test_a_long_prompt_abandoned_mid_chunk_stops_at_the_next_layer_and_sends_nothing(
    runner: LoadedModel, monkeypatch: pytest.MonkeyPatch
) -> None:
    long = Recorder(list(range(100, 300)))
    passes = 0

    def abandoning_pass(runner: LoadedModel, prompts: list[list[int]], cache: object) -> torch.Tensor:
        nonlocal passes
        passes += 1
        if passes == 2:
            long.job.abandon.set()  # the client leaves just as the second chunk starts
        return forward.prefill_pass(runner, prompts, cache)  # type: ignore[arg-type]

    monkeypatch.setattr(prompts_module, "prefill_pass", abandoning_pass)
    engine = EngineCore(runner, chunk_tokens=16)
    engine.start()
    try:
        engine.submit(long.job)
        assert isinstance(long.wait(), Abandoned)
        assert passes == 2  # the second chunk's pass raised at its first layer; 11 more never ran
        assert long.layers == {}
        assert (engine.queued_tokens, engine.live_jobs) == (0, 0)
    finally:
        engine.close()
