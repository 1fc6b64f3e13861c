"""The decode engine in-process: sequences joining and leaving a running batch decode exactly as they do alone."""

from __future__ import annotations

import threading
from collections.abc import Callable

import pytest
import torch

import engine.prompts as prompts_module
from engine.core import EngineCore
from engine.sequence import Sequence
from model_runner import forward
from model_runner.loading import LoadedModel
from model_runner.paged_cache import pieces_of
from model_runner.sampling import sample
from protos.types import SamplingParams

PROMPTS = [[1, 17, 4242, 99, 7], list(range(300, 340)), [504, 1095, 2208, 314, 3595, 28, 1090, 314, 260, 2632]]
MAX_TOKENS = 12


class _Stream:
    """One sequence in the engine, with its tokens as they are emitted."""

    def __init__(self, engine: EngineCore, runner: LoadedModel, prompt: list[int], sampling: SamplingParams,
                 name: str, at: dict[int, Callable[[], None]] | None = None, colocated: bool = False) -> None:
        self.tokens: list[int] = []
        self.finish = ""
        self.progress = threading.Condition()
        self.at = at or {}  # token count -> hook run on the engine thread, inside the step that reached it
        self.seq = Sequence(request_id=name, prompt_len=len(prompt), max_tokens=MAX_TOKENS, sampling=sampling,
                            stop_token_ids=frozenset(), emit=self._emit)
        if colocated:  # the engine prefills it
            engine.submit_prompt(self.seq, prompt)
            return
        logits, kv = forward.prefill(runner, prompt)
        self.tokens = [sample(logits, sampling, position=len(prompt))]
        self.seq.tokens = list(self.tokens)
        engine.submit_kv(self.seq, pieces_of(kv), release=lambda: None)

    def _emit(self, token_ids: list[int], reason: str) -> None:
        with self.progress:
            self.tokens += token_ids
            self.finish = reason
            self.progress.notify_all()
        if len(self.tokens) in self.at:
            self.at.pop(len(self.tokens))()

    def wait_for(self, count: int = 0) -> None:
        with self.progress:
            done = self.progress.wait_for(lambda: self.finish or (count and len(self.tokens) >= count), timeout=60)
        assert done, "the engine stopped emitting"


def _alone(runner: LoadedModel, prompt: list[int], sampling: SamplingParams) -> list[int]:
    engine = EngineCore(runner, kv_blocks=64)
    engine.start()
    try:
        stream = _Stream(engine, runner, prompt, sampling, "alone")
        stream.wait_for()
        return stream.tokens
    finally:
        engine.close()


@pytest.mark.parametrize("sampling", [SamplingParams(temperature=0.0), SamplingParams(temperature=0.9, seed=7)],
                         ids=["greedy", "seeded"])
def test_joining_and_leaving_a_running_batch_changes_no_sequence_tokens(runner: LoadedModel,
                                                                        sampling: SamplingParams) -> None:
    expected = [_alone(runner, prompt, sampling) for prompt in PROMPTS]
    assert all(len(tokens) == MAX_TOKENS for tokens in expected)
    engine = EngineCore(runner, kv_blocks=64)
    paused, resume = threading.Event(), threading.Event()

    def pause() -> None:  # holds the engine thread between two steps, so the joins land at a known step
        paused.set()
        assert resume.wait(30)

    engine.start()
    try:
        first = _Stream(engine, runner, PROMPTS[0], sampling, "first", at={4: pause})
        assert paused.wait(30)  # "first" has decoded alone for 3 steps
        leaver: _Stream | None = None
        leaver = _Stream(engine, runner, PROMPTS[1], sampling, "leaver",
                         at={3: lambda: engine.abort(leaver.seq)})  # type: ignore[union-attr]
        late = _Stream(engine, runner, PROMPTS[2], sampling, "late")
        resume.set()  # both join at the next step; the leaver leaves after its third token
        first.wait_for()
        late.wait_for()
    finally:
        engine.close()
    assert first.tokens == expected[0] and first.finish == "length"
    assert late.tokens == expected[2] and late.finish == "length"
    assert leaver.tokens == expected[1][:3] and not leaver.finish  # aborted: left without a finish
    assert engine.live_sequences == 0


