"""A prompt or sequence whose logits cannot be sampled fails alone and exactly once; its pass or batch goes on,
and the engine holds nothing for it afterwards."""

from __future__ import annotations

import threading

import pytest
import torch

import engine.batch as batch_module
import engine.prompts as prompts_module
from engine.core import EngineCore
from engine.prompts import Prefilled, PromptJob
from engine.sequence import FAILED, Sequence
from model_runner import forward
from model_runner.loading import LoadedModel
from model_runner.paged_cache import PagedKVCache, pieces_of
from model_runner.sampling import sample
from protos.types import SamplingParams

POISON = 7777  # a prompt that starts with this token gets NaN logits from the wrapped forward pass
SAMPLED = SamplingParams(temperature=0.8, seed=3)  # NaN logits make multinomial raise
MAX_TOKENS = 6


def _poisoned_prefill_pass(passes: list[list[int]]):  # type: ignore[no-untyped-def]
    """The real prefill pass, whose logits are NaN in the rows of prompts that start with POISON."""

    def poisoned(runner: LoadedModel, prompts: list[list[int]], cache: object) -> torch.Tensor:
        passes.append([len(prompt) for prompt in prompts])
        logits = forward.prefill_pass(runner, prompts, cache).clone()  # type: ignore[arg-type]
        for row, prompt in enumerate(prompts):
            if prompt[0] == POISON:
                logits[row] = torch.nan
        return logits

    return poisoned


class _Outcomes:
    """A prefill job that keeps every outcome it is given; `hold` blocks the engine inside its first delivery."""

    def __init__(self, prompt: list[int], hold: threading.Event | None = None) -> None:
        self.outcomes: list[Prefilled | BaseException] = []
        self.finished, self.entered, self.hold = threading.Event(), threading.Event(), hold
        self.job = PromptJob(prompt, SAMPLED, self._deliver, self._finish)

    def _deliver(self, layer: int, keys: torch.Tensor, values: torch.Tensor) -> None:
        self.entered.set()
        if self.hold is not None:
            self.hold.wait(30)

    def _finish(self, outcome: Prefilled | BaseException) -> None:
        self.outcomes.append(outcome)
        self.finished.set()


def test_a_prompt_whose_first_token_cannot_be_sampled_fails_alone_and_once(
    tiny_runner: LoadedModel, monkeypatch: pytest.MonkeyPatch
) -> None:
    passes: list[list[int]] = []
    monkeypatch.setattr(prompts_module, "prefill_pass", _poisoned_prefill_pass(passes))
    engine = EngineCore(tiny_runner, batch_tokens=256)
    engine.start()
    try:
        # 1. Hold the engine inside a pass, so the next three prompts queue up and share one pass.
        hold = threading.Event()
        blocker = _Outcomes([1, 2, 3], hold)
        engine.submit(blocker.job)
        assert blocker.entered.wait(30)
        good, poisoned, other = _Outcomes([11, 12, 13, 14]), _Outcomes([POISON, 21, 22]), _Outcomes([31, 32])
        for recorder in (good, poisoned, other):
            engine.submit(recorder.job)
        # 2. Release it: the poisoned row sits between two good ones.
        hold.set()
        for recorder in (blocker, good, poisoned, other):
            assert recorder.finished.wait(60)
    finally:
        engine.close()  # joins the engine thread: any second finish has happened by now
    assert [4, 3, 2] in passes
    # 3. The good rows got their first token, the poisoned one an error; each exactly once.
    assert [type(o) for o in good.outcomes] == [type(o) for o in other.outcomes] == [Prefilled]
    assert len(poisoned.outcomes) == 1 and not isinstance(poisoned.outcomes[0], Prefilled)
    # 4. Nothing held: a double finish would have driven these below zero.
    assert (engine.queued_tokens, engine.live_jobs) == (0, 0)


