"""A request across attempts: each attempt is one journey (journey.py); when a worker fails, the request is retried
on other workers before its first token, and migrated after it (the tokens sent join the prompt), within its
deadline and the retry policy. Each attempt is placed anew (placement.py)."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import math
import random
from collections.abc import AsyncGenerator
from dataclasses import dataclass

import grpc
from opentelemetry import trace

from gateway.breakers import PairBreakers
from gateway.errors import GatewayError, NoDecodeCapacity
from gateway.journey import Timings, Tokens, run
from gateway.placement import Decision, Placement
from gateway.request import GenerateParams
from gateway.workers import Pool
from serving.settings import check_settings, setting

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class RetryPolicy:
    max_retries: int = setting(3, "new attempts on other workers when one fails before the first token", low=0)
    max_migrations: int = setting(
        2, "moves of a stream to another decode worker when its worker fails mid-stream", low=0)
    backoff_s: float = setting(0.05, "first wait before a retry, seconds; doubles each time, with jitter",
                               flag="--retry-backoff", low=0)
    max_backoff_s: float = 1.0
    capacity_wait_s: float = 10.0  # how long a request waits for decode room before RESOURCE_EXHAUSTED
    capacity_poll_s: float = 0.02  # the first wait before asking again; it doubles up to 0.2 s
    # A live decode worker answers a reservation in milliseconds and sends tokens every step (tens of ms, a
    # second at worst on a loaded CPU); one silent this long where it owes the next event is taken for frozen
    # (SIGSTOP, a hung kernel, a black-holed link) and the request moves on. None: wait as long as the call lasts.
    # A colocated prompt's prefill is bounded the same way: its worker sends a heartbeat every third of it.
    idle_timeout_s: float | None = setting(
        5.0, "seconds a decode worker may stay silent where it owes the next event (a reservation, the next tokens "
        "once its KV is in) before it is taken for frozen: the request goes to another worker, a stream migrates; "
        "0 turns it off", flag="--idle-timeout", above=0)  # None: off

    def __post_init__(self) -> None:
        check_settings(self)

    def delay(self, attempt: int) -> float:
        return random.uniform(0, min(self.max_backoff_s, self.backoff_s * 2 ** (attempt - 1)))


def _finished_by(params: GenerateParams, sent: list[int], eos_token_ids: frozenset[int]) -> str:
    """The finish reason the tokens sent already reached ("" if none): a stream that fails right after its last
    token has nothing left to migrate, and a continuation past eos or with max_tokens = 0 must not start."""
    if sent and not params.ignore_eos and sent[-1] in eos_token_ids:
        return "stop"
    return "length" if len(sent) >= params.max_tokens else ""


async def run_with_failover(
    params: GenerateParams, prefill: Pool, decode: Pool, timings: Timings, deadline: float | None,
    colocation: Placement | bool, policy: RetryPolicy, pairs: PairBreakers | None = None,
    eos_token_ids: frozenset[int] = frozenset(),
) -> AsyncGenerator[Tokens, None]:
    """`run`, retried on other workers when a worker fails, within the deadline (loop time) and the policy.

    Before any token reached the caller a failure is retried from the reservation on. After, the stream
    migrates: the tokens sent join the prompt, a new reservation and prefill take over, and the caller sees
    one stream with no token repeated or missing. A failure after the stream's last token (max_tokens reached,
    or an eos in `eos_token_ids`) ends it with that finish instead.

    Each attempt asks `colocation` whether its prompt (a migrated stream's includes the tokens sent) is prefilled
    by the decode worker itself, at the pools' load then (placement.py); a bool decides once for every attempt.
    A worker's DEADLINE_EXCEEDED (decode's lease) that ends the request reaches the caller as UNAVAILABLE: only
    the caller's own deadline is DEADLINE_EXCEEDED."""
    loop = asyncio.get_running_loop()
    attempts = _with_failover(params, prefill, decode, timings, deadline, colocation, policy, pairs, eos_token_ids)
    try:
        async with contextlib.aclosing(attempts):  # closed early, its worker calls end now, not at GC
            async for tokens in attempts:
                yield tokens
    except GatewayError as exc:
        if exc.code == grpc.StatusCode.DEADLINE_EXCEEDED and (deadline is None or loop.time() < deadline):
            raise GatewayError(grpc.StatusCode.UNAVAILABLE, f"{exc.message} (a server-side limit, not the request's "
                               "deadline; retry)", exc.worker) from None
        raise


