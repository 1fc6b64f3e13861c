"""The latency model and the placement it drives: each worker's least-squares fit of its own passes and steps
(serving/costs.py), and the gateway's choice of where a prompt runs by predicted time to first token
(gateway/placement.py). A real cluster's costs and placements are checked in test_placement_cluster."""

from __future__ import annotations

import asyncio
import random

import pytest

from gateway.placement import Placement
from gateway.workers import Colocation, Pool
from protos import worker_pb2
from serving.costs import Costs, LinearFit, prompt_seconds


def test_the_fit_recovers_a_pass_cost_and_follows_a_slower_machine() -> None:
    costs = Costs()
    rng = random.Random(7)
    truth = (0.004, 0.9, 0.05)  # 4 ms a pass, 0.9 ms a token, and 0.05 ms a token per 1,000 tokens of context

    def true_s(tokens: int, start: int, scale: float = 1.0) -> float:
        return scale * prompt_seconds(truth, tokens, start)

    for _ in range(60):
        tokens, start = rng.choice([16, 32, 128, 256, 512]), rng.choice([0, 0, 256, 1024])
        costs.observe_pass(tokens, start, true_s(tokens, start) * rng.uniform(0.98, 1.02))
    for got, want in zip(costs.passes.coefficients, truth):
        assert got == pytest.approx(want, rel=0.15, abs=1e-3)
    assert costs.prompt_s(1000, 0, 256) == pytest.approx(prompt_seconds(truth, 1000, 0, 256), rel=0.03)
    # another process takes half the core: recent passes weigh most, so the fit follows within ~100 passes
    for _ in range(150):
        tokens, start = rng.choice([16, 128, 512]), rng.choice([0, 512])
        costs.observe_pass(tokens, start, true_s(tokens, start, scale=2.0))
    assert costs.prompt_s(1000) == pytest.approx(2 * prompt_seconds(truth, 1000), rel=0.05)


def test_a_fit_never_predicts_less_for_more_work() -> None:
    fit = LinearFit(3)
    # noise that a free fit would explain with a negative batch coefficient
    for batch, context, seconds in [(1, 100, 0.020), (8, 100, 0.019), (1, 4000, 0.030), (8, 4000, 0.029),
                                    (4, 2000, 0.025)]:
        fit.observe((1.0, batch, context / 1000), seconds)
    assert all(c >= 0 for c in fit.coefficients)
    assert fit.predict((1.0, 8, 4.0)) >= fit.predict((1.0, 1, 4.0))
    assert LinearFit(3).coefficients == [0.0, 0.0, 0.0]  # nothing measured: no prediction
    fit.observe((1.0, 2, 0.1), float("nan"))  # a broken sample is ignored
    assert all(c == c for c in fit.coefficients)


def test_a_chunked_prompt_costs_its_passes() -> None:
    coefficients = (0.01, 1.0, 0.0)  # 10 ms a pass, 1 ms a token
    assert prompt_seconds(coefficients, 1000) == pytest.approx(1.01)
    assert prompt_seconds(coefficients, 1000, chunk=256) == pytest.approx(1.04)  # four passes
    assert prompt_seconds(coefficients, 0) == 0


def _costs(ms_per_token: float, step_ms: float = 0.0, chunk: int = 256) -> worker_pb2.Costs:
    return worker_pb2.Costs(pass_coefficients=[0.002, ms_per_token, 0.0], passes=5, chunk_tokens=chunk,
                            step_coefficients=[step_ms / 1e3, 0.0, 0.0] if step_ms else [], steps=5 if step_ms else 0)


def _pools(prefill_backlog_s: float, decode_running: int, decode_backlog_s: float = 0.0,
           budget_s: float = 0.035) -> tuple[Pool, Pool]:
    prefill = Pool("prefill", ["127.0.0.1:9100"])
    decode = Pool("decode", ["127.0.0.1:9200"])
    prefill.workers[0].info = worker_pb2.WorkerInfo(role="prefill", costs=_costs(4.0), backlog_s=prefill_backlog_s)
    decode.workers[0].info = worker_pb2.WorkerInfo(
        role="decode", costs=_costs(4.0, step_ms=20, chunk=32), backlog_s=decode_backlog_s, pass_budget_s=budget_s,
        running=decode_running, running_tokens=decode_running * 500, max_sequences=64, kv_budget_bytes=1)
    return prefill, decode


