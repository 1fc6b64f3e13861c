"""The prompt queue and its passes: the one prefill loop of both roles.

Prompts wait in a queue, bounded by a token budget on a prefill worker (a prompt that would overflow it is
refused, so a caller can go elsewhere). Each pass is a batch of short prompts or one chunk of a long one
(scheduler.py); the pass samples each finished prompt's first token and hands its KV on:
- with `deliver`, layer by layer: during its last pass when streaming (a long prompt's earlier chunks leave every
  layer incomplete until then), or after it. A prompt whose KV has a home (the shared-memory segment decode lent
  it) and a pass to itself is computed straight into that home. That is the prefill worker's path to decode;
- without, all of it in `Prefilled.kv`: a colocated prompt joining its own worker's decode batch.
Abandoned prompts (cancelled, or their transfer refused) leave the queue, or stop the pass at the next layer
boundary when nothing else in it needs it.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import NamedTuple

import torch

from engine.scheduler import PromptScheduler
from model_runner.forward import LayerKV, WatchedCache, cached_layers, prefill_pass
from model_runner.loading import LoadedModel
from model_runner.prefix_cache import Block, PrefixCache, continuation
from model_runner.sampling import sample
from protos.types import SamplingParams

log = logging.getLogger(__name__)


class QueueFull(Exception):
    """The prompt would take the queue over its token budget."""


class Abandoned(Exception):
    """The prompt's request ended (cancelled, or its KV transfer failed) before its prompt pass did."""


class Prefilled(NamedTuple):
    first_token: int
    started: float  # perf_counter when its first pass began
    ended: float
    batch_size: int = 1  # prompts in its (last) pass
    passes: int = 1  # forward passes it took (chunks of a long prompt)
    cached_tokens: int = 0  # prompt tokens whose KV came from the prefix cache
    kv: list[LayerKV] = []  # every layer's KV, for a job without `deliver`


Deliver = Callable[[int, torch.Tensor, torch.Tensor], None]


@dataclass(eq=False)
class PromptJob:
    token_ids: list[int]
    sampling: SamplingParams
    # deliver(layer, keys, values): a layer's finished KV, (kv_heads, tokens, head_dim) each; engine thread.
    # None: the KV comes whole with Prefilled.kv.
    deliver: Deliver | None
    # finish(Prefilled or the exception that ended it): exactly once, engine thread
    finish: Callable[[Prefilled | BaseException], None]
    abandon: threading.Event = field(default_factory=threading.Event)
    # Where its KV goes, (kv_heads, prompt tokens, head_dim) for each layer's keys and values: decode's shared-memory
    # segment, which the forward pass then writes into directly when the prompt has a pass to itself. None: anywhere.
    kv_home: list[LayerKV] | None = None
    started: float = 0.0
    cache: WatchedCache | None = None  # a long prompt's KV so far
    done: int = 0  # prompt tokens in `cache` (or in `prefix`, before its first pass)
    prefix: list[Block] = field(default_factory=list)  # its cached prefix, until its first pass copies it
    cached_tokens: int = 0  # prompt tokens that prefix covers
    cost: int = 0  # prompt tokens to compute, counted in the queue's budget
    finished: bool = False  # `finish` was called: a later failure of its pass must not end it again

    @property
    def abandoned(self) -> bool:
        return self.abandon.is_set()