class _Stream:
    """A decode sequence that keeps every emission's tokens and finish reason."""

    def __init__(self, prompt: list[int], sampling: SamplingParams = SAMPLED) -> None:
        self.prompt = prompt
        self.tokens: list[int] = []
        self.reasons: list[str] = []  # the non-empty finish reasons, in order: exactly one when it ended once
        self.done = threading.Event()
        self.seq = Sequence(request_id=f"seq-{prompt[0]}", prompt_len=len(prompt), max_tokens=MAX_TOKENS,
                            sampling=sampling, stop_token_ids=frozenset(), emit=self._emit)

    def _emit(self, token_ids: list[int], reason: str) -> None:
        self.tokens += token_ids
        if reason:
            self.reasons.append(reason)
            self.done.set()


@pytest.mark.parametrize("sampling", [SAMPLED, SamplingParams(temperature=0.0)], ids=["sampled", "greedy"])
def test_a_sequence_whose_next_token_cannot_be_sampled_fails_alone_and_the_batch_goes_on(
    tiny_runner: LoadedModel, monkeypatch: pytest.MonkeyPatch, sampling: SamplingParams
) -> None:
    """Greedy rows are picked for the whole batch at once (engine/batch.py `_greedy_picks`): a NaN row among them
    must still fail alone."""
    poisoned_from = 40  # only the 40-token prompt's rows reach this position (the others end before 22)

    def poisoned_step(runner: LoadedModel, cache: PagedKVCache, input_ids: list[int], tables: list[list[int]],
                      lengths: list[int]) -> torch.Tensor:
        logits = forward.decode_step(runner, cache, input_ids, tables, lengths).clone()
        for row, length in enumerate(lengths):
            if length >= poisoned_from:
                logits[row] = torch.nan
        return logits

    monkeypatch.setattr(batch_module, "decode_step", poisoned_step)
    engine = EngineCore(tiny_runner, kv_blocks=64)
    # 1. Three sequences with their prefilled KV, all queued before the engine starts: they join one batch.
    streams = [_Stream(prompt, sampling)
               for prompt in ([1, 17, 4242, 99, 7], list(range(300, 340)), list(range(500, 510)))]
    for stream in streams:
        logits, kv = forward.prefill(tiny_runner, stream.prompt)
        stream.tokens = [sample(logits, SAMPLED, position=len(stream.prompt))]
        stream.seq.tokens = list(stream.tokens)
        engine.submit_kv(stream.seq, pieces_of(kv), release=lambda: None)
    engine.start()
    try:
        for stream in streams:
            assert stream.done.wait(60)
    finally:
        engine.close()
    good, poisoned, other = streams
    # 2. The poisoned sequence failed at its first step; the other two decoded to the end, each finished once.
    assert poisoned.reasons == [FAILED] and len(poisoned.tokens) == 1
    for stream in (good, other):
        assert stream.reasons == ["length"] and len(stream.tokens) == MAX_TOKENS
    # 3. Nothing held.
    assert engine.live_sequences == 0 and engine.running == 0


def test_a_colocated_prompt_whose_first_token_cannot_be_sampled_fails_alone(
    tiny_runner: LoadedModel, monkeypatch: pytest.MonkeyPatch
) -> None:
    passes: list[list[int]] = []
    monkeypatch.setattr(prompts_module, "prefill_pass", _poisoned_prefill_pass(passes))
    engine = EngineCore(tiny_runner, kv_blocks=64)
    # 1. Three prompts queued before the engine starts share one prefill pass; the poisoned one is in the middle.
    streams = [_Stream(prompt) for prompt in ([1, 17, 4242, 99, 7], [POISON, 5, 6], list(range(500, 510)))]
    for stream in streams:
        engine.submit_prompt(stream.seq, stream.prompt)
    engine.start()
    try:
        for stream in streams:
            assert stream.done.wait(60)
    finally:
        engine.close()
    assert [5, 3, 10] in passes
    good, poisoned, other = streams
    # 2. The poisoned prompt failed without a token; the first row, admitted before it, was not failed again.
    assert poisoned.reasons == [FAILED] and poisoned.tokens == []
    for stream in (good, other):
        assert stream.reasons == ["length"] and len(stream.tokens) == MAX_TOKENS
    # 3. Nothing held.
    assert engine.live_sequences == 0 and engine.running == 0
