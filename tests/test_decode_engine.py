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


@pytest.mark.parametrize("pass_s", [1e-9, 60.0], ids=["tight", "roomy"])
def test_a_colocated_pass_pauses_between_layers_for_decode_steps_and_every_stream_decodes_the_same(
        runner: LoadedModel, monkeypatch: pytest.MonkeyPatch, pass_s: float) -> None:
    sampling = SamplingParams(temperature=0.0)
    expected = [_alone(runner, prompt, sampling) for prompt in PROMPTS[:2]]
    steps = [0]
    engine = EngineCore(runner, kv_blocks=64, chunk_tokens=256, prompt_pass_s=pass_s,
                        on_step=lambda seconds, size: steps.__setitem__(0, steps[0] + 1))
    steps_in_pass: list[int] = []

    def counting_pass(runner: LoadedModel, prompts: list[list[int]], cache: object) -> torch.Tensor:
        before = steps[0]
        logits = forward.prefill_pass(runner, prompts, cache)  # type: ignore[arg-type]
        steps_in_pass.append(steps[0] - before)
        return logits

    monkeypatch.setattr(prompts_module, "prefill_pass", counting_pass)
    # 1. A stream runs; at its second token, on the engine thread, a 40-token prompt arrives for colocated prefill,
    #    whose one pass (30 layers) starts right after that step.
    colocated: list[_Stream] = []
    engine.start()
    try:
        running = _Stream(engine, runner, PROMPTS[0], sampling, "running", at={2: lambda: colocated.append(
            _Stream(engine, runner, PROMPTS[1], sampling, "colocated", colocated=True))})
        running.wait_for()
        colocated[0].wait_for()
    finally:
        engine.close()
    # 2. Tight: a decode step at each layer boundary, until the running stream's last 10 tokens were out, all
    #    before the prompt's first token. Roomy: the pass runs whole.
    assert steps_in_pass == ([MAX_TOKENS - 2] if pass_s < 1 else [0])
    # 3. Both decode as they do alone, and nothing is held
    assert [running.tokens, colocated[0].tokens] == expected
    assert engine.live_sequences == 0


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