class PromptQueue:
    """Queue bookkeeping under the engine's lock; passes on the engine thread."""

    def __init__(self, runner: LoadedModel, lock: threading.Condition, *, batch_tokens: int, chunk_tokens: int,
                 max_queued_tokens: int | None, layer_streaming: bool, prefix_cache: PrefixCache | None,
                 between_layers: Callable[[], None] | None = None) -> None:
        """`between_layers()`: called at every layer boundary of a pass, on the engine thread (a decode core runs
        a decode step there when its streams have waited long enough: core.py)."""
        self.runner = runner
        self.prefix_cache = prefix_cache  # used under the lock
        self.max_queued_tokens = max_queued_tokens  # None: unbounded (a decode worker's reservations bound it)
        self.layer_streaming = layer_streaming
        self._scheduler: PromptScheduler[PromptJob] = PromptScheduler(batch_tokens, chunk_tokens)
        self._lock = lock
        self.queued_tokens = 0  # prompt tokens of every job submitted and not yet finished
        self.live_jobs = 0
        self.between_layers = between_layers

    @property
    def chunk_tokens(self) -> int:
        """The most prompt tokens one pass computes."""
        return self._scheduler.chunk_tokens

    def __len__(self) -> int:
        """Prompts queued (a long prompt part-way through its chunks included); under the lock."""
        return len(self._scheduler)

    # Under the lock.
    def add(self, job: PromptJob) -> None:
        """Queue a prompt; raises QueueFull when it would overflow the token budget (an idle queue takes any)."""
        self._match(job)
        budget = self.max_queued_tokens
        if budget is not None and self.live_jobs and self.queued_tokens + job.cost > budget:
            raise QueueFull(f"prefill queue full: {self.queued_tokens} prompt tokens waiting or running, "
                            f"budget {budget}")
        self.queued_tokens += job.cost
        self.live_jobs += 1
        self._scheduler.add(job)

    def drain(self, reason: str) -> None:
        """Finish every waiting job with Abandoned(reason): the engine is stopping."""
        for job in self._scheduler.waiting():
            self.finish(job, Abandoned(reason))

    # The engine thread.
    def run_next_pass(self) -> None:
        with self._lock:
            for job in self._scheduler.drop_abandoned():
                self.finish(job, Abandoned())
            jobs = self._scheduler.next_pass()
        if not jobs:
            return
        try:
            if self._scheduler.is_long(jobs[0]):
                self._run_chunk(jobs[0])
            else:
                self._run_batch(jobs)
        except Exception as exc:  # one bad pass fails its prompts, never the engine
            if not isinstance(exc, Abandoned):
                log.exception("prompt pass over %d prompt(s) failed", len(jobs))
            for job in jobs:
                self._end_long(job)
                self.finish(job, exc)

    def _run_batch(self, jobs: list[PromptJob]) -> None:
        started = time.perf_counter()
        for job in jobs:
            job.started = started
        streaming = self.layer_streaming

        def on_layer(layer: int, keys: torch.Tensor, values: torch.Tensor) -> None:
            live = [(row, job) for row, job in enumerate(jobs) if not job.abandoned]
            if not live:
                raise Abandoned
            if streaming:
                for row, job in live:
                    if job.deliver is not None:
                        width = len(job.token_ids)
                        job.deliver(layer, keys[row, :, :width], values[row, :, :width])
            if self.between_layers is not None:
                self.between_layers()

        cache = WatchedCache(on_layer, homes=jobs[0].kv_home if len(jobs) == 1 else None)
        logits = prefill_pass(self.runner, [job.token_ids for job in jobs], cache)
        ended = time.perf_counter()
        for row, job in enumerate(jobs):
            if job.abandoned:
                self.finish(job, Abandoned())
                continue
            try:
                first_token = sample(logits[row], job.sampling, position=len(job.token_ids))
            except Exception as exc:  # this row's logits alone: the other prompts of the pass stand
                log.exception("sampling the first token of a %d-token prompt failed", len(job.token_ids))
                self.finish(job, exc)
                continue
            kv = cached_layers(cache, row, len(job.token_ids))
            self._remember(job, kv)
            self.finish(job, self._hand_on(job, kv, Prefilled(first_token, job.started, ended,
                                                                 batch_size=len(jobs)), streamed=streaming))

    def _run_chunk(self, job: PromptJob) -> None:
        prompt = job.token_ids
        if job.cache is None:  # its first pass: start after its cached prefix, looked up again
            with self._lock:
                cost = job.cost
                self._match(job)
                self.queued_tokens -= cost - job.cost
            job.cache, job.started = WatchedCache(homes=job.kv_home), time.perf_counter()
            if job.prefix:
                continuation(job.prefix, job.cache)
                job.prefix = []  # copied: the blocks' pool slots may go once the cache lets them
        chunk = prompt[job.done : job.done + self._scheduler.chunk_tokens]
        last = job.done + len(chunk) == len(prompt)
        streaming = self.layer_streaming and last and job.deliver is not None

        def on_layer(layer: int, keys: torch.Tensor, values: torch.Tensor) -> None:
            if job.abandoned:
                raise Abandoned
            if streaming and job.deliver is not None:
                job.deliver(layer, keys[0], values[0])
            if self.between_layers is not None:
                self.between_layers()

        job.cache.on_layer = on_layer
        logits = prefill_pass(self.runner, [chunk], job.cache)[0]
        job.done += len(chunk)
        if not last:
            return
        kv = cached_layers(job.cache)
        self._remember(job, kv)
        cached = job.cached_tokens
        self._end_long(job)
        passes = -(-(len(prompt) - cached) // self._scheduler.chunk_tokens)
        prefilled = Prefilled(sample(logits, job.sampling, position=len(prompt)), job.started, time.perf_counter(),
                              passes=passes, cached_tokens=cached)
        self.finish(job, self._hand_on(job, kv, prefilled, streamed=streaming))

    @staticmethod
    def _hand_on(job: PromptJob, kv: list[LayerKV], prefilled: Prefilled, streamed: bool) -> Prefilled:
        """The finished prompt's KV goes on: delivered now if it was not streamed during the pass, or with its
        outcome when the job has nowhere to deliver it."""
        if job.deliver is None:
            return prefilled._replace(kv=kv)
        if not streamed:
            for layer, (keys, values) in enumerate(kv):
                job.deliver(layer, keys, values)
        return prefilled

    def _match(self, job: PromptJob) -> None:
        """Under the lock: the longest cached prefix of a prompt that has not started, and what is left to compute.
        Called on submit, and again as its first pass starts: prompts that finished while it waited (the same
        system prompt sent in a burst, say) may have cached more of it."""
        if self.prefix_cache is not None:
            blocks = self.prefix_cache.match(job.token_ids)
            if len(blocks) > len(job.prefix):
                job.prefix = blocks
                job.done = job.cached_tokens = sum(block.kv.shape[3] for block in blocks)
        job.cost = len(job.token_ids) - job.done

    def _remember(self, job: PromptJob, layers: list[LayerKV]) -> None:
        """A completed prompt's full blocks go into the prefix cache (never a cancelled one's partial KV)."""
        if self.prefix_cache is not None and not job.abandoned:
            with self._lock:
                self.prefix_cache.insert(job.token_ids, layers)

    def _end_long(self, job: PromptJob) -> None:
        with self._lock:
            self._scheduler.finished_long(job)
        job.cache = None

    def finish(self, job: PromptJob, result: Prefilled | BaseException) -> None:
        """Ends a job once: a pass that fails part-way through its rows fails only the rows not yet finished.
        (The lock is re-entrant: the engine also finishes jobs while holding it.)"""
        with self._lock:
            if job.finished:
                return
            job.finished = True
            self.queued_tokens -= job.cost
            self.live_jobs -= 1
        job.finish(result)
