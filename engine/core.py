"""The engine core: one thread owns the model; requests reach it through queues. Configured by role, the way
vLLM runs one EngineCoreProc for every role:
- prefill (no KV blocks): prompt passes back to back; each prompt's KV goes out through its job's `deliver`;
- decode (`kv_blocks` > 0): a continuous batch (batch.py) that sequences join once their KV arrived, and between
  two decode steps one pass of colocated prompts, scheduled as on a prefill worker: short prompts batched, long
  ones in chunks taking turns with them (chunked prefill, as vLLM does by default). So a long prompt delays
  running streams by one chunk at a time, never by its whole forward pass. And a pass that runs longer than
  `prompt_pass_s` (or `pass_steps` decode steps, if less) pauses at its next layer boundary for a decode step
  (layered prefill): a running stream waits about one step plus that budget for its next token, however long the
  chunk.
"""

from __future__ import annotations

import collections
import logging
import threading
import time
from collections.abc import Callable

from engine.batch import DecodeBatch
from engine.feed import PrefixFeed
from engine.prompts import Abandoned, Prefilled, PromptJob, PromptQueue
from engine.sequence import FAILED, Sequence
from model_runner.loading import LoadedModel
from model_runner.paged_cache import KVPieces, pieces_of
from model_runner.prefix_cache import PrefixCache
from protos import worker_pb2
from serving.costs import Costs

log = logging.getLogger(__name__)

STEP_WEIGHT = 0.1  # each decode step's share of the recent mean step time that bounds a prompt pass


