"""The prefill worker's /metrics, and what each prompt records in them and in its trace."""

from __future__ import annotations

from opentelemetry import trace

from engine.core import EngineCore
from engine.prompts import Prefilled
from kv_wire.segments import SegmentMaps
from model_runner.prefix_cache import PrefixCache
from serving import tracing
from serving.metrics import Metrics


def prefill_metrics(engine: EngineCore, segments: SegmentMaps, prefix_cache: PrefixCache | None) -> Metrics:
    return Metrics(
        gauges={"pdserve_live_prefills": ("prompts queued or running", lambda: engine.live_jobs),
                "pdserve_queued_tokens": ("prompt tokens queued or running", lambda: engine.queued_tokens),
                "pdserve_num_requests_waiting": ("prompts queued", lambda: engine.waiting),
                "pdserve_num_requests_running": ("prompts in the forward pass under way",
                                                 lambda: engine.live_jobs - engine.waiting),
                "pdserve_mapped_segment_bytes": ("decode workers' shared-memory segments mapped here, for reuse",
                                                 lambda: segments.mapped_bytes),
                "pdserve_prefix_cache_bytes": ("KV bytes held by the prefix cache",
                                               lambda: prefix_cache.bytes if prefix_cache else 0),
                "pdserve_prefix_cache_pool_bytes": (
                    "the prefix cache's pool as far as it has been written (resident; at most --prefix-cache-mb)",
                    lambda: prefix_cache.pool_bytes if prefix_cache else 0),
                "pdserve_prefix_cache_blocks": ("prefix blocks cached",
                                                lambda: len(prefix_cache) if prefix_cache else 0)},
        counters={"pdserve_cancellations": "prefills whose caller cancelled or left mid-request",
                  "pdserve_rejections": "prompts refused: the queue's token budget was full",
                  "pdserve_prompt_tokens": "prompt tokens prefilled",
                  "pdserve_prefill_computed_tokens": "prompt tokens the forward pass ran (cached ones excluded)",
                  "pdserve_prefix_cache_queries": "prompt tokens looked up in the prefix cache",
                  "pdserve_prefix_cache_hits": "prompt tokens whose KV the prefix cache held",
                  "pdserve_kv_transfer_bytes": "KV bytes sent, by path (grpc, shm)",
                  "pdserve_kv_transfer_failures": "KV transfers refused or broken, by path"},
        histograms={"pdserve_request_queue_time_seconds": "arrival to the prompt's first forward pass",
                    "pdserve_request_prefill_time_seconds": "the prompt's forward passes, first to last",
                    "pdserve_kv_transfer_seconds": "first KV layer sent to decode's acknowledgement, by path"})


def record_prefill(metrics: Metrics, arrived: float, prefilled: Prefilled, prompt_tokens: int,
                   prefix_cache: PrefixCache | None) -> None:
    """The prompt's wait and forward passes: child spans of the current (prefill) span, and histograms."""
    cached = prefilled.cached_tokens
    tracing.record("prefill.queue", None, arrived, prefilled.started)
    tracing.record("prefill.forward", None, prefilled.started, prefilled.ended,
                   {"pdserve.batch_size": prefilled.batch_size, "pdserve.passes": prefilled.passes,
                    "pdserve.prompt_tokens": prompt_tokens, "pdserve.cached_tokens": cached})
    span = trace.get_current_span()
    span.set_attributes({"pdserve.cached_tokens": cached, "pdserve.prefix_cache": "hit" if cached else "miss"})
    metrics.observe("pdserve_request_queue_time_seconds", prefilled.started - arrived)
    metrics.observe("pdserve_request_prefill_time_seconds", prefilled.ended - prefilled.started)
    metrics.count("pdserve_prompt_tokens", prompt_tokens)
    metrics.count("pdserve_prefill_computed_tokens", prompt_tokens - cached)
    if prefix_cache is not None:
        metrics.count("pdserve_prefix_cache_queries", prompt_tokens)
        metrics.count("pdserve_prefix_cache_hits", cached)
