"""Process and network faults in the KV handoff, with real processes: SIGKILL mid-transfer, a frozen network path.

Whatever dies, the decode worker must end up holding nothing (reservations, sequences, KV bytes, transfer
buffers) once the lease ends, keep serving, and leave no shared-memory segment behind for good.
"""

from __future__ import annotations

import signal
import subprocess
from pathlib import Path

import grpc
import pytest

from kv_wire.segments import SEGMENT_PREFIX, SHM_DIR
from pdserve.client import generate
from pdserve.cluster import spawn_service, stop_all, wait_ready
from pdserve.faults import FaultProxy
from protos import decode_pb2, decode_pb2_grpc, prefill_pb2, prefill_pb2_grpc, worker_pb2
from tests.helpers import GREEDY, assert_nothing_held, kv_stream, reserve, start_cluster, wait_until

LEASE_S = 2.0


def _info(stub: decode_pb2_grpc.DecodeStub) -> worker_pb2.WorkerInfo:
    return stub.GetInfo(worker_pb2.WorkerInfoRequest(), timeout=5)


def _killed(process: subprocess.Popen) -> None:
    process.send_signal(signal.SIGKILL)
    process.wait(timeout=10)  # reaped: a zombie would still count as a live owner


@pytest.mark.parametrize("transport", ["grpc", "shm"])
def test_killing_prefill_mid_transfer_leaves_decode_holding_nothing_once_the_lease_ends(
    deep_tiny_model_dir: Path, transport: str
) -> None:
    prefill_args = ("--no-kv-shm",) if transport == "grpc" else ()
    cluster = start_cluster(deep_tiny_model_dir, prefill_args=prefill_args, decode_args=(f"--lease={LEASE_S}",))
    # Prefill reaches decode through a proxy that freezes after 2 KiB: the header and the first chunks get through,
    # and the rest of the 400-tensor stream (at least 10 KiB even as shm descriptors) does not.
    proxy = FaultProxy(cluster.decode[0].address, stall_after=2048)
    try:
        with grpc.insecure_channel(cluster.decode[0].address) as d, \
                grpc.insecure_channel(cluster.prefill[0].address) as p:
            decode, prefill = decode_pb2_grpc.DecodeStub(d), prefill_pb2_grpc.PrefillStub(p)
            prompt = list(range(10, 210))
            generate = decode.Generate(decode_pb2.DecodeRequest(
                request_id="doomed", prompt_tokens=len(prompt), max_tokens=4, sampling=GREEDY), timeout=60)
            reservation = next(generate).reserved
            assert bool(reservation.shm_segment) and SHM_DIR.joinpath(reservation.shm_segment).exists()
            prefill_call = prefill.Prefill(prefill_pb2.PrefillRequest(
                request_id="doomed", token_ids=prompt, sampling=GREEDY, decode_address=proxy.address,
                reservation_token=reservation.token, shm_segment=reservation.shm_segment), timeout=60)
            assert next(prefill_call).WhichOneof("event") == "first_token"
            # Decode accepted the header and the stream is stuck mid-transfer.
            wait_until(lambda: _info(decode).live_transfers == 1 and proxy.stalled.is_set(), "a stuck transfer",
                       timeout_s=20)
            assert _info(decode).live_reservations == 1

            _killed(cluster.prefill[0].process)
            with pytest.raises(grpc.RpcError) as ended:
                list(generate)
            # the lease ended it, not the call's own 60 s deadline (the same code)
            assert ended.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED and "lease" in ended.value.details()
            info = _info(decode)
            assert (info.live_reservations, info.live_sequences, info.live_kv_bytes, info.live_buffer_bytes) == (
                0, 0, 0, 0)

            # The decode worker keeps serving: a valid handoff right after streams its tokens.
            call, token = reserve(decode, "after-the-kill", max_tokens=3)
            decode.TransferKV(iter(kv_stream(decode, "after-the-kill", token)), timeout=30)
            assert sum(len(e.tokens.token_ids) for e in call) == 2  # the first token came in the trailer
            assert_nothing_held(cluster, prefill=False)
    finally:
        proxy.close()
        cluster.stop()


def test_segments_of_a_killed_decode_worker_are_removed_when_the_next_one_starts(tiny_model_dir: Path) -> None:
    cluster = start_cluster(tiny_model_dir)
    try:
        with grpc.insecure_channel(cluster.decode[0].address) as channel:
            _, token = reserve(decode_pb2_grpc.DecodeStub(channel), "orphaned")
            segments = sorted(SHM_DIR.glob(f"{SEGMENT_PREFIX}{cluster.decode[0].process.pid}-*"))
            assert segments, "the reservation lent a segment"
            _killed(cluster.decode[0].process)  # with the reservation live: nothing ended it
        assert all(s.exists() for s in segments)  # a SIGKILLed owner cannot clean up

        successor = spawn_service("decode", "decode_service", ["--host", "127.0.0.1", "--port", "0", "--threads",
                                                               "1", "--model", str(tiny_model_dir)])
        try:
            wait_ready([successor], 180)  # as start_cluster: kernel loads took 30-47 s each on a loaded machine
            assert not any(s.exists() for s in segments)
        finally:
            stop_all([successor], grace_s=10)
    finally:
        cluster.stop()


def test_lease_ending_while_prefill_is_frozen_reaches_the_client_as_unavailable(tiny_model_dir: Path) -> None:
    """A frozen prefill worker stops renewing decode's lease: the lease ends, and the client, whose own deadline is
    far off, is told UNAVAILABLE naming the lease (never DEADLINE_EXCEEDED, which means the client's deadline)."""
    cluster = start_cluster(tiny_model_dir, decode_args=("--lease=1",))
    prefill = cluster.prefill[0].process
    try:
        prefill.send_signal(signal.SIGSTOP)  # the prompt waits, as in a long prefill queue
        try:
            with pytest.raises(grpc.RpcError) as failed:
                generate(cluster.gateway.address, timeout=30, prompt="Hello", max_tokens=4)
        finally:
            prefill.send_signal(signal.SIGCONT)
        assert failed.value.code() == grpc.StatusCode.UNAVAILABLE
        assert "lease" in (failed.value.details() or "")
        assert_nothing_held(cluster, within_s=5)
        assert generate(cluster.gateway.address, timeout=30, prompt="Hello", max_tokens=4).finish_reason
    finally:
        cluster.stop()
