"""`pdserve trace REQUEST_ID`: a request's span tree as a terminal waterfall, read from a local trace capture.

The capture is the OTLP JSON lines each service appends under `PDSERVE_TRACE_DIR` (serving/tracing.py), which
`pdserve cluster --trace-dir DIR` turns on for every process it starts. The request's trace is the one whose
spans carry `pdserve.request_id` = REQUEST_ID (the latest, if a request id was reused).
"""

from __future__ import annotations

import itertools
import json
from collections import defaultdict
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

BAR = 40  # characters across the whole trace
COLLAPSE = 6  # runs of more same-named siblings (decode steps) are summarised


@dataclass
class Span:
    name: str
    service: str
    trace_id: str
    span_id: str
    parent_id: str
    start_ns: int
    end_ns: int
    attributes: dict[str, Any]
    events: list[tuple[str, int]]  # (name, time)
    error: bool
    children: list[Span] = field(default_factory=list)

    @property
    def ms(self) -> float:
        return (self.end_ns - self.start_ns) / 1e6


def _value(value: dict[str, Any]) -> Any:
    for kind in ("stringValue", "boolValue", "doubleValue"):
        if kind in value:
            return value[kind]
    if "intValue" in value:
        return int(value["intValue"])
    return None


def load(directory: Path) -> list[Span]:
    """Every span in the capture; lines cut short by a killed writer are skipped."""
    spans = []
    for path in sorted(directory.glob("*.jsonl")):
        for line in path.read_text().splitlines():
            try:
                batch = json.loads(line)
            except json.JSONDecodeError:
                continue
            for resource in batch.get("resourceSpans", []):
                service = next((_value(a["value"]) for a in resource.get("resource", {}).get("attributes", [])
                                if a["key"] == "service.name"), "?")
                for scope in resource.get("scopeSpans", []):
                    for raw in scope.get("spans", []):
                        spans.append(Span(
                            name=raw["name"], service=service, trace_id=raw["traceId"], span_id=raw["spanId"],
                            parent_id=raw.get("parentSpanId", ""), start_ns=int(raw["startTimeUnixNano"]),
                            end_ns=int(raw["endTimeUnixNano"]),
                            attributes={a["key"]: _value(a["value"]) for a in raw.get("attributes", [])},
                            events=[(e["name"], int(e["timeUnixNano"])) for e in raw.get("events", [])],
                            error=raw.get("status", {}).get("code") == "STATUS_CODE_ERROR"))
    return spans


def find_trace(spans: list[Span], request_id: str) -> list[Span]:
    """The spans of the request's latest trace; empty if no span names the request."""
    mine = [s for s in spans if s.attributes.get("pdserve.request_id") == request_id]
    if not mine:
        return []
    trace_id = max(mine, key=lambda s: s.start_ns).trace_id
    return [s for s in spans if s.trace_id == trace_id]


def roots(spans: list[Span]) -> list[Span]:
    """Link children to parents; the spans whose parent is not in the capture (the client's, or none) are roots."""
    by_id = {s.span_id: s for s in spans}
    children: dict[str, list[Span]] = defaultdict(list)
    for span in spans:
        children[span.parent_id].append(span)
    for span in spans:
        span.children = sorted(children[span.span_id], key=lambda s: s.start_ns)
    return sorted((s for s in spans if s.parent_id not in by_id), key=lambda s: s.start_ns)


def render(spans: list[Span], request_id: str, show_all: bool = False) -> str:
    top = roots(spans)
    start = min(s.start_ns for s in spans)
    total = max(s.end_ns for s in spans) - start or 1
    name_width = max(len(span.name) + 2 * depth for span, depth in _walk(top, 0)) + 2
    lines = [f"trace {spans[0].trace_id}  request {request_id}  {len(spans)} spans  {total / 1e6:.1f} ms"]

    def bar(begin: int, end: int) -> str:
        left = round((begin - start) / total * BAR)
        width = max(1, round((end - begin) / total * BAR))
        return " " * left + "█" * min(width, BAR - left) + " " * max(0, BAR - left - width)

    def row(span: Span, depth: int) -> None:
        label = ("  " * depth + span.name).ljust(name_width)
        mark = " !" if span.error else ""
        service = span.service.removeprefix("pdserve-")
        lines.append(f"{label}{service:<9}{span.ms:>9.1f} ms |{bar(span.start_ns, span.end_ns)}|"
                     f" +{(span.start_ns - start) / 1e6:.1f}{mark}{_summary(span)}")
        for event, at in span.events:
            lines.append(f"{'  ' * (depth + 1)}· {event} at +{(at - start) / 1e6:.1f} ms")
        walk(span.children, depth + 1)

    def walk(siblings: list[Span], depth: int) -> None:
        for _, group in itertools.groupby(siblings, key=lambda span: span.name):  # runs of same-named spans
            run = list(group)
            if show_all or len(run) <= COLLAPSE:
                for span in run:
                    row(span, depth)
            else:
                for span in run[:2]:
                    row(span, depth)
                hidden = run[2:-1]
                mean = sum(s.ms for s in hidden) / len(hidden)
                label = ("  " * depth + "…").ljust(name_width)
                spread = (hidden[-1].end_ns - hidden[0].start_ns) / 1e6
                lines.append(f"{label}{'':<9}{spread:>9.1f} ms |{bar(hidden[0].start_ns, hidden[-1].end_ns)}|"
                             f" {len(hidden)} more {run[0].name}, {mean:.1f} ms each on average")
                row(run[-1], depth)

    walk(top, 0)
    return "\n".join(lines)


_SHOWN = ("pdserve.batch_size", "pdserve.prompt_tokens", "pdserve.output_tokens", "pdserve.kv_bytes",
          "pdserve.transport", "pdserve.retries", "pdserve.migrations", "pdserve.finish_reason")


def _summary(span: Span) -> str:
    shown = [f"{key.removeprefix('pdserve.')}={span.attributes[key]}" for key in _SHOWN if key in span.attributes]
    return "  " + " ".join(shown) if shown else ""


def _walk(spans: list[Span], depth: int) -> Iterator[tuple[Span, int]]:
    for span in spans:
        yield span, depth
        yield from _walk(span.children, depth + 1)


def main(request_id: str, directory: Path, show_all: bool) -> int:
    if not directory.is_dir():
        print(f"pdserve trace: no capture at {directory} (start the cluster with --trace-dir {directory})")
        return 2
    spans = find_trace(load(directory), request_id)
    if not spans:
        print(f"pdserve trace: no span of request {request_id!r} in {directory} (spans are written in batches: "
              "a request that just finished may need a second)")
        return 1
    print(render(spans, request_id, show_all))
    return 0