class EngineCore:
    def __init__(self, runner: LoadedModel, *, kv_blocks: int = 0, batch_tokens: int = 256,
                 chunk_tokens: int = 256, max_queued_tokens: int | None = None, layer_streaming: bool = True,
                 prefix_cache: PrefixCache | None = None, kv_warm_bytes: int = 0,
                 on_step: Callable[[float, int], None] | None = None, prompt_pass_s: float = 0.0,
                 pass_steps: float = 0.0, on_interval: Callable[[float], None] | None = None,
                 busy_pass_steps: float = 0.0, busy_backlog_s: float = 1.0) -> None:
        """`kv_blocks` > 0 makes a decode core with a paged cache of that many blocks; 0, a prefill core.
        `prompt_pass_s` > 0, on a decode core: while sequences run, a colocated prompt pass that has run that long
        since the last decode step runs one at its next layer boundary (0: passes run whole); `pass_steps` > 0
        makes that budget at most this many decode steps (their recent mean), so a fast machine's streams keep the
        same ratio of slowest to usual token interval as a slow one's. `busy_pass_steps` > `pass_steps`: while the
        prompts queued here would take more than `busy_backlog_s` to prefill (a backlog, not one chat's prompt), the
        budget is that many decode steps instead, so the core gives most of its time to the backlog and each stream
        waits about 1 + that many steps per token, its passes running back to back (0: the budget above always).
        `max_queued_tokens`: the prompt queue's token budget (None: unbounded). `kv_warm_bytes`: KV cache memory
        committed now, so that joins do not stall steps on page faults. `on_step(seconds, batch size)`:
        after every decode step, on the engine thread. `on_interval(seconds)`: from one decode step's start to the
        next one's while sequences run (the step, joins, prompt layers between): the gap a running stream sees
        between two tokens."""
        self.runner = runner
        self.costs = Costs()  # what its passes and steps take here: the gateway places requests by it
        self._wake = threading.Condition()  # re-entrant: the prompt queue finishes jobs under it
        self.prompts = PromptQueue(runner, self._wake, batch_tokens=batch_tokens, chunk_tokens=chunk_tokens,
                                   max_queued_tokens=max_queued_tokens, layer_streaming=layer_streaming,
                                   prefix_cache=prefix_cache, costs=self.costs,
                                   between_layers=self._between_layers if kv_blocks and prompt_pass_s > 0 else None,
                                   while_waiting=self._step_while_waiting if kv_blocks else None)
        self.batch = DecodeBatch(runner, kv_blocks, on_step, self.costs) if kv_blocks else None
        if self.batch is not None:
            self.batch.cache.commit(kv_warm_bytes)
        self._joining: collections.deque[tuple[Sequence, KVPieces, Callable[[], None]]] = collections.deque()
        self._abort_pending = False
        self._stopping = False
        self._busy_since: float | None = None  # perf_counter when the iteration under way began; None: waiting
        self._prompt_pass_s = prompt_pass_s
        self._pass_steps = pass_steps
        self._busy_pass_steps = busy_pass_steps
        self._busy_backlog_s = busy_backlog_s
        self._busy = False  # whether the prompts queued here were a backlog at the last decode step
        self._step_s = 0.0  # the decode steps' recent mean duration (exponentially weighted); 0 before the first
        self._on_interval = on_interval
        self._stepped_at = 0.0  # perf_counter when the last decode step ended
        self._boundary_at = 0.0  # when the last layer boundary of a prompt pass was reached
        self._step_started: float | None = None  # when the last step started, while sequences run; else None
        self._thread = threading.Thread(target=self._loop, name=f"engine-{self.role}", daemon=True)

    @property
    def role(self) -> str:
        return "prefill" if self.batch is None else "decode"

    def start(self) -> None:
        self._thread.start()

    def close(self) -> None:
        """Stop after the pass under way; prompts still queued finish with Abandoned."""
        with self._wake:
            self._stopping = True
            self._wake.notify()
        if self._thread.is_alive():
            self._thread.join(timeout=30)

    # Called from the services' event loops.
    def submit(self, job: PromptJob) -> None:
        """Queue a prompt; raises QueueFull when it would overflow the token budget, Abandoned when stopping."""
        with self._wake:
            if self._stopping:
                raise Abandoned("the engine is shutting down")
            self.prompts.add(job)
            self._wake.notify()

    def submit_prompt(self, seq: Sequence, prompt: list[int], decoded: int = 0, cache_salt: str = "",
                      feed: PrefixFeed | None = None) -> None:
        """Queue a colocated request: its prompt pass runs here, its first token is emitted, then it decodes.
        `decoded`: how many of the prompt's last tokens decode steps generated (PromptJob.decoded); `cache_salt`:
        its prefix-cache namespace (PromptJob.cache_salt); `feed`: split prefill, where another worker sends the
        prefix's KV (PromptJob.feed)."""
        seq.submitted_at = time.perf_counter()
        try:
            self.submit(PromptJob(prompt, seq.sampling, None, lambda outcome: self._prompt_done(seq, outcome),
                                  seq.abandon, decoded=decoded, cache_salt=cache_salt, feed=feed))
        except Abandoned:  # shutting down
            seq.emit([], FAILED)

    def submit_kv(self, seq: Sequence, kv: KVPieces, release: Callable[[], None]) -> None:
        """Queue a prefilled sequence to join at the next step; `release()` once `kv` was copied in (or dropped)."""
        seq.submitted_at = time.perf_counter()
        with self._wake:
            self._joining.append((seq, kv, release))
            self._wake.notify()

    def abort(self, seq: Sequence) -> None:
        with self._wake:
            seq.abandon.set()
            self._abort_pending = True
            self._wake.notify()

    def wake(self) -> None:
        """Look at the queues again now (a prompt was abandoned)."""
        with self._wake:
            self._wake.notify()

    def stalled(self) -> float:
        """Seconds the engine has been inside one iteration (a pass and a step): 0 when it waits for work; infinite
        when its thread died. The services' watchdog turns health NOT_SERVING past a limit."""
        if self._thread.ident is not None and not self._thread.is_alive() and not self._stopping:
            return float("inf")
        since = self._busy_since
        return 0.0 if since is None else time.perf_counter() - since

    # Gauges.
    @property
    def live_jobs(self) -> int:
        """Prompts submitted and not finished."""
        return self.prompts.live_jobs

    @property
    def queued_tokens(self) -> int:
        return self.prompts.queued_tokens

    @property
    def waiting(self) -> int:
        """Prompts queued (a long prompt part-way through its chunks included)."""
        with self._wake:
            return len(self.prompts)

    def calibrate(self) -> None:
        """Before the service takes requests (blocking; call off the event loop): a few timed prompt passes, so
        that its first requests are placed by measured costs (PromptQueue.calibrate). A failure is logged: the fit
        then starts from the first passes served."""
        try:
            self.prompts.calibrate()
        except Exception:
            log.exception("calibrating the prompt-pass costs failed; they are fitted from the passes served")

    def report_costs(self, info: worker_pb2.WorkerInfo) -> worker_pb2.WorkerInfo:
        """`info` with its latency model and what it holds by that model: the fields the gateway places by."""
        costs = self.costs
        info.costs.CopyFrom(worker_pb2.Costs(
            pass_coefficients=costs.passes.coefficients if costs.passes.samples else [],
            step_coefficients=costs.steps.coefficients if costs.steps.samples else [],
            passes=costs.passes.samples, steps=costs.steps.samples, chunk_tokens=self.prompts.chunk_tokens))
        info.backlog_s, info.short_backlog_s, info.long_prompts = self.backlog()
        if self.batch is not None:
            info.pass_budget_s, info.running, info.running_tokens = (self.pass_budget_s(), self.running,
                                                                      self.running_tokens)
        return info

    def backlog(self) -> tuple[float, float, int]:
        """Predicted seconds until the prompts queued or running here are done, the short prompts' part of it,
        and the long prompts waiting (PromptQueue.backlog)."""
        with self._wake:
            return self.prompts.backlog()

    @property
    def running_tokens(self) -> int:
        """Tokens held by the sequences in the decode batch (what a step attends to)."""
        return 0 if self.batch is None else sum(seq.cached for seq in list(self.batch.running))

    @property
    def running(self) -> int:
        """Sequences in the decode batch."""
        return 0 if self.batch is None else len(self.batch)

    @property
    def live_sequences(self) -> int:
        """Sequences prefilling here, waiting to join, or in the batch."""
        with self._wake:
            return self.running + len(self._joining) + self.prompts.live_jobs

    # The engine thread.
    def _loop(self) -> None:
        while self._wait_for_work():
            self._busy_since = time.perf_counter()
            try:
                self._decode_step()
                self.prompts.run_next_pass()
                # A backlog: passes back to back, each pausing at a layer boundary for a step once the budget since
                # the last one is spent (_between_layers), so short chunks fill the budget too. Without layered
                # prefill (prompt_pass_s 0) nothing would pause them: passes then alternate with steps as usual.
                while self._busy and self.prompts.between_layers is not None and self.prompts and not self._stopping:
                    self._busy_since = time.perf_counter()  # each pass is an iteration for the stall watchdog
                    self.prompts.run_next_pass()
            except Exception:  # each stage fails its own requests; this guard keeps the thread serving the rest
                log.exception("engine iteration failed")
            finally:
                self._busy_since = None
        with self._wake:
            self.prompts.drain("the engine shut down")

    def _wait_for_work(self) -> bool:
        with self._wake:
            while not (self._stopping or self.running or self._joining or self.prompts or self._abort_pending):
                self._wake.wait()
            self._abort_pending = False
            return not self._stopping

    def _decode_step(self) -> None:
        """Leaves, one step of the batch, then joins: nothing on a prefill core. Joining after the step puts the
        copy of a long prompt's KV (~3 ms for 1,500 tokens in bfloat16 on the CPU) inside the time a prompt pass
        may take before the next step, not in front of this one; a joiner decodes from the next step."""
        if self.batch is None:
            return
        self.batch.leave([seq for seq in self.batch.running if seq.aborted])
        if self.batch.running:
            started = time.perf_counter()
            if self._step_started is not None and self._on_interval is not None:
                self._on_interval(started - self._step_started)
            self._step_started = started
            try:
                self.batch.step()
            finally:
                self._stepped_at = time.perf_counter()
                took = self._stepped_at - started
                self._step_s = took if not self._step_s else self._step_s + STEP_WEIGHT * (took - self._step_s)
        else:
            self._step_started = None
        with self._wake:
            joining, self._joining = list(self._joining), collections.deque()
            if self._busy_pass_steps:
                self._busy = self.prompts.backlog()[0] > self._busy_backlog_s
        for seq, kv, release in joining:  # each join first frees the blocks of sequences aborted since
            try:
                self.batch.start(seq, kv)
            finally:
                release()

    def _between_layers(self) -> None:
        """At a layer boundary of a prompt pass: a decode step, once the running streams (or sequences waiting to
        join) would wait more than the pass budget since the last one if the pass ran one more layer as long as
        the last. The pass's own state stays untouched."""
        now = time.perf_counter()
        layer_s = now - max(self._boundary_at, self._stepped_at)
        self._boundary_at = now
        if (self.running or self._joining) and now - self._stepped_at + layer_s > self.pass_budget_s():
            self._step_inside_pass("between prompt layers")

    def _step_while_waiting(self) -> bool:
        """A split prompt's pass waits for its prefix's next layer: the streams here take a step meanwhile (True),
        if any run. Waiting is not a stall: the watchdog's clock starts again."""
        self._busy_since = time.perf_counter()
        if not (self.running or self._joining):
            return False
        self._step_inside_pass("while a split prompt waited")
        self._boundary_at = time.perf_counter()
        return True

    def _step_inside_pass(self, where: str) -> None:
        """A decode step run from inside a prompt pass: one that fails fails its own sequences; the pass goes on."""
        try:
            self._decode_step()
        except Exception:
            log.exception("decode step %s failed", where)

    def pass_budget_s(self) -> float:
        """How long a colocated prompt pass may run since the last decode step, the least any running sequence
        allows: one with a time-per-token target allows that target less a recent step; one without, the default
        budget, `prompt_pass_s` or `pass_steps` recent steps if that is less, or while prompts queue here as a
        backlog, `busy_pass_steps` recent steps if that is more. 0: passes run whole."""
        if not self._prompt_pass_s or self.batch is None:
            return 0.0
        default = self._prompt_pass_s
        if self._pass_steps and self._step_s:
            default = min(default, self._pass_steps * self._step_s)
        if self._busy and self._step_s:
            default = max(default, self._busy_pass_steps * self._step_s)
        running = list(self.batch.running)
        if not any(seq.tpot_target_s for seq in running):
            return default
        return max(0.0, min(seq.tpot_target_s - self._step_s if seq.tpot_target_s else default for seq in running))

    def _prompt_done(self, seq: Sequence, outcome: Prefilled | BaseException) -> None:
        """A colocated prompt's pass ended: its first token goes out, and it joins the batch."""
        assert self.batch is not None, "colocated prompts run on a decode core"
        if seq.aborted:
            return  # Generate's handler already ended its call
        if isinstance(outcome, BaseException):
            seq.emit([], FAILED)  # logged where it failed
            return
        seq.tokens = [outcome.first_token]
        reason = seq.finish_reason(self.batch.max_len)
        seq.emit(seq.tokens[:], reason)
        if not reason:
            self.batch.join(seq, pieces_of(outcome.kv))