def test_a_prompt_goes_where_its_first_token_is_predicted_soonest() -> None:
    async def scenario() -> None:
        placement = Placement("model", Colocation(below=512, queued=256))
        # prefill idle: a document goes there even though it is longer than --colocate-below
        prefill, decode = _pools(prefill_backlog_s=0.0, decode_running=4)
        decision = placement.decide(1024, prefill, decode)
        assert not decision.colocated and decision.reason == "model"
        assert decision.predicted_ttft_s == pytest.approx(4 * 0.002 + 4.0 * 1.024)  # four 256-token passes
        colocated = next(o for o in decision.options if o.where == "colocated")
        # decode's core is shared with its steps (20 ms each, a 35 ms budget between them): slower, and its
        # streams would wait a step and the budget between tokens
        assert colocated.ttft_s > decision.predicted_ttft_s and colocated.tpot_s == pytest.approx(0.055)
        # prefill holds 30 s of prompts: the decode worker's share of its core is the sooner first token
        prefill, decode = _pools(prefill_backlog_s=30.0, decode_running=4)
        decision = placement.decide(1024, prefill, decode)
        assert decision.colocated and decision.decode == "127.0.0.1:9200"
        assert "colocated 127.0.0.1:9200" in decision.explain() and "prefill 127.0.0.1:9100" in decision.explain()
        # each prompt sent counts in the worker's backlog until the next poll: a burst spreads over both
        sent = []
        for _ in range(12):
            decision = placement.decide(1024, prefill, decode)
            decision.commit()
            sent.append(decision.colocated)
        assert True in sent and False in sent
        for pool in (prefill, decode):
            await pool.close()

    asyncio.run(scenario())


def test_a_time_per_token_target_keeps_prompts_off_the_decode_workers() -> None:
    async def scenario() -> None:
        prefill, decode = _pools(prefill_backlog_s=30.0, decode_running=4)
        placement = Placement("model", Colocation(below=512, queued=256))
        # a 20 ms step leaves a 40 ms target 20 ms between two steps for prompts (35 without a target): half the
        # core, still sooner than 30 s of queue, and its streams keep their 40 ms
        strict = placement.decide(1024, prefill, decode, tpot_ms=40)
        assert strict.colocated and strict.options[0].tpot_s == pytest.approx(0.040)
        assert strict.predicted_ttft_s == pytest.approx(2 * (32 * 0.002 + 4.096) + 0.020)
        loose = placement.decide(1024, prefill, decode, tpot_ms=100)
        assert loose.colocated and loose.predicted_ttft_s < strict.predicted_ttft_s
        # a target shorter than a step: no colocated choice keeps it, so the prefill queue wins however long
        assert not placement.decide(1024, prefill, decode, tpot_ms=15).colocated
        for pool in (prefill, decode):
            await pool.close()

    asyncio.run(scenario())


def test_the_thresholds_decide_until_costs_are_reported_and_with_placement_threshold() -> None:
    async def scenario() -> None:
        prefill, decode = _pools(prefill_backlog_s=30.0, decode_running=0)
        prefill.workers[0].info.queued_tokens = 5000
        threshold = Placement("threshold", Colocation(below=512, queued=256))
        decision = threshold.decide(1024, prefill, decode)
        assert not decision.colocated and decision.reason == "threshold" and decision.predicted_ttft_s is None
        assert threshold.decide(100, prefill, decode).colocated
        model = Placement("model", Colocation(below=512, queued=256))
        decode.workers[0].info.costs.Clear()  # a worker that has measured nothing yet
        decision = model.decide(1024, prefill, decode)
        assert decision.reason.startswith("threshold") and not decision.colocated
        with pytest.raises(ValueError, match="--placement"):
            Placement("fastest", Colocation())
        for pool in (prefill, decode):
            await pool.close()

    asyncio.run(scenario())


