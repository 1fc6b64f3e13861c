"""The services' side of the engine core: every hop between the engine thread and a servicer's event loop.

What the engine thread hands on for a request (a prompt's KV layer by layer and its outcome, a sequence's tokens)
is scheduled onto the event loop that asked for it, so a servicer's handlers only ever see it there; the calls
that block on the engine (calibrating, closing) run on a worker thread, off the loop.
"""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Callable

import torch

from engine.core import EngineCore
from engine.prompts import Prefilled, PromptJob
from engine.sequence import Emit
from model_runner.forward import LayerKV
from protos.types import SamplingParams

# A prompt's finished layer as the event loop receives it: (layer, keys, values), each (kv_heads, tokens, head_dim).
Layer = tuple[int, torch.Tensor, torch.Tensor]


class EngineClient:
    def __init__(self, core: EngineCore) -> None:
        self.core = core

    def prefill(self, token_ids: list[int], sampling: SamplingParams, on_layer: Callable[[Layer], None],
                abandon: threading.Event, *, kv_home: list[LayerKV] | None = None, decoded: int = 0,
                cache_salt: str = "") -> asyncio.Future[Prefilled]:
        """Queue a prompt (PromptJob's fields); each finished layer reaches `on_layer` on this event loop, and the
        future settles there with its Prefilled or the exception that ended it. Raises as EngineCore.submit does
        (QueueFull, Abandoned)."""
        loop = asyncio.get_running_loop()
        result: asyncio.Future[Prefilled] = loop.create_future()

        def deliver(layer: int, keys: torch.Tensor, values: torch.Tensor) -> None:  # engine thread
            loop.call_soon_threadsafe(on_layer, (layer, keys, values))

        def finish(outcome: Prefilled | BaseException) -> None:  # engine thread
            loop.call_soon_threadsafe(_settle, result, outcome)

        self.core.submit(PromptJob(token_ids, sampling, deliver, finish, abandon, kv_home=kv_home, decoded=decoded,
                                   cache_salt=cache_salt))
        return result

    def emit_to(self, put: Callable[[tuple[list[int], str]], None]) -> Emit:
        """A Sequence's `emit`: each (token_ids, finish_reason) the engine thread emits reaches `put` (a queue's
        put_nowait) on this event loop."""
        loop = asyncio.get_running_loop()

        def emit(token_ids: list[int], reason: str) -> None:  # engine thread -> this loop
            loop.call_soon_threadsafe(put, (token_ids, reason))

        return emit

    async def calibrate(self) -> None:
        await asyncio.to_thread(self.core.calibrate)

    async def close(self) -> None:
        await asyncio.to_thread(self.core.close)


def _settle(result: asyncio.Future[Prefilled], outcome: Prefilled | BaseException) -> None:
    if result.done():  # the handler already left
        return
    if isinstance(outcome, BaseException):
        result.set_exception(outcome)
    else:
        result.set_result(outcome)
