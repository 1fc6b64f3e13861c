"""A worker whose engine thread is wedged (a hung kernel, a stuck pass) stops reporting SERVING, and reports it
again once the engine moves: the gateway's health checks then route around it."""

from __future__ import annotations

import asyncio
import threading
from pathlib import Path
from typing import Any

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

import engine.prompts as prompts_module
from engine.core import EngineCore
from engine.prompts import Prefilled, PromptJob
from model_runner.loading import ModelConfig
from protos.types import SamplingParams
from serving import server as serving

SERVING, NOT_SERVING = health_pb2.HealthCheckResponse.SERVING, health_pb2.HealthCheckResponse.NOT_SERVING


def test_a_wedged_engine_turns_health_not_serving_until_it_moves_again(
    tiny_model_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    runner = ModelConfig(model=str(tiny_model_dir), dtype="float32").load()
    entered, release = threading.Event(), threading.Event()
    real_pass = prompts_module.prefill_pass

    def wedged_pass(*args: Any, **kwargs: Any) -> Any:  # a pass that hangs until the test lets it go
        entered.set()
        release.wait(60)
        return real_pass(*args, **kwargs)

    monkeypatch.setattr(prompts_module, "prefill_pass", wedged_pass)
    monkeypatch.setattr(serving, "WATCHDOG_PERIOD_S", 0.05)
    engine = EngineCore(runner)
    engine.start()
    outcomes: list[Prefilled | BaseException] = []

    async def scenario() -> list[int]:
        server, port, health = await serving.listen("prefill", serving.ServerConfig(), 0, lambda _: [])
        watchdog = asyncio.ensure_future(serving.watchdog_loop("prefill", health, engine.stalled, stall_s=0.3))
        seen = []
        try:
            async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as channel:
                stub = health_pb2_grpc.HealthStub(channel)

                async def status_becomes(wanted: int) -> None:
                    for _ in range(200):  # 10 s at most
                        reply = await stub.Check(health_pb2.HealthCheckRequest(), timeout=5)
                        if reply.status == wanted:
                            seen.append(wanted)
                            return
                        await asyncio.sleep(0.05)
                    raise AssertionError(f"health never became {wanted}")

                # 1. An idle engine serves.
                await status_becomes(SERVING)
                assert engine.stalled() == 0.0
                # 2. A pass hangs: past --stall-s the worker reports NOT_SERVING, while still answering RPCs.
                engine.submit(PromptJob([1, 2, 3], SamplingParams(temperature=0.0), None, outcomes.append))
                assert await asyncio.to_thread(entered.wait, 10)
                await status_becomes(NOT_SERVING)
                # 3. The pass ends: SERVING again, and the prompt got its first token.
                release.set()
                await status_becomes(SERVING)
        finally:
            watchdog.cancel()
            await server.stop(0)
        return seen

    try:
        assert asyncio.run(scenario()) == [SERVING, NOT_SERVING, SERVING]
    finally:
        release.set()
        engine.close()
    assert len(outcomes) == 1 and isinstance(outcomes[0], Prefilled)
    assert (engine.live_jobs, engine.queued_tokens, engine.stalled()) == (0, 0, 0.0)