def test_near_equal_predictions_keep_prompts_off_decode_and_errors_are_learnt() -> None:
    async def scenario() -> None:
        placement = Placement("model", Colocation(below=512, queued=256))
        # idle decode worker, same costs as prefill: the same predicted TTFT, and prefill is chosen
        prefill, decode = _pools(prefill_backlog_s=0.0, decode_running=0)
        decode.workers[0].info.costs.chunk_tokens = 256
        decision = placement.decide(1024, prefill, decode)
        assert not decision.colocated
        assert [o.ttft_s for o in decision.options][0] == pytest.approx(decision.options[1].ttft_s)
        # while prefill could start at once there is no queue to skip: a decode fit 5x faster is taken for
        # calibration noise, and the prompt goes to prefill
        decode.workers[0].info.costs.pass_coefficients[1] = 4.0 / 5
        decision = placement.decide(1024, prefill, decode)
        assert not decision.colocated and decision.options[1].ttft_s < decision.options[0].ttft_s
        decode.workers[0].info.costs.pass_coefficients[1] = 4.0
        # prefill 6 s behind: colocated is predicted sooner, and chosen
        prefill.workers[0].info.backlog_s = 6.0
        decision = placement.decide(1024, prefill, decode)
        assert decision.colocated
        # ...but its first tokens keep coming 3x later than the cost model says: the correction learns it
        model_ttft = decision.options[0].model_s
        prefill.workers[0].info.backlog_s = 100.0  # (colocated stays the choice meanwhile)
        for _ in range(40):
            colocated = placement.decide(1024, prefill, decode)
            assert colocated.colocated
            colocated.first_token(3 * model_ttft)
        assert placement.corrected("colocated", model_ttft) == pytest.approx(3 * model_ttft, rel=0.05)
        # prefill's first tokens, untried, are taken to be as late: colocated stays sooner...
        prefill.workers[0].info.backlog_s = 6.0
        assert placement.decide(1024, prefill, decode).colocated
        # ...until prefill's own first tokens show the model right about them: 6 s of queue is sooner again
        for _ in range(5):
            placement.learn("prefill", 10.0, 10.0)
        assert not placement.decide(1024, prefill, decode).colocated
        for pool in (prefill, decode):
            await pool.close()

    asyncio.run(scenario())


def test_a_prompt_counts_in_its_workers_backlog_until_its_first_token_or_the_next_poll() -> None:
    async def scenario() -> None:
        placement = Placement("model", Colocation())
        prefill, decode = _pools(prefill_backlog_s=0.0, decode_running=0)
        decode.workers[0].info.costs.pass_coefficients[1] = 40.0  # a slow decode device: prompts stay on prefill
        worker = prefill.workers[0]
        first = placement.decide(1024, prefill, decode)
        first.commit()
        assert not first.colocated and worker.picked_s == pytest.approx(4 * 0.002 + 4.0 * 1.024)
        second = placement.decide(1024, prefill, decode)
        assert not second.colocated and second.options[0].ttft_s > first.options[0].ttft_s  # waits for the first
        second.commit()
        first.release()  # the first's first token: its prompt no longer waits there
        first.release()  # (once)
        assert worker.picked_s == pytest.approx(4 * 0.002 + 4.0 * 1.024)
        polled = worker_pb2.WorkerInfo()
        polled.CopyFrom(worker.info)
        worker.info = polled  # a poll read the worker since (it resets picked_s)
        worker.picked_s = 0.0
        second.release()  # the poll holds what is left; nothing to take back
        assert worker.picked_s == 0.0
        for pool in (prefill, decode):
            await pool.close()

    asyncio.run(scenario())


def test_a_prefix_the_prefill_worker_holds_is_left_out_of_its_prediction() -> None:
    async def scenario() -> None:
        placement = Placement("model", Colocation())
        prefill, decode = _pools(prefill_backlog_s=2.0, decode_running=0)
        prefill.prefix_balance_tokens = 4096  # prefix routing on
        worker = prefill.workers[0]
        worker.info.prefix_block_tokens = 16
        system = list(range(1000, 1960))  # a 960-token system prompt, sent before under one key's salt
        prefill.in_turn(prompt=system + [7, 8, 9], cache_salt="key-a")
        chat = system + list(range(5, 69))  # the same system prompt and a 64-token question
        assert prefill.cached_tokens(chat, "key-a") == {worker.address: 960}
        assert prefill.cached_tokens(chat, "key-b") == {worker.address: 0}  # another salt's prefix is not this one's
        # held: 64 tokens after 960 (a long prompt by the scheduler: it waits for the whole backlog), sooner there
        # than all 1,024 on the idle decode worker
        held = placement.decide(len(chat), prefill, decode, prompt=chat, cache_salt="key-a")
        assert not held.colocated
        assert held.predicted_ttft_s == pytest.approx(2.0 + prompt_seconds((0.002, 4.0, 0.0), 64, 960))
        # under another salt nothing is held: 2 s of queue and 4.1 s of passes, against 4.2 s colocated
        assert placement.decide(len(chat), prefill, decode, prompt=chat, cache_salt="key-b").colocated
        for pool in (prefill, decode):
            await pool.close()

    asyncio.run(scenario())


