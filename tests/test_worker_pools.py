"""The gateway's worker pools: least loaded first, draining and failed workers last; a draining worker finishes
what it has while new work goes elsewhere."""

from __future__ import annotations

import asyncio
import signal
from pathlib import Path

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from gateway.breakers import PairBreakers
from gateway.workers import Colocation, Pool
from pdserve.client import generate, stream
from pdserve.cluster import Service, spawn_service, stop_all, wait_ready
from protos import worker_pb2
from serving.metrics import scrape
from tests.helpers import POEM, assert_nothing_held, decoding_worker, start_cluster, wait_until


def _decode_pool(loads: list[int]) -> Pool:
    pool = Pool("decode", [f"127.0.0.1:{9000 + i}" for i in range(len(loads))])
    for worker, load in zip(pool.workers, loads):
        worker.info = worker_pb2.WorkerInfo(role="decode", live_sequences=load, kv_budget_bytes=100)
    return pool


def test_the_least_loaded_worker_comes_first_and_picks_count_until_the_next_poll() -> None:
    async def scenario() -> None:
        pool = _decode_pool([3, 1, 2])
        assert [w.address[-1] for w in pool.in_turn()] == ["1", "2", "0"]
        assert [w.address[-1] for w in pool.in_turn()][0] == "1"  # 1 + 1 picked = 2: tied with "2", round robin
        # now "1" carries 1 + 2 picked: "2" (2) goes first
        assert pool.in_turn()[0].address.endswith("2")
        await pool.close()

    asyncio.run(scenario())


def test_draining_failed_and_avoided_workers_go_last() -> None:
    async def scenario() -> None:
        pool = _decode_pool([0, 5, 5, 5])
        idle, busy, _, avoided = pool.workers
        idle.serving = False  # draining: health says NOT_SERVING
        busy.failed()  # its breaker is open
        order = pool.in_turn(avoid=frozenset({avoided.address}))
        assert [w.address[-1] for w in order] == ["2", "0", "1", "3"]
        busy.succeeded()
        assert busy.suspect_until == 0 and busy.failures == 0
        await pool.close()

    asyncio.run(scenario())


def test_a_short_prompt_is_colocated_only_while_prefill_is_busy() -> None:
    async def scenario() -> None:
        pool = Pool("prefill", ["127.0.0.1:9000", "127.0.0.1:9001"])
        busy, idle = pool.workers
        busy.info = worker_pb2.WorkerInfo(role="prefill", queued_tokens=3000)
        idle.info = worker_pb2.WorkerInfo(role="prefill", queued_tokens=100)
        rule = Colocation(below=512, queued=256)
        # the least loaded worker has 100 tokens to go: a short prompt is better served there
        assert not rule.applies(40, pool)
        idle.prefilling_tokens = 400  # this gateway's own prompts in flight there, fresher than the last poll
        assert rule.applies(40, pool) and not rule.applies(512, pool)
        idle.serving = False  # draining: the busy one is the only choice left
        assert rule.applies(40, pool)
        busy.failed()  # and its breaker is open: no prefill worker to wait for
        assert pool.least_queued_tokens() == float("inf") and rule.applies(40, pool)
        assert Colocation(below=512, queued=0).applies(40, Pool("prefill", ["127.0.0.1:9002"]))
        assert Colocation(below=0).applies(10**6, Pool("prefill", []))  # no prefill workers: every prompt
        assert not Colocation(below=0).applies(1, pool)
        await pool.close()

    asyncio.run(scenario())


def _draining(service: Service) -> bool:
    """Its health check says NOT_SERVING, or it refuses new calls: what the gateway's next poll finds."""
    with grpc.insecure_channel(service.address) as channel:
        try:
            reply = health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(), timeout=2)
        except grpc.RpcError:
            return True
        return reply.status != health_pb2.HealthCheckResponse.SERVING


