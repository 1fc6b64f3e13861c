"""What `pdserve cluster` starts: its settings, written once (serving/settings.py). Kept apart from cluster.py, which
starts the processes, so that the CLI builds its flags from them without loading anything heavy."""

from __future__ import annotations

import argparse
import os
from dataclasses import dataclass

from protos.types import DTYPE_BYTES
from serving.models import DEFAULT_MODEL
from serving.settings import check_settings, setting


def _ports(text: str) -> tuple[int, ...]:
    try:
        return tuple(int(port) for port in text.split(",") if port.strip())
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r}: expected comma-separated port numbers") from None


@dataclass(frozen=True)
class ClusterConfig:
    prefill: int = setting(1, "prefill workers; 0: colocated, decode workers prefill too", low=0)
    decode: int = setting(1, "decode workers", low=1)
    model: str = setting(DEFAULT_MODEL, "a local Hugging Face causal-LM directory, or the default model's name",
                         default_text=DEFAULT_MODEL)
    dtype: str = setting("bfloat16", "compute and KV dtype", choices=tuple(sorted(DTYPE_BYTES)))
    device: str = setting("cpu", "cpu or cuda[:N]")
    host: str = setting("127.0.0.1", "address every service listens on")
    gateway_port: int = setting(0, "the gateway's gRPC port; 0: a free one", flag="--port", low=0, high=65535,
                                metavar="PORT")
    http_port: int = setting(0, "the gateway's OpenAI-compatible HTTP port; 0: a free one, -1: off", low=-1,
                             high=65535)
    prefill_ports: tuple[int, ...] = setting((), "comma-separated ports for the prefill workers; none: free ones",
                                             parse=_ports, metavar="PORTS", default_text="free ports")
    decode_ports: tuple[int, ...] = setting((), "comma-separated ports for the decode workers; none: free ones",
                                            parse=_ports, metavar="PORTS", default_text="free ports")
    threads: int = setting(0, "torch threads per worker; 0: the host's cores shared out evenly", low=0)
    pin: bool = setting(True, "do not give each worker its own cores (by default they are pinned when there are "
                        "enough: workers x threads <= cores, so prefill never steals decode's)", flag="--no-pin")
    prefill_args: tuple[str, ...] = setting((), "an extra flag for every prefill worker, e.g. "
                                            "--prefill-arg=--chunk-bytes=262144", flag="--prefill-arg", repeat=True,
                                            metavar="FLAG")
    decode_args: tuple[str, ...] = setting((), "an extra flag for every decode worker, e.g. "
                                           "--decode-arg=--max-seqs=16", flag="--decode-arg", repeat=True,
                                           metavar="FLAG")
    gateway_args: tuple[str, ...] = setting((), "an extra flag for the gateway, e.g. --gateway-arg=--max-in-flight=32",
                                            flag="--gateway-arg", repeat=True, metavar="FLAG")
    config_file: str = setting("", "a TOML config file every service reads its table of ([gateway], [prefill], "
                               "[decode]; `pdserve config show` prints what each would run with)", flag="--config",
                               metavar="FILE", default_text="none")
    trace_dir: str = setting("", "every process appends its spans to DIR (OTLP JSON lines); read them with "
                             "`pdserve trace REQUEST_ID --dir DIR`", metavar="DIR", default_text="none")
    log_format: str = setting("text", "json: every process logs JSON lines, with trace and request ids",
                              choices=("text", "json"))
    tls_dir: str = setting("", "mutual TLS between every process, with the certificates `deploy/make-certs.sh DIR` "
                           "writes (ca.pem, gateway.pem, prefill.pem, decode.pem, client.pem and their keys)",
                           metavar="DIR", default_text="none")
    # Not flags: what tests and benchmarks set.
    startup_timeout_s: float = 300.0
    colocate_below: int | None = None  # the gateway's --colocate-below; None: its default

    def __post_init__(self) -> None:
        check_settings(self)
        for name, ports, count in (("prefill", self.prefill_ports, self.prefill),
                                   ("decode", self.decode_ports, self.decode)):
            if ports and len(ports) != count:
                raise ValueError(f"--{name}-ports: {len(ports)} ports for {count} workers")

    @property
    def threads_per_worker(self) -> int:
        return self.threads or max(1, len(os.sched_getaffinity(0)) // (self.prefill + self.decode))

    def worker_cpus(self) -> list[set[int] | None]:
        """Cores for each worker, prefill workers first: disjoint sets of `threads_per_worker` cores when the
        host has enough of them, else None (the scheduler shares them out)."""
        cores = sorted(os.sched_getaffinity(0))
        workers, per = self.prefill + self.decode, self.threads_per_worker
        if not self.pin or workers * per > len(cores):
            return [None] * workers
        return [set(cores[i * per : (i + 1) * per]) for i in range(workers)]
