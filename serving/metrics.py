"""Each service's Prometheus `/metrics`: live gauges read at scrape time, and counters of events.

The gauges are the same counts `GetInfo` reports, so a test or an operator can watch them return to zero.
"""

from __future__ import annotations

from collections.abc import Callable

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, start_http_server

# Latency buckets, seconds: from a fast decode step to a long prompt's queue.
LATENCY_BUCKETS = (0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.5, 0.75, 1.0, 1.5, 2.0, 3.0, 5.0, 7.5, 10.0,
                   20.0, 40.0, 80.0)


# Sequences in one decode step.
BATCH_BUCKETS = (1, 2, 4, 8, 16, 32, 64, 128, 256)

# Actual over predicted.
RATIO_BUCKETS = (0.25, 0.5, 0.67, 0.8, 0.9, 1.1, 1.25, 1.5, 2.0, 4.0, 8.0)

# Labels of the metrics that have them: the KV transfer's path; where a prompt was placed.
LABELS = {**{name: ("path",) for name in ("pdserve_kv_transfer_seconds", "pdserve_kv_transfer_bytes",
                                           "pdserve_kv_transfer_failures")},
          **{name: ("placement",) for name in ("pdserve_placements", "pdserve_placement_ttft_error_ratio")}}
BUCKETS = {"pdserve_decode_batch_size": BATCH_BUCKETS, "pdserve_placement_ttft_error_ratio": RATIO_BUCKETS}


class Metrics:
    def __init__(self, gauges: dict[str, tuple[str, Callable[[], float]]], counters: dict[str, str],
                 histograms: dict[str, str] | None = None) -> None:
        """`gauges`: name -> (help, read); `counters`: name -> help (exposed as `<name>_total`); `histograms`:
        name -> help, in seconds (LATENCY_BUCKETS) unless BUCKETS says otherwise. LABELS names the labels of
        those that have them."""
        self.registry = CollectorRegistry(auto_describe=True)
        for name, (doc, read) in gauges.items():
            Gauge(name, doc, registry=self.registry).set_function(read)
        self._counters = {name: Counter(name, doc, LABELS.get(name, ()), registry=self.registry)
                          for name, doc in counters.items()}
        self._histograms = {name: Histogram(name, doc, LABELS.get(name, ()), registry=self.registry,
                                            buckets=BUCKETS.get(name, LATENCY_BUCKETS))
                            for name, doc in (histograms or {}).items()}
        self._server: object | None = None

    def count(self, name: str, amount: float = 1, **labels: str) -> None:
        if amount:
            counter = self._counters[name]
            (counter.labels(**labels) if labels else counter).inc(amount)

    def observe(self, name: str, value: float, times: int = 1, **labels: str) -> None:
        histogram = self._histograms[name]
        target = histogram.labels(**labels) if labels else histogram
        for _ in range(times):
            target.observe(value)

    def start(self, host: str, port: int) -> str:
        """Serve `/metrics` over HTTP on a thread; returns the address (port 0 picks a free one)."""
        server, _ = start_http_server(port, addr=host, registry=self.registry)
        self._server = server
        return f"{host}:{server.server_port}"

    def stop(self) -> None:
        if self._server is not None:
            self._server.shutdown()  # type: ignore[attr-defined]
            self._server.server_close()  # type: ignore[attr-defined]
            self._server = None


def scrape(address: str, timeout_s: float = 5.0) -> dict[str, float]:
    """A service's samples by name, labels included as written (`pdserve_kv_transfer_bytes_total{path="shm"}`)."""
    import urllib.request

    with urllib.request.urlopen(f"http://{address}/metrics", timeout=timeout_s) as response:
        text = response.read().decode()
    samples = {}
    for line in text.splitlines():
        if line and not line.startswith("#"):
            name, value = line.rsplit(" ", 1)
            samples[name] = float(value)
    return samples