def test_a_short_prompts_fixed_costs_are_learnt_apart_from_a_long_prompts_scale() -> None:
    placement = Placement("model", Colocation())
    assert placement.corrected("prefill", 2.0) == pytest.approx(2.0)  # nothing learnt: the model's own
    # a chat's first token 100 ms after a 40 ms pass (the hops and the KV handoff): a fixed cost, which adds to a
    # document's prediction instead of multiplying it 3.5x
    placement.learn("prefill", 0.14, 0.04)
    assert placement.corrected("prefill", 0.04) == pytest.approx(0.14, abs=0.03)
    assert placement.corrected("prefill", 2.0) == pytest.approx(2.0, abs=0.2)
    # colocated has no first tokens yet: prefill's correction serves for it, so neither is favoured for being
    # untried; once it has its own, those count
    assert placement.corrected("colocated", 2.0) == placement.corrected("prefill", 2.0)
    placement.learn("colocated", 2.0, 2.0)
    assert placement.corrected("colocated", 2.0) == pytest.approx(2.0, abs=0.1)
    # documents that come 1.5x later than predicted, beside chats 100 ms late: both terms found
    for _ in range(30):
        placement.learn("prefill", 0.14, 0.04)
        placement.learn("prefill", 0.1 + 1.5 * 2.0, 2.0)
    assert placement.corrected("prefill", 2.0) == pytest.approx(3.1, rel=0.05)
    assert placement.corrected("prefill", 0.04) == pytest.approx(0.16, abs=0.05)


def test_a_short_prompt_waits_for_one_chunk_of_a_long_one_not_for_the_queue() -> None:
    async def scenario() -> None:
        placement = Placement("model", Colocation(below=512, queued=256))
        prefill, decode = _pools(prefill_backlog_s=30.0, decode_running=4)
        info = prefill.workers[0].info
        info.short_backlog_s, info.long_prompts = 0.2, 3  # three documents queued, 0.2 s of chats
        chat = next(o for o in placement.decide(20, prefill, decode).options if o.where == "prefill")
        # the chats ahead, one 256-token chunk of a document (the scheduler's turn), then its own pass
        assert chat.ttft_s == pytest.approx(0.2 + (0.002 + 4.0 * 0.256) + (0.002 + 4.0 * 0.020))
        document = next(o for o in placement.decide(1024, prefill, decode).options if o.where == "prefill")
        assert document.ttft_s == pytest.approx(30.0 + 4 * 0.002 + 4.0 * 1.024)  # behind everything
        for pool in (prefill, decode):
            await pool.close()

    asyncio.run(scenario())


def test_the_prediction_error_is_read_from_the_gateway_log() -> None:
    from bench.placement_error import ratios, summary

    lines = [
        "INFO gateway.server: [a] finished (length): 9 prompt + 4 tokens, TTFT 1100 ms, total 1300 ms, 0 retries, "
        "0 migrations; placed: prefill 127.0.0.1:1: TTFT 1.00 s, TPOT 0 ms; colocated 127.0.0.1:2: TTFT 2.00 s, "
        "TPOT 0 ms",
        "INFO gateway.server: [b] finished (length): 9 prompt + 4 tokens, TTFT 3000 ms, total 3100 ms, 0 retries, "
        "0 migrations; placed: colocated 127.0.0.1:2: TTFT 2.00 s, TPOT 40 ms; prefill 127.0.0.1:1: TTFT 4.00 s, "
        "TPOT 0 ms",
        "INFO gateway.server: [c] finished (length): 9 prompt + 4 tokens, TTFT 900 ms, total 950 ms, 0 retries, "
        "0 migrations; placed: prefill (threshold)",
    ]
    assert ratios(lines) == [("prefill", pytest.approx(1.1)), ("colocated", pytest.approx(1.5))]
    assert summary(ratios(lines)).startswith("all: n=2 median 1.30")