def test_colocated_prompts_batched_or_chunked_decode_as_they_do_alone(runner: LoadedModel,
                                                                      monkeypatch: pytest.MonkeyPatch) -> None:
    sampling = SamplingParams(temperature=0.0)
    expected = [_alone(runner, prompt, sampling) for prompt in PROMPTS]
    passes: list[list[int]] = []

    def counting_pass(runner: LoadedModel, prompts: list[list[int]], cache: object) -> torch.Tensor:
        passes.append([len(prompt) for prompt in prompts])
        return forward.prefill_pass(runner, prompts, cache)  # type: ignore[arg-type]

    monkeypatch.setattr(prompts_module, "prefill_pass", counting_pass)
    engine = EngineCore(runner, kv_blocks=64, chunk_tokens=16)
    # all queued before the engine starts: the short two share a pass
    streams = [_Stream(engine, runner, prompt, sampling, f"colocated-{index}", colocated=True)
               for index, prompt in enumerate(PROMPTS)]
    engine.start()
    try:
        for stream in streams:
            stream.wait_for()
    finally:
        engine.close()
    assert [stream.tokens for stream in streams] == expected
    assert [5, 10] in passes and passes.count([16]) == 2 and [8] in passes  # 40 tokens in chunks of 16
    assert engine.live_sequences == 0


@pytest.mark.parametrize("budget_s, chunk", [(1e-6, prompts_module.MIN_CHUNK), (60.0, 256)],
                         ids=["tight", "roomy"])
def test_a_prompt_pass_budget_cuts_colocated_chunks_to_what_fits_and_decodes_the_same(
        runner: LoadedModel, monkeypatch: pytest.MonkeyPatch, budget_s: float, chunk: int) -> None:
    sampling = SamplingParams(temperature=0.0)
    expected = [_alone(runner, prompt, sampling) for prompt in PROMPTS]
    # 1. The engine times prompt passes at start and fits its chunks to the budget: none fits 1 us, so the
    #    smallest; all of the configured 256 fit 60 s.
    engine = EngineCore(runner, kv_blocks=64, chunk_tokens=256, prompt_pass_s=budget_s)
    passes: list[list[int]] = []

    def counting_pass(runner: LoadedModel, prompts: list[list[int]], cache: object) -> torch.Tensor:
        passes.append([len(prompt) for prompt in prompts])
        return forward.prefill_pass(runner, prompts, cache)  # type: ignore[arg-type]

    engine.start()
    monkeypatch.setattr(prompts_module, "prefill_pass", counting_pass)  # after the timed passes at start
    # 2. Colocated prompts of 5, 40 and 10 tokens run in passes of at most the fitted chunk
    try:
        streams = [_Stream(engine, runner, prompt, sampling, f"colocated-{index}", colocated=True)
                   for index, prompt in enumerate(PROMPTS)]
        for stream in streams:
            stream.wait_for()
    finally:
        engine.close()
    assert max(width for widths in passes for width in widths) <= chunk
    assert sum(sum(widths) for widths in passes) == sum(len(prompt) for prompt in PROMPTS)
    if chunk == prompts_module.MIN_CHUNK:
        assert passes.count([8]) == 6  # 40 tokens in 5 chunks, and the first 8 of the 10-token prompt
    # 3. Every stream decodes as it does alone, and nothing is held
    assert [stream.tokens for stream in streams] == expected
    assert engine.live_sequences == 0


def test_a_prompt_pass_budget_leaves_a_prefill_core_alone(tiny_runner: LoadedModel) -> None:
    engine = EngineCore(tiny_runner, chunk_tokens=256, prompt_pass_s=1e-6)  # no kv_blocks: a prefill core
    engine.start()
    engine.close()
    assert engine.prompts.chunk_tokens == 256


def test_a_colocated_prompt_takes_the_blocks_of_a_sequence_aborted_in_the_same_step(runner: LoadedModel) -> None:
    sampling = SamplingParams(temperature=0.0)
    expected = _alone(runner, PROMPTS[0], sampling)
    # 1. The cache holds exactly one sequence of PROMPTS[1] (40 + 12 tokens: 4 blocks), which runs.
    engine = EngineCore(runner, kv_blocks=4)
    newcomer: list[_Stream] = []
    replaced = threading.Event()

    def cancel_and_replace() -> None:  # on the engine thread, inside a step
        engine.abort(holder.seq)
        newcomer.append(_Stream(engine, runner, PROMPTS[0], sampling, "newcomer", colocated=True))
        replaced.set()

    engine.start()
    try:
        # 2. Inside one step the holder is cancelled and a colocated prompt arrives: its pass runs right after
        # the step, before the holder has left the batch, and it needs blocks only the holder can give.
        holder = _Stream(engine, runner, PROMPTS[1], sampling, "holder", at={3: cancel_and_replace})
        assert replaced.wait(30)
        newcomer[0].wait_for()
    finally:
        engine.close()
    # 3. The newcomer ran to its end with the tokens it gets alone, and nothing is held.
    assert newcomer[0].tokens == expected and newcomer[0].finish == "length"
    assert engine.live_sequences == 0
