"""The prefill engine: one thread owns the model and runs the passes a PromptScheduler picks.

Prompts wait in a queue bounded by a token budget (a prompt that would overflow it is refused, so a caller can
go elsewhere). Each forward pass is a batch of short prompts or one chunk of a long one (model_runner/scheduling.py).

With layer streaming a prompt's KV is delivered layer by layer during its last pass (a long prompt's earlier
chunks leave every layer incomplete until then); otherwise after it. A prompt whose KV has a home (the
shared-memory segment decode lent it) and a pass to itself is computed straight into that home. Abandoned prompts
(cancelled, or their transfer refused) leave the queue, or stop the pass at the next layer boundary when nothing
else in it needs it.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import NamedTuple

import torch

from model_runner.forward import LayerKV, WatchedCache, cached_layers, prefill_pass
from model_runner.loading import LoadedModel
from model_runner.prefix_cache import Block, PrefixCache, continuation
from model_runner.sampling import SamplingParams, sample
from model_runner.scheduling import PromptScheduler

log = logging.getLogger(__name__)

class QueueFull(Exception):
    """The prompt would take the queue over its token budget."""


class Abandoned(Exception):
    """The prompt's request ended (cancelled, or its KV transfer failed) before its prefill did."""


class Prefilled(NamedTuple):
    first_token: int
    started: float  # perf_counter when its first pass began
    ended: float
    batch_size: int = 1  # prompts in its (last) pass
    passes: int = 1  # forward passes it took (chunks of a long prompt)
    cached_tokens: int = 0  # prompt tokens whose KV came from the prefix cache


@dataclass(eq=False)
class PrefillJob:
    token_ids: list[int]
    sampling: SamplingParams
    # deliver(layer, keys, values): a layer's finished KV, (kv_heads, tokens, head_dim) each; engine thread
    deliver: Callable[[int, torch.Tensor, torch.Tensor], None]
    # finish(Prefilled or the exception that ended it): exactly once, engine thread
    finish: Callable[[Prefilled | BaseException], None]
    abandon: threading.Event = field(default_factory=threading.Event)
    # Where its KV goes, (kv_heads, prompt tokens, head_dim) for each layer's keys and values: decode's shared-memory
    # segment, which the forward pass then writes into directly when the prompt has a pass to itself. None: anywhere.
    kv_home: list[LayerKV] | None = None
    started: float = 0.0
    cache: WatchedCache | None = None  # a long prompt's KV so far
    done: int = 0  # prompt tokens in `cache` (or in `prefix`, before its first pass)
    prefix: list[Block] = field(default_factory=list)  # its cached prefix, from the prefix cache
    cost: int = 0  # prompt tokens to compute, counted in the queue's budget
    finished: bool = False  # `finish` was called: a later failure of its pass must not end it again

    @property
    def cached_tokens(self) -> int:
        return sum(block.kv.shape[3] for block in self.prefix)

    @property
    def abandoned(self) -> bool:
        return self.abandon.is_set()