def test_the_kv_handoff_is_learnt_per_path_on_the_prompt_s_tokens_and_told_with_the_choice() -> None:
    async def scenario() -> None:
        placement = Placement("model", Colocation(below=512, queued=256))
        prefill, decode = _pools(prefill_backlog_s=0.0, decode_running=4)
        assert placement.decide(1024, prefill, decode).handoff is None  # no transfer has finished yet
        for tokens, seconds in ((500, 0.006), (1000, 0.011), (2000, 0.021)):  # 1 ms + 10 ms a thousand tokens
            placement.learn_handoff("shm", tokens, seconds)
        decision = placement.decide(1024, prefill, decode)
        assert not decision.colocated and decision.handoff is not None
        path, predicted = decision.handoff
        assert path == "shm" and predicted == pytest.approx(0.001 + 0.01024, rel=0.02)
        assert "KV handoff by shm predicted to hold the second token 11 ms" in decision.explain()
        # a cluster whose transfers now go by gRPC: its own fit, slower per token
        for tokens, seconds in ((500, 0.05), (2000, 0.2)):
            placement.learn_handoff("grpc", tokens, seconds)
        assert placement.handoff(1000) == ("grpc", pytest.approx(0.1, rel=0.02))
        # a colocated choice hands nothing off
        prefill, decode = _pools(prefill_backlog_s=30.0, decode_running=4)
        colocated = placement.decide(1024, prefill, decode)
        assert colocated.colocated and colocated.handoff is None and "KV handoff" not in colocated.explain()
        for pool in (prefill, decode):
            await pool.close()

    asyncio.run(scenario())


def test_a_long_prompt_is_split_when_two_cores_on_it_are_predicted_sooner() -> None:
    async def scenario() -> None:
        placement = Placement("model", Colocation(below=512, queued=256), split_above=512)
        prefill, decode = _pools(prefill_backlog_s=0.0, decode_running=4)
        decision = placement.decide(1024, prefill, decode)
        best = decision.options[0]
        # the prefix in 256-token passes on the idle prefill worker, the rest as one pass on the decode worker's
        # 35 / (35 + 20) share of its core: 614 tokens (60%) ahead finish together with the rest, soonest
        assert best.where == "split" and decision.split == best.split == 614 and not decision.colocated
        assert best.worker == "127.0.0.1:9100" and decision.decode == best.decode == "127.0.0.1:9200"
        assert decision.predicted_ttft_s == pytest.approx((0.002 + 4.0 * 0.410) * 0.055 / 0.035 + 0.020)
        whole = next(o for o in decision.options if o.where == "prefill")
        assert whole.ttft_s == pytest.approx(4 * 0.002 + 4.0 * 1.024) and whole.ttft_s > decision.predicted_ttft_s
        assert decision.explain().startswith("split 614 tokens on 127.0.0.1:9100, the rest on 127.0.0.1:9200")
        decision.commit()  # the prefill worker is charged its part only
        assert prefill.workers[0].picked_s == pytest.approx(3 * 0.002 + 4.0 * 0.614)
        decision.release()
        # shorter than --split-above, or a prefill worker with a queue: no split to weigh
        assert all(o.where != "split" for o in placement.decide(500, prefill, decode).options)
        busy_prefill, busy_decode = _pools(prefill_backlog_s=5.0, decode_running=4)
        assert all(o.where != "split" for o in placement.decide(1024, busy_prefill, busy_decode).options)
        # the fixed rule: half on each side; off by default
        threshold = Placement("threshold", Colocation(below=512, queued=256), split_above=512)
        fixed = threshold.decide(1024, prefill, decode)
        assert fixed.split == 512 and not fixed.colocated and fixed.explain() == "split at 512 tokens (threshold)"
        assert Placement("threshold", Colocation(below=512, queued=256)).decide(1024, prefill, decode).split == 0
        for pool in (prefill, decode, busy_prefill, busy_decode):
            await pool.close()

    asyncio.run(scenario())