async def _with_failover(
    params: GenerateParams, prefill: Pool, decode: Pool, timings: Timings, deadline: float | None,
    colocation: Placement | bool, policy: RetryPolicy, pairs: PairBreakers | None,
    eos_token_ids: frozenset[int],
) -> AsyncGenerator[Tokens, None]:
    loop = asyncio.get_running_loop()
    capacity_until, poll = loop.time() + policy.capacity_wait_s, policy.capacity_poll_s
    sent: list[int] = []
    failed: set[str] = set()
    while True:
        attempt = params if not sent else params.continued(sent)
        timeout = None if deadline is None else max(0.0, deadline - loop.time())
        decision = _place(colocation, attempt, prefill, decode)
        _record_placement(timings, decision)
        predicted = decision.predicted_ttft_s
        if (params.refuse_late and predicted is not None and not sent and not timings.retries
                and predicted * 1e3 > params.ttft_target_ms):
            late_ms = int(predicted * 1e3 - params.ttft_target_ms)
            raise GatewayError(grpc.StatusCode.RESOURCE_EXHAUSTED,
                               f"refused before it started: its first token is predicted in {predicted:.1f} s, past "
                               f"its slo.ttft_ms of {params.ttft_target_ms} ({decision.explain()})",
                               retry_after_ms=max(1, late_ms))
        decision.commit()
        began = loop.time()
        attempt_tokens = run(attempt, prefill, decode, timings, timeout, decision.colocated, frozenset(failed), pairs,
                             policy.idle_timeout_s, decision.decode, decision.split if not attempt.decoded else 0)
        try:
            # aclosing: this generator closed at its yield closes the attempt's too, so its worker calls end now
            async with contextlib.aclosing(attempt_tokens):
                async for tokens in attempt_tokens:
                    if timings.attempt_ttft_s is None and tokens.token_ids:
                        timings.attempt_ttft_s = loop.time() - began
                        decision.first_token(timings.attempt_ttft_s)
                        decision.release()
                        trace.get_current_span().set_attribute("pdserve.placement.ttft_s", timings.attempt_ttft_s)
                    sent += tokens.token_ids
                    if tokens.finish_reason:
                        _learn_handoff(colocation, decision, timings, len(attempt.prompt_ids))
                    yield tokens
                    if tokens.finish_reason:
                        return
            return
        except NoDecodeCapacity:
            decision.release()
            # decode capacity is reserved before any prefill starts: wait for room, as a queue would
            if loop.time() + poll >= min(capacity_until, deadline or math.inf):
                raise
            await asyncio.sleep(poll)
            poll = min(poll * 2, 0.2)
        except GatewayError as exc:
            decision.release()
            if exc.worker is not None and exc.code == grpc.StatusCode.UNAVAILABLE:
                exc.worker.failed()
            # e.g. max_tokens=1: prefill's token was the whole answer, and decode failed before saying so
            finish = _finished_by(params, sent, eos_token_ids)
            if finish:
                log.info("request %s: %s after its last token; finished (%s)", params.request_id, exc.message, finish)
                yield Tokens([], finish)
                return
            if not exc.retryable:
                raise
            if sent:
                if timings.migrations >= policy.max_migrations:
                    raise
                timings.migrations += 1
            else:
                if timings.retries >= policy.max_retries:
                    raise
                timings.retries += 1
            if exc.worker is not None:
                failed.add(exc.worker.address)
            failed.update(exc.suspects)
            pause = policy.delay(timings.retries + timings.migrations)
            if deadline is not None and loop.time() + pause >= deadline:
                raise
            log.warning("request %s: %s; %s", params.request_id, exc.message,
                        f"migrating after {len(sent)} tokens" if sent else "retrying")
            trace.get_current_span().add_event("migration" if sent else "retry", {
                "pdserve.error": exc.message, "pdserve.status": exc.code.name, "pdserve.tokens_sent": len(sent)})
            await asyncio.sleep(pause)


def _place(colocation: Placement | bool, params: GenerateParams, prefill: Pool, decode: Pool) -> Decision:
    if isinstance(colocation, bool):
        return Decision(colocation, "fixed for every attempt")
    return colocation.decide(len(params.prompt_ids), prefill, decode, params.tpot_target_ms,
                             params.cacheable_ids, params.cache_salt)


def _learn_handoff(colocation: Placement | bool, decision: Decision, timings: Timings, tokens: int) -> None:
    """A finished attempt's KV handoff (its exposed time, by its path) teaches the placement model, and its span
    tells the handoff predicted beside the one seen."""
    if isinstance(colocation, bool) or timings.kv_transport not in ("shm", "grpc"):
        return
    colocation.learn_handoff(timings.kv_transport, tokens, timings.kv_exposed_ms / 1e3)
    attributes: dict[str, str | float] = {"pdserve.kv_exposed_s": timings.kv_exposed_ms / 1e3}
    if decision.handoff is not None:
        attributes["pdserve.placement.handoff_predicted_s"] = decision.handoff[1]
    trace.get_current_span().set_attributes(attributes)


def _record_placement(timings: Timings, decision: Decision) -> None:
    """The attempt's placement, in its timings and on the request's span."""
    timings.placement = "colocated" if decision.colocated else "split" if decision.split else "prefill"
    timings.placement_reason, timings.predicted_ttft_s = decision.explain(), decision.predicted_ttft_s
    timings.attempt_ttft_s = None
    attributes: dict[str, str | float] = {"pdserve.placement": timings.placement,
                                          "pdserve.placement.reason": timings.placement_reason}
    if decision.predicted_ttft_s is not None:
        attributes["pdserve.placement.predicted_ttft_s"] = decision.predicted_ttft_s
    trace.get_current_span().set_attributes(attributes)
