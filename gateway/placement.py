"""Where a request's prompt runs: on a prefill worker (disaggregated) or on a decode worker that prefills it between
its steps (colocated), chosen per attempt by the time to first token each choice is predicted to give.

Each worker reports its latency model (WorkerInfo.costs, fitted on its own passes and steps: serving/costs.py) and
the seconds of prompt work it holds (backlog_s). For a prompt of n tokens the gateway predicts:
- on prefill worker p: TTFT = backlog(p) + prompt(p, n). Its KV then goes to decode while decode's streams go on;
- colocated on decode worker d: its passes share d's core with the decode steps. While sequences run, a pass yields
  to a step once it has run `pass_budget_s` (layered prefill, engine/core.py), so prompts get a share
  s = budget / (budget + step) of the core and TTFT = (backlog(d) + prompt(d, n)) / s + step. Its running streams
  then wait up to step + budget between tokens (the predicted TPOT of that choice).
backlog(w) is what the last poll read plus the predicted work of the prompts this gateway sent since. A
disaggregated prompt's KV handoff does not delay its first token (prefill sends it at once), but its second:
the handoff's exposed time is fitted per path (shm, grpc) on the prompt's tokens from every finished transfer,
and told with the choice. The choice with the lowest predicted TTFT wins; a choice whose TPOT would break the
time-per-token objective (`tpot_s`) is taken only when every choice does. Until the workers report costs (the
first poll), the fixed thresholds decide (Colocation), as they do with --placement threshold.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

from gateway.request import GenerateParams
from gateway.workers import Colocation, Pool, Worker
from serving.costs import LinearFit, prompt_seconds, step_features


@dataclass(frozen=True)
class Option:
    where: str  # "prefill", "colocated" or "split"
    worker: str  # the address of the worker that would prefill (split: the prefill worker, of the prefix)
    ttft_s: float  # predicted time to first token
    tpot_s: float  # predicted time between tokens of the decode worker's streams meanwhile (0: not predicted)
    model_s: float = 0.0  # the cost model's TTFT, before the learnt correction (ttft_s is after)
    decode: str = ""  # split: the decode worker that prefills the rest
    split: int = 0  # split: the prompt tokens the prefill worker prefills

    def describe(self) -> str:
        where = (f"split {self.split} tokens on {self.worker}, the rest on {self.decode}" if self.split else
                 f"{self.where} {self.worker}")
        return f"{where}: TTFT {self.ttft_s:.2f} s, TPOT {self.tpot_s * 1e3:.0f} ms"


@dataclass
class Decision:
    colocated: bool
    reason: str  # "model", or why the thresholds decided
    options: list[Option] = field(default_factory=list)  # best first, by the model
    decode: str = ""  # colocated or split: the decode worker predicted fastest, to reserve on first
    split: int = 0  # split prefill: the prompt tokens a prefill worker prefills (0: not split)
    charge: tuple[Worker, float, bool] | None = None  # the chosen worker, the prompt work it is sent, and if short
    learn: Callable[[str, float, float], None] | None = None  # (where, actual, model's TTFT): Placement.learn
    charged: object = None  # the worker's WorkerInfo when `commit` charged it; None: nothing charged
    handoff: tuple[str, float] | None = None  # disaggregated: the KV handoff's predicted path and exposed seconds

    def first_token(self, seconds: float) -> None:
        """The attempt's first token came `seconds` after it began: the prediction's error is learnt."""
        if self.learn is not None and self.reason == "model" and self.options:
            best = self.options[0]
            self.learn(best.where, seconds, best.model_s)

    def commit(self) -> None:
        """The prompt is sent: its work counts in the chosen worker's backlog until the next poll reads the worker,
        or until the prompt is done (`release`), whichever comes first."""
        if self.charge is None or self.charged is not None:
            return
        worker, seconds, short = self.charge
        worker.picked_s += seconds
        if short:
            worker.picked_short_s += seconds
        self.charged = worker.info

    def release(self) -> None:
        """The prompt is done (its first token came) or failed: its work no longer waits on the worker. After a
        poll of the worker (a new `info`) the charge is gone already, and the poll tells the rest."""
        if self.charge is None or self.charged is None:
            return
        worker, seconds, short = self.charge
        if worker.info is self.charged:
            worker.picked_s = max(0.0, worker.picked_s - seconds)
            if short:
                worker.picked_short_s = max(0.0, worker.picked_short_s - seconds)
        self.charge = self.charged = None

    @property
    def predicted_ttft_s(self) -> float | None:
        return self.options[0].ttft_s if self.reason == "model" and self.options else None

    def explain(self) -> str:
        if self.reason != "model":
            where = "colocated" if self.colocated else f"split at {self.split} tokens" if self.split else "prefill"
            return f"{where} ({self.reason})"
        told = "; ".join(option.describe() for option in self.options)
        if self.handoff is not None:
            path, seconds = self.handoff
            told += f"; KV handoff by {path} predicted to hold the second token {seconds * 1e3:.0f} ms"
        return told


def _usable(worker: Worker) -> bool:
    return worker.serving and not worker.breaker.is_open() and worker.info is not None


def _pass_coefficients(worker: Worker) -> list[float]:
    assert worker.info is not None
    return list(worker.info.costs.pass_coefficients)


def _wait_s(worker: Worker, tokens: int, cached: int = 0) -> float:
    """How long a new prompt of `tokens` (`cached` of them in the worker's prefix cache) would wait in the worker's
    queue: a short one (a chunk at most) for the short prompts and one chunk of a long one, which take turns with
    them (engine/scheduler.py); a long one for everything. Prompts this gateway sent since the last poll count
    too."""
    info = worker.info
    assert info is not None
    chunk = info.costs.chunk_tokens
    if _is_short(worker, tokens, cached):
        longs = info.long_prompts or worker.picked_s > worker.picked_short_s
        long_pass = prompt_seconds(_pass_coefficients(worker), chunk) if longs else 0.0
        return info.short_backlog_s + worker.picked_short_s + long_pass
    return info.backlog_s + worker.picked_s


def _is_short(worker: Worker, tokens: int, cached: int = 0) -> bool:
    """Whether the worker's scheduler would batch the prompt rather than run it alone, in chunks: at most a chunk,
    and no cached prefix to continue (engine/scheduler.py's is_long)."""
    assert worker.info is not None
    return tokens <= worker.info.costs.chunk_tokens and not cached


def _prompt_s(worker: Worker, tokens: int, cached: int = 0) -> float:
    """The passes that prefill the prompt after its `cached` tokens."""
    assert worker.info is not None
    chunk, left = worker.info.costs.chunk_tokens, tokens - cached
    return prompt_seconds(_pass_coefficients(worker), left, cached, chunk if chunk and left > chunk else 0)


def _step_s(worker: Worker, batch: int) -> float:
    """A decode step of `batch` sequences at the worker's current context per sequence, by its step fit."""
    assert worker.info is not None
    coefficients = worker.info.costs.step_coefficients
    if not coefficients:
        return 0.0
    running = worker.info.running
    context = worker.info.running_tokens * batch // running if running else 0
    return sum(c * x for c, x in zip(coefficients, step_features(batch, context)))


MIN_BUDGET_S = 0.001  # a target shorter than a step leaves prompts a layer between two steps (engine/core.py)
# A colocated prompt shares the decode worker's core with running streams: it must be predicted this much sooner
# than the best prefill worker, so that near-equal predictions keep prompts off decode.
COLOCATED_MARGIN = 1.1
# Split prefill: the longest a prefill worker may be predicted to wait before it starts a prefix (the decode
# worker's pass over the rest waits for that prefix's layers, and runs no other prompt meanwhile)
SPLIT_MAX_WAIT_S = 0.5
FORGET = 0.9  # the correction's memory: each first token weighs 1, the ones before 0.9 times what they weighed
# The correction before any first token, and what it keeps to where first tokens cannot tell its terms apart: none
# (first tokens at 0 s and at 1 s, predicted as such, each weighing a quarter of a first token, never fading; a
# sample of weight w is written as features and seconds times the square root of w).
NO_CORRECTION = (((0.5, 0.0), 0.0), ((0.5, 0.5), 0.5))
LEAST_SCALE = 0.5  # a corrected TTFT is never below half the model's


class Placement:
    """Per-attempt placement by predicted TTFT ("model") or by the fixed thresholds alone ("threshold")."""

    def __init__(self, mode: str, colocation: Colocation, ttft_ms: int = 0, tpot_ms: int = 0,
                 split_above: int = 0) -> None:
        """`ttft_ms`, `tpot_ms`: a request's service level when it asks for none (0: none). `split_above`: prompts
        of at least this many tokens may be split between a prefill and a decode worker (0: never)."""
        if mode not in ("model", "threshold"):
            raise ValueError(f"--placement {mode!r}: expected model or threshold")
        self.mode = mode
        self.colocation = colocation
        self.ttft_ms, self.tpot_ms, self.split_above = ttft_ms, tpot_ms, split_above
        # What the cost model misses, learnt per kind of choice from every first token as actual = fixed + scale *
        # model: a fixed part (the gateway's hops, a disaggregated prompt's KV handoff, which the passes do not
        # hold) and a scale (a colocated prompt's passes also wait for joins and the batch's growth). Fitting
        # both keeps a short prompt's fixed costs from multiplying a long prompt's prediction.
        self.correction = {where: LinearFit(2, forget=FORGET, prior=NO_CORRECTION)
                           for where in ("prefill", "colocated", "split")}
        # A KV handoff's exposed seconds on the prompt's thousands of tokens, per path, and the path seen last
        self.handoffs = {path: LinearFit(2, forget=FORGET) for path in ("shm", "grpc")}
        self.last_path = ""

    def learn_handoff(self, path: str, tokens: int, exposed_s: float) -> None:
        """A finished transfer of a `tokens`-token prompt's KV by `path` left `exposed_s` after its forward pass."""
        fit = self.handoffs.get(path)
        if fit is not None:
            fit.observe((1.0, tokens / 1e3), max(0.0, exposed_s))
            self.last_path = path

    def handoff(self, tokens: int) -> tuple[str, float] | None:
        """The KV handoff a disaggregated prompt of `tokens` is predicted to see: by the path the last one took, and
        its exposed seconds; None before any transfer has finished."""
        fit = self.handoffs.get(self.last_path)
        if fit is None or not fit.samples:
            return None
        return self.last_path, max(0.0, fit.predict((1.0, tokens / 1e3)))

    def learn(self, where: str, actual_s: float, model_s: float) -> None:
        self.correction[where].observe((1.0, model_s), actual_s)

    def corrected(self, where: str, model_s: float) -> float:
        """The model's TTFT for a choice of this kind, with what first tokens showed it misses. Until a kind has
        first tokens of its own, the other kind's correction serves for it too: what the first requests show (a
        busy machine, a cold start, the hops) is taken as common to every choice, so the kind tried first is not
        penalised against one nobody has tried."""
        fit = self.correction[where]
        if not fit.samples:
            others = [self.correction[kind] for kind in ("prefill", "colocated", "split") if kind != where]
            fit = next((other for other in others if other.samples), fit)
        return max(LEAST_SCALE * model_s, fit.predict((1.0, model_s)))

    def with_defaults(self, params: GenerateParams) -> GenerateParams:
        """The request with the gateway's default service level where it asked for none."""
        return dataclasses.replace(params, ttft_target_ms=params.ttft_target_ms or self.ttft_ms,
                                   tpot_target_ms=params.tpot_target_ms or self.tpot_ms)

    def decide(self, prompt_tokens: int, prefill: Pool, decode: Pool, tpot_ms: int = 0,
               prompt: Sequence[int] = (), cache_salt: str = "") -> Decision:
        """Where a prompt of `prompt_tokens` runs; `tpot_ms`: the request's time-per-token target (0: none). With
        the `prompt`'s cacheable tokens, a prefill worker's prediction leaves out the prefix it likely holds."""
        by_threshold = self.colocation.applies(prompt_tokens, prefill)
        # the fixed rule for split prefill: a prompt of split_above tokens or more, half on each side
        split = prompt_tokens // 2 if self.split_above and prompt_tokens >= self.split_above else 0
        if self.mode == "threshold" or not prefill.workers:
            if not prefill.workers:
                return Decision(by_threshold, "no prefill workers")
            return Decision(by_threshold and not split, "threshold", split=split)
        cached = prefill.cached_tokens(prompt, cache_salt)
        options = self.options(prompt_tokens, prefill, decode, tpot_ms / 1e3, cached)
        if options is None:
            return Decision(by_threshold and not split, "threshold: no costs reported yet", split=split)
        if not options:
            return Decision(by_threshold, "threshold: no worker serving")
        best = options[0]
        chosen = next(w for w in (decode if best.where == "colocated" else prefill).workers
                      if w.address == best.worker)
        held = cached.get(chosen.address, 0) if best.where == "prefill" else 0
        charged = best.split or prompt_tokens  # split: the prefill worker's part (the decode worker's poll tells)
        return Decision(best.where == "colocated", "model", options,
                        decode=best.decode or (best.worker if best.where == "colocated" else ""), split=best.split,
                        charge=(chosen, _prompt_s(chosen, charged, held), _is_short(chosen, charged, held)),
                        learn=self.learn,
                        handoff=self.handoff(prompt_tokens) if best.where == "prefill" else None)

    def options(self, prompt_tokens: int, prefill: Pool, decode: Pool, tpot_s: float = 0.0,
                cached: dict[str, int] | None = None) -> list[Option] | None:
        """Every placement, best first (those predicted slower than `tpot_s` per token last); None when a usable
        worker has reported no costs yet. `cached`: prompt tokens each prefill worker likely holds (by address)."""
        cached = cached or {}
        prefill_workers = [w for w in prefill.workers if _usable(w)]
        decode_workers = [w for w in decode.workers if _usable(w)]
        if any(not _pass_coefficients(w) for w in prefill_workers + decode_workers):
            return None
        # the decode worker a disaggregated request would reserve on, and its steps with one more sequence
        steady = min(decode_workers, key=lambda w: w.load(), default=None)
        tpot_disaggregated = 0.0 if steady is None else _step_s(steady, steady.info.running + 1)  # type: ignore[union-attr]
        options = []
        prefill_idle = False
        for worker in prefill_workers:
            held = cached.get(worker.address, 0)
            wait = _wait_s(worker, prompt_tokens, held)
            prefill_idle = prefill_idle or wait == 0
            model = wait + _prompt_s(worker, prompt_tokens, held)
            ttft = self.corrected("prefill", model)
            options.append(Option("prefill", worker.address, ttft, tpot_disaggregated, model))
        for worker in decode_workers:
            assert worker.info is not None
            if worker.info.running + worker.info.live_reservations >= worker.info.max_sequences:
                continue  # no room to reserve
            work = _wait_s(worker, prompt_tokens) + _prompt_s(worker, prompt_tokens)
            step = _step_s(worker, max(1, worker.info.running))
            budget = worker.info.pass_budget_s
            if tpot_s and budget:  # this request's own target bounds the budget while it runs there
                budget = min(budget, max(MIN_BUDGET_S, tpot_s - step))
            if worker.info.running and step > 0:
                slice_s = min(budget, work) if budget > 0 else work
                ttft = work * (slice_s + step) / slice_s + step
                tpot = step + (budget if budget > 0 else work)
            else:
                ttft, tpot = work, 0.0
            options.append(Option("colocated", worker.address, self.corrected("colocated", ttft), tpot, ttft))
        if self.split_above and prompt_tokens >= self.split_above:
            options += self._split_options(prompt_tokens, prefill_workers, decode_workers, tpot_s, cached)

        # Colocating a prompt skips a prefill queue; while a prefill worker could start it at once there is none
        # to skip, and a prediction that says otherwise compares two workers' fits of the same pass: calibration
        # noise (services started side by side on oversubscribed cores fit up to 16x apart), which only a prompt
        # sent to the idle worker corrects. So colocated choices then go after the prefill ones.
        def rank(option: Option) -> tuple[bool, bool, float]:
            colocated = option.where == "colocated"
            return (bool(tpot_s) and option.tpot_s > tpot_s, colocated and prefill_idle,
                    option.ttft_s * (COLOCATED_MARGIN if colocated else 1))

        return sorted(options, key=rank)

    def _split_options(self, prompt_tokens: int, prefill_workers: list[Worker], decode_workers: list[Worker],
                       tpot_s: float, cached: dict[str, int]) -> list[Option]:
        """Split prefill (engine/feed.py PrefixFeed): an idle prefill worker prefills the prompt's first k
        tokens while a decode worker prefills the rest in one pass that takes each layer of the prefix's KV as it
        comes. Both run layer by layer side by side, so the first token comes when the slower part is done:
        TTFT = max(prompt(p, k), (wait(d) + rest(d, n - k after k)) / s) + step, s the decode worker's share of
        its core as for a colocated prompt. Only a prefill worker that would start the prefix within
        SPLIT_MAX_WAIT_S takes part (the decode worker's pass waits for the prefix's layers meanwhile, and no other
        prompt of its runs), and only for a prompt with nothing cached there; k is the split predicted soonest."""
        options = []
        ready = sorted((_wait_s(w, prompt_tokens), w.address, w) for w in prefill_workers
                       if not cached.get(w.address))
        for wait, _, prefill_worker in ready[:1]:
            if wait > SPLIT_MAX_WAIT_S:
                break
            for worker in decode_workers:
                assert worker.info is not None
                if worker.info.running + worker.info.live_reservations >= worker.info.max_sequences:
                    continue
                step = _step_s(worker, max(1, worker.info.running))
                budget = worker.info.pass_budget_s
                if tpot_s and budget:
                    budget = min(budget, max(MIN_BUDGET_S, tpot_s - step))
                share = budget / (budget + step) if worker.info.running and step > 0 and budget > 0 else 1.0
                best: tuple[float, int] | None = None
                for tenth in range(3, 9):  # the prefix's share of the prompt, 30% to 80%
                    split = prompt_tokens * tenth // 10
                    ahead = wait + _prompt_s(prefill_worker, split)
                    rest = prompt_seconds(_pass_coefficients(worker), prompt_tokens - split, split)
                    ttft = max(ahead, (_wait_s(worker, prompt_tokens) + rest) / share) + step
                    if best is None or ttft < best[0]:
                        best = (ttft, split)
                assert best is not None
                ttft, split = best
                tpot = step + (budget if budget > 0 else ttft)
                options.append(Option("split", prefill_worker.address, self.corrected("split", ttft), tpot, ttft,
                                      decode=worker.address, split=split))
        return options
