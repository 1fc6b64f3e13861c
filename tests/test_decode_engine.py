"""The decode engine in-process: sequences joining and leaving a running batch decode exactly as they do alone."""

from __future__ import annotations

import threading
import time

import pytest
import torch

import engine.prompts as prompts_module
from engine.core import EngineCore
from engine.feed import PrefixFeed
from engine.sequence import FAILED, Sequence
from model_runner import forward
from model_runner.loading import LoadedModel
from protos.types import SamplingParams
from tests.helpers import ENGINE_MAX_TOKENS, EngineStream, decode_alone

PROMPTS = [[1, 17, 4242, 99, 7], list(range(300, 340)), [504, 1095, 2208, 314, 3595, 28, 1090, 314, 260, 2632]]


@pytest.mark.parametrize("sampling", [SamplingParams(temperature=0.0), SamplingParams(temperature=0.9, seed=7)],
                         ids=["greedy", "seeded"])
def test_joining_and_leaving_a_running_batch_changes_no_sequence_tokens(runner: LoadedModel,
                                                                        sampling: SamplingParams) -> None:
    expected = [decode_alone(runner, prompt, sampling) for prompt in PROMPTS]
    assert all(len(tokens) == ENGINE_MAX_TOKENS for tokens in expected)
    engine = EngineCore(runner, kv_blocks=64)
    paused, resume = threading.Event(), threading.Event()

    def pause() -> None:  # holds the engine thread between two steps, so the joins land at a known step
        paused.set()
        assert resume.wait(30)

    engine.start()
    try:
        first = EngineStream(engine, runner, PROMPTS[0], sampling, "first", at={4: pause})
        assert paused.wait(30)  # "first" has decoded alone for 3 steps
        leaver: EngineStream | None = None
        leaver = EngineStream(engine, runner, PROMPTS[1], sampling, "leaver",
                         at={3: lambda: engine.abort(leaver.seq)})  # type: ignore[union-attr]
        late = EngineStream(engine, runner, PROMPTS[2], sampling, "late")
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
    expected = [decode_alone(runner, prompt, sampling) for prompt in PROMPTS]
    passes: list[list[int]] = []

    def counting_pass(runner: LoadedModel, prompts: list[list[int]], cache: object) -> torch.Tensor:
        passes.append([len(prompt) for prompt in prompts])
        return forward.prefill_pass(runner, prompts, cache)  # type: ignore[arg-type]

    monkeypatch.setattr(prompts_module, "prefill_pass", counting_pass)
    engine = EngineCore(runner, kv_blocks=64, chunk_tokens=16)
    # all queued before the engine starts: the short two share a pass
    streams = [EngineStream(engine, runner, prompt, sampling, f"colocated-{index}", colocated=True)
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


def _a_prompt_beside_a_stream(engine: EngineCore, runner: LoadedModel,
                              sampling: SamplingParams) -> tuple[EngineStream, EngineStream]:
    """A stream runs; at its second token, on the engine thread, a 40-token prompt arrives for colocated prefill,
    whose passes start right after that step. Both run to their end."""
    colocated: list[EngineStream] = []
    engine.start()
    try:
        running = EngineStream(engine, runner, PROMPTS[0], sampling, "running", at={2: lambda: colocated.append(
            EngineStream(engine, runner, PROMPTS[1], sampling, "colocated", colocated=True))})
        running.wait_for()
        colocated[0].wait_for()
    finally:
        engine.close()
    return running, colocated[0]


# The pass budget: tight in ms, roomy, and roomy in ms but a millionth of a decode step (`pass_steps`).
@pytest.mark.parametrize(("pass_s", "pass_steps"), [(1e-9, 0.0), (60.0, 0.0), (60.0, 1e-6)],
                         ids=["tight", "roomy", "tight-in-steps"])
def test_a_colocated_pass_pauses_between_layers_for_decode_steps_and_every_stream_decodes_the_same(
        runner: LoadedModel, monkeypatch: pytest.MonkeyPatch, pass_s: float, pass_steps: float) -> None:
    sampling = SamplingParams(temperature=0.0)
    expected = [decode_alone(runner, prompt, sampling) for prompt in PROMPTS[:2]]
    steps = [0]
    engine = EngineCore(runner, kv_blocks=64, chunk_tokens=256, prompt_pass_s=pass_s, pass_steps=pass_steps,
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
    running, colocated = _a_prompt_beside_a_stream(engine, runner, sampling)
    # 2. Tight: a decode step at each layer boundary, until the running stream's last 10 tokens were out, all
    #    before the prompt's first token. Roomy: the pass runs whole.
    tight = pass_s < 1 or pass_steps > 0
    assert steps_in_pass == ([ENGINE_MAX_TOKENS - 2] if tight else [0])
    # the budget in steps is that share of the steps' mean (under a second each here), the ms otherwise
    assert (0 < engine.pass_budget_s() < pass_steps) if pass_steps else engine.pass_budget_s() == pass_s
    # 3. Both decode as they do alone, and nothing is held
    assert [running.tokens, colocated.tokens] == expected
    assert engine.live_sequences == 0


def test_the_pass_budget_is_the_least_any_running_sequence_allows(tiny_runner: LoadedModel) -> None:
    engine = EngineCore(tiny_runner, kv_blocks=8, prompt_pass_s=0.035)
    assert engine.batch is not None
    engine._step_s = 0.020  # a recent decode step

    def running(*targets_s: float) -> float:
        assert engine.batch is not None
        engine.batch.running = [Sequence(f"r{i}", 4, 8, SamplingParams(), frozenset(), lambda ids, reason: None,
                                         tpot_target_s=target) for i, target in enumerate(targets_s)]
        return engine.pass_budget_s()

    assert running() == running(0.0) == pytest.approx(0.035)  # no target: --prefill-pass-ms
    assert running(0.2) == pytest.approx(0.18)  # a 200 ms target less a 20 ms step
    assert running(0.2, 0.0) == pytest.approx(0.035)  # a stream without a target keeps the default
    assert running(0.2, 0.05) == pytest.approx(0.03)  # the strictest target holds
    assert running(0.01) == 0.0  # a target shorter than a step: a step at every layer boundary
    assert EngineCore(tiny_runner, kv_blocks=8, prompt_pass_s=0.0).pass_budget_s() == 0.0  # passes run whole


def test_a_prompt_backlog_widens_the_pass_budget_to_its_busy_steps(tiny_runner: LoadedModel,
                                                                    monkeypatch: pytest.MonkeyPatch) -> None:
    engine = EngineCore(tiny_runner, kv_blocks=8, prompt_pass_s=0.035, pass_steps=1.25, busy_pass_steps=3.0,
                        busy_backlog_s=1.0)
    assert engine.batch is not None
    engine._step_s = 0.020  # a recent decode step
    engine.batch.running = [Sequence("r", 4, 8, SamplingParams(), frozenset(), lambda ids, reason: None)]
    backlog = [0.5]
    monkeypatch.setattr(engine.prompts, "backlog", lambda: (backlog[0], 0.0, 1))

    def budget_after_a_step() -> float:
        engine.batch.running, running = [], engine.batch.running  # type: ignore[union-attr]
        engine._decode_step()  # an empty batch: no step, but the backlog is read as after one
        engine.batch.running = running  # type: ignore[union-attr]
        return engine.pass_budget_s()

    assert budget_after_a_step() == pytest.approx(0.025)  # one chat's prompt: 1.25 steps (less than 35 ms)
    backlog[0] = 1.5
    assert budget_after_a_step() == pytest.approx(0.060)  # a backlog: 3 steps
    engine.batch.running[0].tpot_target_s = 0.050
    assert engine.pass_budget_s() == pytest.approx(0.030)  # a stream's own target still bounds it
    engine.batch.running[0].tpot_target_s = 0.0
    backlog[0] = 0.2
    assert budget_after_a_step() == pytest.approx(0.025)  # the backlog cleared: back to the usual budget
    assert EngineCore(tiny_runner, kv_blocks=8, prompt_pass_s=0.035, pass_steps=1.25).pass_budget_s() == \
        pytest.approx(0.035)  # off by default (no step yet: the ms)


def test_a_prompt_backlog_runs_its_chunks_back_to_back_within_the_budget_and_decodes_the_same(
        runner: LoadedModel, monkeypatch: pytest.MonkeyPatch) -> None:
    sampling = SamplingParams(temperature=0.0)
    expected = [decode_alone(runner, prompt, sampling) for prompt in PROMPTS[:2]]
    steps = [0]
    # a roomy budget, and any backlog counts as one: the 40-token prompt's five 8-token chunks run back to back
    engine = EngineCore(runner, kv_blocks=64, chunk_tokens=8, prompt_pass_s=60.0, busy_pass_steps=1.0,
                        busy_backlog_s=-1.0, on_step=lambda seconds, size: steps.__setitem__(0, steps[0] + 1))
    steps_before_pass: list[int] = []
    starts: list[tuple[float, float]] = []  # (when a pass began, how long the watchdog saw the engine in it then)

    def counting_pass(runner: LoadedModel, prompts: list[list[int]], cache: object) -> torch.Tensor:
        steps_before_pass.append(steps[0])
        starts.append((time.perf_counter(), engine.stalled()))
        return forward.prefill_pass(runner, prompts, cache)  # type: ignore[arg-type]

    monkeypatch.setattr(prompts_module, "prefill_pass", counting_pass)
    running, colocated = _a_prompt_beside_a_stream(engine, runner, sampling)
    assert len(steps_before_pass) == 5 and len(set(steps_before_pass)) == 1  # no decode step between the chunks
    # each pass back to back counts as an iteration of its own for the stall watchdog, never the backlog's sum
    assert all(stalled < began - before for (before, _), (began, stalled) in zip(starts, starts[1:]))
    assert [running.tokens, colocated.tokens] == expected
    assert engine.live_sequences == 0


def test_a_colocated_prompt_takes_the_blocks_of_a_sequence_aborted_in_the_same_step(runner: LoadedModel) -> None:
    sampling = SamplingParams(temperature=0.0)
    expected = decode_alone(runner, PROMPTS[0], sampling)
    # 1. The cache holds exactly one sequence of PROMPTS[1] (40 + 12 tokens: 4 blocks), which runs.
    engine = EngineCore(runner, kv_blocks=4)
    newcomer: list[EngineStream] = []
    replaced = threading.Event()

    def cancel_and_replace() -> None:  # on the engine thread, inside a step
        engine.abort(holder.seq)
        newcomer.append(EngineStream(engine, runner, PROMPTS[0], sampling, "newcomer", colocated=True))
        replaced.set()

    engine.start()
    try:
        # 2. Inside one step the holder is cancelled and a colocated prompt arrives: its pass runs right after
        # the step, before the holder has left the batch, and it needs blocks only the holder can give.
        holder = EngineStream(engine, runner, PROMPTS[1], sampling, "holder", at={3: cancel_and_replace})
        assert replaced.wait(30)
        newcomer[0].wait_for()
    finally:
        engine.close()
    # 3. The newcomer ran to its end with the tokens it gets alone, and nothing is held.
    assert newcomer[0].tokens == expected and newcomer[0].finish == "length"
    assert engine.live_sequences == 0


class _WatchedFeed(PrefixFeed):
    """A PrefixFeed that tells when the pass first asked it for a layer."""

    def __init__(self, tokens: int, layers: int) -> None:
        super().__init__(tokens, layers)
        self.asked = threading.Event()

    def take(self, layer: int, timeout: float) -> tuple[torch.Tensor, torch.Tensor] | None:
        self.asked.set()
        return super().take(layer, timeout)


SPLIT = 24  # of PROMPTS[1]'s 40 tokens, prefilled elsewhere


def _split_case(runner: LoadedModel) -> tuple[SamplingParams, list[int], list[int], list[int],
                                              list[tuple[torch.Tensor, torch.Tensor]]]:
    """Greedy; the split prompt, its tokens alone, a bystander's tokens alone, and the prefix's KV per layer."""
    sampling = SamplingParams(temperature=0.0)
    prompt = PROMPTS[1]
    _, prefix = forward.prefill(runner, prompt[:SPLIT])
    return (sampling, prompt, decode_alone(runner, prompt, sampling), decode_alone(runner, PROMPTS[0], sampling),
            prefix)


def test_a_split_prompt_takes_its_prefix_layer_by_layer_while_streams_step_and_decodes_as_alone(
        runner: LoadedModel) -> None:
    """Split prefill on the decode core: the prompt's first 24 tokens' KV comes from elsewhere a layer at a time,
    the last 16 run as one pass that takes each layer as it lands. Its tokens are those of the whole prompt
    alone, and a running stream keeps taking steps while the pass waits for a layer."""
    sampling, prompt, expected, bystander_expected, prefix = _split_case(runner)
    feed = _WatchedFeed(SPLIT, len(prefix))
    engine = EngineCore(runner, kv_blocks=64, chunk_tokens=16, prompt_pass_s=0.035)
    engine.start()
    try:
        bystander = EngineStream(engine, runner, PROMPTS[0], sampling, "bystander", max_tokens=400)
        bystander.wait_for(2)
        split_stream = EngineStream(engine, runner, prompt, sampling, "split", feed=feed)
        assert feed.asked.wait(30)  # the split pass runs, and waits for layer 0
        feed.put(0, prefix[0][0].clone(), prefix[0][1].clone())
        waiting_from = len(bystander.tokens)
        bystander.wait_for(waiting_from + 3)  # steps while the pass waits for layer 1 (it would hang otherwise)
        assert not split_stream.tokens and not split_stream.finish
        for layer, (keys, values) in enumerate(prefix[1:], start=1):
            feed.put(layer, keys.clone(), values.clone())
        split_stream.wait_for()
        engine.abort(bystander.seq)
        deadline = time.monotonic() + 30
        while engine.live_sequences and time.monotonic() < deadline:  # it leaves at the next step
            time.sleep(0.01)
    finally:
        engine.close()
    assert split_stream.tokens == expected and split_stream.finish == "length"
    assert feed.arrived == 0  # every layer taken, none held
    assert bystander.tokens[: len(bystander_expected)] == bystander_expected  # its first tokens, as alone
    assert engine.live_sequences == 0


def test_a_split_prompt_whose_prefix_never_comes_whole_fails_alone(runner: LoadedModel) -> None:
    """The prefill worker sending the prefix failed after two layers: the split prompt's stream fails, nothing
    stays held, and a stream beside it decodes on unharmed."""
    sampling, prompt, _, bystander_expected, prefix = _split_case(runner)
    feed = PrefixFeed(SPLIT, len(prefix))
    engine = EngineCore(runner, kv_blocks=64, chunk_tokens=16, prompt_pass_s=0.035)
    engine.start()
    try:
        bystander = EngineStream(engine, runner, PROMPTS[0], sampling, "bystander")
        split_stream = EngineStream(engine, runner, prompt, sampling, "split", feed=feed)
        for layer in range(2):
            feed.put(layer, *prefix[layer])
        time.sleep(0.1)
        feed.fail("KV transfer refused")
        split_stream.wait_for()
        bystander.wait_for()
    finally:
        engine.close()
    assert split_stream.finish == FAILED and not split_stream.tokens
    assert bystander.tokens == bystander_expected and bystander.finish == "length"
    assert engine.live_sequences == 0
