"""The decode worker's /metrics, and what each decode step and each sequence record in them and in the trace."""

from __future__ import annotations

import time

from decode_service.lending import SegmentLender
from decode_service.reservations import ReservationTable
from engine.core import EngineCore
from engine.sequence import Sequence
from serving import tracing
from serving.metrics import Metrics


def decode_metrics(engine: EngineCore, table: ReservationTable, lender: SegmentLender) -> Metrics:
    return Metrics(
        gauges={
            "pdserve_live_reservations": ("reservations waiting for or receiving KV", lambda: table.awaiting_kv),
            "pdserve_live_sequences": ("sequences prefilling, joining or in the batch",
                                       lambda: engine.live_sequences),
            "pdserve_live_kv_bytes": ("KV bytes reserved or admitted", lambda: table.kv_bytes),
            "pdserve_live_buffer_bytes": ("shared-memory KV segments lent to live requests",
                                          lambda: lender.lent_bytes),
            "pdserve_num_requests_running": ("sequences in the decode batch", lambda: engine.running),
            "pdserve_num_requests_waiting": ("sequences waiting for their KV, or to join the batch",
                                             lambda: engine.live_sequences - engine.running + table.awaiting_kv),
            "pdserve_kv_cache_usage_perc": ("fraction of the KV budget reserved or in use",
                                            lambda: table.kv_bytes / table.kv_budget_bytes),
        },
        counters={"pdserve_cancellations": "requests whose caller cancelled or left mid-request",
                  "pdserve_rejections": "reservations refused: no slot or KV budget",
                  "pdserve_generation_tokens": "tokens decoded (the first, sampled by prefill, excluded)",
                  "pdserve_kv_transfer_bytes": "KV bytes received, by path (grpc, shm)",
                  "pdserve_kv_transfer_failures": "KV transfers refused or broken, by path"},
        histograms={"pdserve_kv_transfer_seconds": "a KV stream's header to its trailer, by path",
                    "pdserve_decode_step_seconds": "one forward pass of the decode batch",
                    "pdserve_decode_interval_seconds": "from one decode step's start to the next one's while "
                                                       "sequences run: the gap a running stream sees",
                    "pdserve_decode_batch_size": "sequences in a decode step",
                    "pdserve_request_decode_time_seconds": "a sequence's time in the batch, join to finish"})


def observe_step(metrics: Metrics, seconds: float, batch: int) -> None:  # engine thread
    metrics.observe("pdserve_decode_step_seconds", seconds)
    metrics.observe("pdserve_decode_batch_size", batch)
    metrics.count("pdserve_generation_tokens", batch)


def observe_interval(metrics: Metrics, seconds: float) -> None:  # engine thread
    metrics.observe("pdserve_decode_interval_seconds", seconds)


def record_sequence(metrics: Metrics, seq: Sequence, colocated: bool) -> None:
    """The engine's work for this sequence, as children of the current (decode) span, and its decode time."""
    ended = seq.steps[-1][1] if seq.steps else time.perf_counter()
    if seq.joined_at:
        metrics.observe("pdserve_request_decode_time_seconds", ended - seq.joined_at)
    if seq.steps is None:
        return
    if seq.joined_at:  # the wait for the batch (colocated: the prefill too)
        tracing.record("decode.prefill" if colocated else "decode.join", None, seq.submitted_at, seq.joined_at)
    for number, (started, finished, batch) in enumerate(seq.steps, 1):
        tracing.record("decode.step", None, started, finished, {"pdserve.step": number, "pdserve.batch_size": batch})
