"""How placement's predictions compared with what happened, from a gateway's "finished" log lines: each request's
TTFT over the TTFT predicted for the choice it was given, as the median and 10th/90th percentiles, overall and by
choice. `python -m bench.placement_error LOG...` (bench/vllm_bench_serve.sh runs it on its cluster's log)."""

from __future__ import annotations

import re
import statistics
import sys

LINE = re.compile(r"TTFT (\d+) ms.*; placed: (prefill|colocated) \S+: TTFT ([\d.]+) s")


def ratios(lines: list[str]) -> list[tuple[str, float]]:
    found = []
    for line in lines:
        match = LINE.search(line)
        if match and float(match.group(3)) > 0:
            found.append((match.group(2), int(match.group(1)) / 1e3 / float(match.group(3))))
    return found


def _quantile(values: list[float], q: float) -> float:
    return values[min(len(values) - 1, int(q * len(values)))]


def summary(found: list[tuple[str, float]]) -> str:
    parts = []
    for kind in ("all", "prefill", "colocated"):
        values = sorted(r for where, r in found if kind in ("all", where))
        if values:
            parts.append(f"{kind}: n={len(values)} median {statistics.median(values):.2f} "
                         f"p10 {_quantile(values, 0.1):.2f} p90 {_quantile(values, 0.9):.2f}")
    return " | ".join(parts) or "no placed requests"


def main(paths: list[str]) -> int:
    for path in paths:
        with open(path, errors="replace") as log:
            print(f"{path}: actual / predicted TTFT: {summary(ratios(log.readlines()))}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