def test_a_draining_decode_worker_finishes_its_stream_while_new_requests_go_elsewhere(tiny_model_dir: Path) -> None:
    poll_s = 0.1
    cluster = start_cluster(tiny_model_dir, decode=2, decode_args=("--grace=30",),
                            gateway_args=(f"--poll-interval={poll_s}",))
    try:
        address = cluster.gateway.address
        fields = {"prompt": POEM, "max_tokens": 400, "temperature": 0.0, "ignore_eos": True}
        # 1. A long stream runs on one decode worker; that worker is told to drain.
        responses = stream(address, 60, **fields)
        received = list(next(responses).token_ids)
        draining = decoding_worker(cluster)
        draining.process.send_signal(signal.SIGTERM)  # health turns NOT_SERVING; in-flight calls get the grace
        wait_until(lambda: _draining(draining), "the draining worker's health to leave SERVING")
        # ... and the gateway has read that at a poll: it routes to one decode worker
        wait_until(lambda: scrape(cluster.gateway.metrics).get("pdserve_serving_decode_workers") == 1,
                   "the gateway to count one serving decode worker")
        # 2. New requests go to the other worker at once, not to the draining one and then retried.
        for _ in range(4):
            completion = generate(address, timeout=60, prompt="Hi", max_tokens=4)
            assert completion.finish_reason and completion.timing.retries == 0  # routed around it, not retried
        # 3. The draining worker finishes its stream, all of it, without a migration, and then exits.
        last = None
        for response in responses:
            received += response.token_ids
            last = response
        assert last is not None and last.finish_reason == "length" and last.timing.migrations == 0
        assert len(received) == 400
        draining.process.wait(timeout=30)  # it exits once its stream is done
        cluster.decode.remove(draining)
        # 4. Leak check: nothing held on the workers left.
        assert_nothing_held(cluster)
    finally:
        cluster.stop()


def test_a_dns_name_becomes_one_worker_per_address_and_is_re_resolved() -> None:
    answers = {"workers.internal": ["10.0.0.1", "10.0.0.2"]}

    def resolver(host: str, port: int) -> list[str]:
        if host not in answers:
            raise OSError(f"{host}: name not known")
        return answers[host]

    async def scenario() -> None:
        pool = Pool("decode", ["workers.internal:7000", "127.0.0.1:7001"], resolver=resolver)
        assert [w.address for w in pool.workers] == ["10.0.0.1:7000", "10.0.0.2:7000", "127.0.0.1:7001"]
        answers["workers.internal"] = ["10.0.0.2", "10.0.0.3"]  # one replaced
        await pool.refresh()
        by_address = {w.address: w for w in pool.workers}
        assert set(by_address) == {"10.0.0.2:7000", "10.0.0.3:7000", "127.0.0.1:7001"}
        assert not by_address["10.0.0.3:7000"].serving  # joins the rotation once a poll finds it serving
        del answers["workers.internal"]  # DNS down: keep what it resolved to last
        await pool.refresh()
        assert {w.address for w in pool.workers} == set(by_address)
        await pool.close()

    asyncio.run(scenario())


def test_a_failed_prefill_to_decode_path_is_tried_last_until_it_works() -> None:
    pairs = PairBreakers()
    assert not pairs.is_open("p1", "d1")
    pairs.failed("p1", "d1")
    assert pairs.is_open("p1", "d1") and not pairs.is_open("p2", "d1") and not pairs.is_open("p1", "d2")
    pairs.succeeded("p1", "d1")
    assert not pairs.is_open("p1", "d1")


def test_a_gateway_given_host_names_resolves_them(tiny_model_dir: Path) -> None:
    cluster = start_cluster(tiny_model_dir)
    gateway = None
    try:
        names = [f"--{role}=localhost:{service.address.rsplit(':', 1)[1]}"
                 for role, services in (("prefill", cluster.prefill), ("decode", cluster.decode))
                 for service in services]
        gateway = spawn_service("gateway", "gateway", ["--port", "0", "--model", str(tiny_model_dir), *names])
        wait_ready([gateway], 120)
        assert generate(gateway.address, timeout=60, prompt="Hi", max_tokens=4).finish_reason
    finally:
        if gateway is not None:
            stop_all([gateway], grace_s=5)
        cluster.stop()
