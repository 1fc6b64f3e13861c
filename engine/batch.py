"""The continuous decode batch over a paged KV cache (engine thread only).

Sequences join between steps once their whole KV is here, taking the blocks their prompt + max_tokens need, and
leave between steps when finished or aborted, giving them back. A step is one forward pass over every running
sequence, each attending to its own blocks up to its own length (model_runner/paged_cache.py).
"""

from __future__ import annotations

import logging
import math
import time
from collections.abc import Callable

import torch

from engine.sequence import FAILED, Sequence
from model_runner.forward import decode_step
from model_runner.loading import LoadedModel
from model_runner.paged_cache import KVPieces, PagedKVCache
from model_runner.sampling import SAMPLING_EPS, best_logits, sample
from serving.costs import Costs

log = logging.getLogger(__name__)


class DecodeBatch:
    def __init__(self, runner: LoadedModel, kv_blocks: int,
                 on_step: Callable[[float, int], None] | None = None, costs: Costs | None = None) -> None:
        """`kv_blocks`: the paged cache's size, in blocks of model_runner/paged_cache.BLOCK_SIZE tokens.
        `on_step(seconds, batch size)` is called after every step: metrics. `costs`: every step's time goes into
        its decode-step fit."""
        spec = runner.spec
        self.runner = runner
        self.max_len = spec.max_model_len
        self.cache = PagedKVCache(spec.num_layers, kv_blocks, spec.num_kv_heads, spec.head_dim, runner.dtype,
                                  runner.device)
        self.running: list[Sequence] = []
        self.steps = 0
        self._on_step = on_step
        self._costs = costs

    def __len__(self) -> int:
        return len(self.running)

    def start(self, seq: Sequence, kv: KVPieces) -> None:
        """A sequence whose prompt KV and first token arrived: it ends now if that token ends it, else joins."""
        reason = FAILED if seq.aborted else seq.finish_reason(self.max_len)
        if reason:
            seq.emit([], reason)
        else:
            self.join(seq, kv)

    def join(self, seq: Sequence, kv: KVPieces) -> None:
        """Give the sequence the blocks of its prompt + max_tokens, copy its prompt's KV in, and run it. A sequence
        that cannot join is failed alone."""
        # A sequence aborted since the last step gives its blocks back first: a colocated prompt that finishes
        # its pass right after the step in which another request was cancelled may need exactly those blocks.
        self.leave([running for running in self.running if running.aborted])
        try:
            seq.blocks = self.cache.allocate(seq.prompt_len + seq.max_tokens)
            self.cache.load(seq.blocks, kv, seq.prompt_len)
        except Exception:
            log.exception("loading the KV of %s failed", seq.request_id)
            self.cache.free(seq.blocks)
            seq.blocks = []
            seq.emit([], FAILED)
            return
        self.running.append(seq)
        seq.joined_at = time.perf_counter()

    def step(self) -> None:
        """One token for every running sequence; a step that fails fails them all (and the engine goes on)."""
        try:
            self._step()
        except Exception:  # a broken step must not strand its sequences
            log.exception("decode step failed; failing %d running sequences", len(self.running))
            for seq in self.running:
                seq.emit([], FAILED)
            self.leave(list(self.running))

    def _step(self) -> None:
        running, batch = self.running, len(self.running)
        started = time.perf_counter()
        contexts = [s.cached for s in running]
        logits = decode_step(self.runner, self.cache, [s.tokens[-1] for s in running], [s.blocks for s in running],
                             contexts)
        picked = _greedy_picks(running, logits)
        finished = []
        ended = time.perf_counter()
        for seq, row, token in zip(running, logits, picked):
            if token is None:
                token = self.sample(seq, row)
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
        self.leave(finished)
        self.steps += 1
        if self._costs is not None:
            self._costs.observe_step(batch, sum(contexts), ended - started)
        if self._on_step is not None:
            self._on_step(ended - started, batch)

    @staticmethod
    def sample(seq: Sequence, logits: torch.Tensor) -> int | None:
        """The sequence's next token from its logits (vocab,); None when they cannot be sampled: the sequence is
        failed then, alone, and the rest of its batch goes on."""
        try:
            return sample(logits, seq.sampling, position=seq.prompt_len + len(seq.tokens))
        except Exception:
            log.exception("sampling the next token of %s failed; failing it alone", seq.request_id)
            seq.emit([], FAILED)
            return None

    def leave(self, leaving: list[Sequence]) -> None:
        """Drop sequences from the batch and give their blocks back."""
        if not leaving:
            return
        gone = set(leaving)
        for seq in leaving:
            self.cache.free(seq.blocks)
            seq.blocks = []
        self.running = [seq for seq in self.running if seq not in gone]


def _greedy_picks(running: list[Sequence], logits: torch.Tensor) -> list[int | None]:
    """Each greedy row's token, picked for the whole batch at once (model_runner/sampling.best_logits: one pass a
    row on the CPU, one copy back from a GPU); None for the rows that `sample` picks: those that sample at a
    temperature, and any row whose best logit is not finite (`sample` fails it alone)."""
    if not any(seq.sampling.temperature < SAMPLING_EPS for seq in running):
        return [None] * len(running)
    best, tokens = best_logits(logits)
    return [token if seq.sampling.temperature < SAMPLING_EPS and math.isfinite(value) else None
            for seq, value, token in zip(running, best, tokens)]