class PrefillEngine:
    def __init__(self, runner: LoadedModel, *, batch_tokens: int = 256, chunk_tokens: int = 256,
                 max_queued_tokens: int = 65536, layer_streaming: bool = True,
                 prefix_cache: PrefixCache | None = None) -> None:
        self.runner = runner
        self.prefix_cache = prefix_cache  # used under self._wake
        self.max_queued_tokens = max_queued_tokens
        self.layer_streaming = layer_streaming
        self._scheduler: PromptScheduler[PrefillJob] = PromptScheduler(batch_tokens, chunk_tokens)
        self._wake = threading.Condition()
        self._stopping = False
        self.queued_tokens = 0  # prompt tokens of every job submitted and not yet finished
        self.live_jobs = 0
        self._thread = threading.Thread(target=self._run, name="prefill-engine", daemon=True)
        self._thread.start()

    @property
    def waiting(self) -> int:
        """Prompts queued (a long prompt part-way through its chunks included)."""
        with self._wake:
            return len(self._scheduler)

    def submit(self, job: PrefillJob) -> None:
        """Queue a prompt; raises QueueFull when it would overflow the token budget (an idle engine takes any)."""
        with self._wake:
            if self._stopping:
                raise Abandoned("the prefill engine is shutting down")
            self._match(job)
            if self.live_jobs and self.queued_tokens + job.cost > self.max_queued_tokens:
                raise QueueFull(f"prefill queue full: {self.queued_tokens} prompt tokens waiting or running, "
                                f"budget {self.max_queued_tokens}")
            self.queued_tokens += job.cost
            self.live_jobs += 1
            self._scheduler.add(job)
            self._wake.notify()

    def wake(self) -> None:
        """Look at the queue again now (a job was abandoned)."""
        with self._wake:
            self._wake.notify()

    def close(self) -> None:
        with self._wake:
            self._stopping = True
            self._wake.notify()
        self._thread.join()

    def _run(self) -> None:
        while True:
            with self._wake:
                while not self._stopping and not self._scheduler:
                    self._wake.wait()
                for job in self._scheduler.drop_abandoned():
                    self._finish(job, Abandoned())
                if self._stopping:
                    for job in self._scheduler.waiting():
                        self._finish(job, Abandoned("the prefill engine shut down"))
                    return
                jobs = self._scheduler.next_pass()
            if not jobs:
                continue
            try:
                if self._scheduler.is_long(jobs[0]):
                    self._run_chunk(jobs[0])
                else:
                    self._run_batch(jobs)
            except Exception as exc:  # one bad pass fails its prompts, never the engine
                if not isinstance(exc, Abandoned):
                    log.exception("prefill pass over %d prompt(s) failed", len(jobs))
                for job in jobs:
                    self._end_long(job)
                    self._finish(job, exc)

    def _run_batch(self, jobs: list[PrefillJob]) -> None:
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
                    width = len(job.token_ids)
                    job.deliver(layer, keys[row, :, :width], values[row, :, :width])

        cache = WatchedCache(on_layer, homes=jobs[0].kv_home if len(jobs) == 1 else None)
        logits = prefill_pass(self.runner, [job.token_ids for job in jobs], cache)
        ended = time.perf_counter()
        for row, job in enumerate(jobs):
            if job.abandoned:
                self._finish(job, Abandoned())
                continue
            try:
                first_token = sample(logits[row], job.sampling, position=len(job.token_ids))
            except Exception as exc:  # this row's logits alone: the other prompts of the pass stand
                log.exception("sampling the first token of a %d-token prompt failed", len(job.token_ids))
                self._finish(job, exc)
                continue
            if not streaming:
                self._deliver_all(job, cache, row)
            self._remember(job, cached_layers(cache, row, len(job.token_ids)))
            self._finish(job, Prefilled(first_token, job.started, ended, batch_size=len(jobs)))

    def _run_chunk(self, job: PrefillJob) -> None:
        prompt = job.token_ids
        if job.cache is None:  # its first pass: start after its cached prefix, looked up again
            with self._wake:
                cost = job.cost
                self._match(job)
                self.queued_tokens -= cost - job.cost
            job.cache, job.started = WatchedCache(homes=job.kv_home), time.perf_counter()
            if job.prefix:
                continuation(job.prefix, job.cache)
        chunk = prompt[job.done : job.done + self._scheduler.chunk_tokens]
        last = job.done + len(chunk) == len(prompt)
        streaming = self.layer_streaming and last

        def on_layer(layer: int, keys: torch.Tensor, values: torch.Tensor) -> None:
            if job.abandoned:
                raise Abandoned
            if streaming:
                job.deliver(layer, keys[0], values[0])

        job.cache.on_layer = on_layer
        logits = prefill_pass(self.runner, [chunk], job.cache)[0]
        job.done += len(chunk)
        if not last:
            return
        if not self.layer_streaming:
            self._deliver_all(job, job.cache, 0)
        self._remember(job, cached_layers(job.cache))
        cached = job.cached_tokens
        self._end_long(job)
        passes = -(-(len(prompt) - cached) // self._scheduler.chunk_tokens)
        self._finish(job, Prefilled(sample(logits, job.sampling, position=len(prompt)), job.started,
                                    time.perf_counter(), passes=passes, cached_tokens=cached))

    def _match(self, job: PrefillJob) -> None:
        """Under the lock: the longest cached prefix of a prompt that has not started, and what is left to compute.
        Called on submit, and again as its first pass starts: prompts that finished while it waited (the same
        system prompt sent in a burst, say) may have cached more of it."""
        if self.prefix_cache is not None:
            blocks = self.prefix_cache.match(job.token_ids)
            if len(blocks) > len(job.prefix):
                job.prefix = blocks
                job.done = job.cached_tokens
        job.cost = len(job.token_ids) - job.done

    def _remember(self, job: PrefillJob, layers: list[LayerKV]) -> None:
        """A completed prompt's full blocks go into the prefix cache (never a cancelled one's partial KV)."""
        if self.prefix_cache is not None and not job.abandoned:
            with self._wake:
                self.prefix_cache.insert(job.token_ids, layers)

    def _end_long(self, job: PrefillJob) -> None:
        with self._wake:
            self._scheduler.finished_long(job)
        job.cache = None

    def _deliver_all(self, job: PrefillJob, cache: WatchedCache, row: int) -> None:
        for layer, (keys, values) in enumerate(cached_layers(cache, row, len(job.token_ids))):
            job.deliver(layer, keys, values)

    def _finish(self, job: PrefillJob, result: Prefilled | BaseException) -> None:
        """Ends a job once: a pass that fails part-way through its rows fails only the rows not yet finished."""
        with self._wake:
            if job.finished:
                return
            job.finished = True
            self.queued_tokens -= job.cost
            self.live_jobs -= 1
        job.finish(result)
