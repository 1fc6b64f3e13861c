"""The decode engine: one thread owns the model and runs a continuous batch over a paged KV cache.

Sequences join between steps once their whole KV arrived, taking the blocks their prompt + max_tokens need, and
leave between steps when finished or aborted, giving them back. A step is one forward pass over every running
sequence, each attending to its own blocks up to its own length (model_runner/paged_cache.py).

Colocated requests bring a prompt instead of KV: the engine prefills it itself, one pass between two decode
steps, scheduled as on a prefill worker (model_runner/scheduling.py): short prompts batched, long ones in chunks
of at most `prefill_chunk` tokens taking turns with them (chunked prefill, as vLLM does by default). So a long
prompt delays running streams by one chunk at a time, never by its whole forward pass, and a short prompt
waits at most one chunk behind it. Its first token is sampled here and it joins the batch like any other
sequence.
"""

from __future__ import annotations

import collections
import logging
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field

import torch
from transformers import DynamicCache

from model_runner.forward import LayerKV, cached_layers, decode_step, prefill_pass
from model_runner.loading import LoadedModel
from model_runner.paged_cache import KVPieces, PagedKVCache, pieces_of
from model_runner.sampling import SamplingParams, sample
from model_runner.scheduling import PromptScheduler

log = logging.getLogger(__name__)

# emit(new_token_ids, finish_reason): called from the engine thread; finish_reason "" while running, FAILED
# when the engine could not continue the sequence.
Emit = Callable[[list[int], str], None]
FAILED = "error"


@dataclass
class Sequence:
    request_id: str
    prompt_len: int
    max_tokens: int
    sampling: SamplingParams
    stop_token_ids: frozenset[int]
    emit: Emit
    tokens: list[int] = field(default_factory=list)  # generated so far; tokens[0] came from prefill
    blocks: list[int] = field(default_factory=list)  # its KV blocks in the engine's cache, while it runs
    aborted: bool = False  # set by DecodeEngine.abort: this object, never a later request with the same id
    # For its trace, when traced: (start, end, batch size) of every step it rode in (perf_counter), and when it
    # was handed to the engine and when it joined the batch.
    steps: list[tuple[float, float, int]] | None = None
    submitted_at: float = 0.0
    joined_at: float = 0.0

    @property
    def cached(self) -> int:
        """Positions in the KV cache: the prompt and every generated token but the last (the next input)."""
        return self.prompt_len + len(self.tokens) - 1

    def finish_reason(self, max_model_len: int) -> str:
        if self.tokens[-1] in self.stop_token_ids:
            return "stop"
        if len(self.tokens) >= self.max_tokens or self.cached + 1 >= max_model_len:
            return "length"
        return ""


@dataclass(eq=False)
class _Prefill:
    """A colocated prompt waiting for, or part-way through, its prefill."""

    seq: Sequence
    token_ids: list[int]
    cache: DynamicCache = field(default_factory=DynamicCache)  # a long prompt's chunks so far
    done: int = 0  # prompt tokens already in `cache`

    @property
    def abandoned(self) -> bool:
        return self.seq.aborted


class DecodeEngine:
    def __init__(self, runner: LoadedModel, kv_blocks: int, prefill_chunk: int = 256,
                 prefill_batch_tokens: int = 256, on_step: Callable[[float, int], None] | None = None) -> None:
        """`kv_blocks`: the paged cache's size, in blocks of model_runner/paged_cache.BLOCK_SIZE tokens.
        `on_step(seconds, batch size)` is called after every decode step (engine thread): metrics."""
        spec = runner.spec
        self._on_step = on_step
        self.runner = runner
        self.max_len = spec.max_model_len
        self.cache = PagedKVCache(spec.num_layers, kv_blocks, spec.num_kv_heads, spec.head_dim, runner.dtype,
                                  runner.device)
        self._running: list[Sequence] = []
        self._joining: collections.deque[tuple[Sequence, KVPieces, Callable[[], None]]] = collections.deque()
        self._prefills: PromptScheduler[_Prefill] = PromptScheduler(prefill_batch_tokens, prefill_chunk)
        self._prefilling = 0  # prompts taken off the queue for the pass under way
        self._abort_pending = False
        self._wake = threading.Condition()
        self._stopped = False
        self.steps = 0
        self._thread = threading.Thread(target=self._loop, name="decode-engine", daemon=True)

    def start(self) -> None:
        self._thread.start()

    def stop(self) -> None:
        with self._wake:
            self._stopped = True
            self._wake.notify()
        self._thread.join(timeout=30)

    # Called from the event loop.
    def submit(self, seq: Sequence, kv: KVPieces, release: Callable[[], None]) -> None:
        """Queue a sequence to join at the next step; `release()` is called once `kv` was copied in (or dropped)."""
        seq.submitted_at = time.perf_counter()
        with self._wake:
            self._joining.append((seq, kv, release))
            self._wake.notify()

    def submit_prompt(self, seq: Sequence, prompt: list[int]) -> None:
        """Queue a colocated request: prefill `prompt` here, emit the first token, then decode like the rest."""
        seq.submitted_at = time.perf_counter()
        with self._wake:
            self._prefills.add(_Prefill(seq, prompt))
            self._wake.notify()

    def abort(self, seq: Sequence) -> None:
        with self._wake:
            seq.aborted = True
            self._abort_pending = True
            self._wake.notify()

    @property
    def running(self) -> int:
        """Sequences in the batch."""
        return len(self._running)

    @property
    def live_sequences(self) -> int:
        with self._wake:
            return len(self._running) + len(self._joining) + len(self._prefills) + self._prefilling

    # The engine thread.
    def _loop(self) -> None:
        while self._wait_for_work():
            try:
                self._join_and_leave()
                if self._running:
                    self._step()
                self._prefill_next_pass()
            except Exception:  # a broken step must not strand its sequences: fail them and keep serving
                log.exception("decode step failed; failing %d running sequences", len(self._running))
                for seq in self._running:
                    seq.emit([], FAILED)
                self._leave(list(self._running))

    def _wait_for_work(self) -> bool:
        with self._wake:
            while not (self._stopped or self._running or self._joining or self._prefills or self._abort_pending):
                self._wake.wait()
            return not self._stopped

    def _join_and_leave(self) -> None:
        with self._wake:
            joining, self._joining = list(self._joining), collections.deque()
            self._abort_pending = False
        # Leave first: a joiner may need the blocks an aborted sequence is giving up.
        self._leave([seq for seq in self._running if seq.aborted])
        for seq, kv, release in joining:
            try:
                reason = "" if seq.aborted else seq.finish_reason(self.max_len)  # the first token may end it
                if seq.aborted or reason:
                    seq.emit([], reason or FAILED)
                    continue
                try:
                    self._join(seq, kv)
                except Exception:
                    log.exception("loading the KV of %s failed", seq.request_id)
                    seq.emit([], FAILED)
                    continue
            finally:
                release()

    def _prefill_next_pass(self) -> None:
        """One prefill pass over colocated prompts; each prompt that completes samples its first token and joins."""
        with self._wake:
            self._prefills.drop_abandoned()  # Generate's handler already ended their calls
            jobs = self._prefills.next_pass()
            self._prefilling = len(jobs)
        if not jobs:
            return
        admitted: set[_Prefill] = set()  # joined, finished or failed on their own: a later failure leaves them be
        try:
            if self._prefills.is_long(jobs[0]):
                job = jobs[0]
                chunk = job.token_ids[job.done : job.done + self._prefills.chunk_tokens]
                logits = prefill_pass(self.runner, [chunk], job.cache)[0]
                job.done += len(chunk)
                if job.done == len(job.token_ids):
                    with self._wake:
                        self._prefills.finished_long(job)
                    self._admit_prefilled(job.seq, logits, cached_layers(job.cache))
                    admitted.add(job)
            else:
                cache = DynamicCache()
                logits = prefill_pass(self.runner, [job.token_ids for job in jobs], cache)
                for row, job in enumerate(jobs):
                    self._admit_prefilled(job.seq, logits[row], cached_layers(cache, row, len(job.token_ids)))
                    admitted.add(job)
        except Exception:
            failed = [job for job in jobs if job not in admitted]
            log.exception("prefilling %s failed", ", ".join(job.seq.request_id for job in failed))
            for job in failed:
                with self._wake:
                    self._prefills.finished_long(job)
                job.seq.emit([], FAILED)
        finally:
            with self._wake:
                self._prefilling = 0

    def _admit_prefilled(self, seq: Sequence, logits: torch.Tensor, kv: list[LayerKV]) -> None:
        if seq.aborted:
            return
        token = self._sample(seq, logits)
        if token is None:
            return
        seq.tokens = [token]
        reason = seq.finish_reason(self.max_len)
        seq.emit(seq.tokens[:], reason)
        if not reason:
            self._join(seq, pieces_of(kv))

    def _join(self, seq: Sequence, kv: KVPieces) -> None:
        """Give the sequence the blocks of its prompt + max_tokens, copy its prompt's KV in, and run it."""
        seq.blocks = self.cache.allocate(seq.prompt_len + seq.max_tokens)
        try:
            self.cache.load(seq.blocks, kv, seq.prompt_len)
        except BaseException:
            self.cache.free(seq.blocks)
            seq.blocks = []
            raise
        self._running.append(seq)
        seq.joined_at = time.perf_counter()

    def _step(self) -> None:
        running, batch = self._running, len(self._running)
        started = time.perf_counter()
        logits = decode_step(self.runner, self.cache, [s.tokens[-1] for s in running], [s.blocks for s in running],
                             [s.cached for s in running])
        finished = []
        ended = time.perf_counter()
        for seq, row in zip(running, logits):
            token = self._sample(seq, row)
            if token is None:
                finished.append(seq)
                continue
            seq.tokens.append(token)
            reason = seq.finish_reason(self.max_len)
            seq.emit(seq.tokens[-1:], reason)
            if seq.steps is not None:
                seq.steps.append((started, ended, batch))
            if reason:
                finished.append(seq)
        self._leave(finished)
        self.steps += 1
        if self._on_step is not None:
            self._on_step(ended - started, batch)

    def _sample(self, seq: Sequence, logits: torch.Tensor) -> int | None:
        """The sequence's next token from its logits (vocab,); None when they cannot be sampled: the sequence is
        failed then, alone, and the rest of its batch goes on."""
        try:
            return sample(logits, seq.sampling, position=seq.prompt_len + len(seq.tokens))
        except Exception:
            log.exception("sampling the next token of %s failed; failing it alone", seq.request_id)
            seq.emit([], FAILED)
            return None

    def _leave(self, leaving: list[Sequence]) -> None:
        """Drop sequences from the batch and give their blocks back."""
        if not leaving:
            return
        gone = {id(seq) for seq in leaving}
        for seq in leaving:
            self.cache.free(seq.blocks)
            seq.blocks = []
        self._running = [seq for seq in self._running if id(seq) not in gone]
