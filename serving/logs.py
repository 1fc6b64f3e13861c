"""Every service's logs: text by default, JSON lines with `PDSERVE_LOG_FORMAT=json`.

A line logged while a request is handled carries its request id (set once per handler with `for_request`; asyncio
tasks inherit it) and the current span's trace and span ids, so a log search and a trace join on the same ids.
"""

from __future__ import annotations

import contextvars
import json
import logging
import os
import sys
import time

from opentelemetry import trace

LOG_FORMAT_ENV = "PDSERVE_LOG_FORMAT"
_request_id: contextvars.ContextVar[str] = contextvars.ContextVar("pdserve_request_id", default="")


def for_request(request_id: str) -> None:
    """Tag every line this task (and the tasks it starts) logs from now on with `request_id`."""
    _request_id.set(request_id)


class _RequestContext(logging.Filter):
    def filter(self, record: logging.LogRecord) -> bool:
        request_id = getattr(record, "request_id", "") or _request_id.get()
        record.request_id, record.request_tag = request_id, f"[{request_id}] " if request_id else ""
        span = trace.get_current_span().get_span_context()
        record.trace_id = f"{span.trace_id:032x}" if span.is_valid else ""
        record.span_id = f"{span.span_id:016x}" if span.is_valid else ""
        return True


class JsonFormatter(logging.Formatter):
    def format(self, record: logging.LogRecord) -> str:
        line = {"time": time.strftime("%Y-%m-%dT%H:%M:%S", time.gmtime(record.created))
                + f".{int(record.msecs):03d}Z", "level": record.levelname, "logger": record.name,
                "message": record.getMessage(), "pid": record.process}
        for key in ("request_id", "trace_id", "span_id"):
            if getattr(record, key, ""):
                line[key] = getattr(record, key)
        if record.exc_info:
            line["exception"] = self.formatException(record.exc_info)
        return json.dumps(line)


class _AbandonedGeneratorDetach(logging.Filter):
    """Drops OpenTelemetry's "Failed to detach context" error. A streaming handler whose RPC ended while it was
    suspended at a `yield` is closed by asyncio's async-generator finalizer, in a task of its own: the span's
    `with` block exits there, in another context, so detaching its token fails. Harmless: the span still ends,
    and the context it would have restored belongs to a task that is gone."""

    def filter(self, record: logging.LogRecord) -> bool:
        return record.getMessage() != "Failed to detach context"


def configure() -> None:
    """Root logging for a service process, as PDSERVE_LOG_LEVEL and PDSERVE_LOG_FORMAT say."""
    handler = logging.StreamHandler(sys.stderr)
    handler.addFilter(_RequestContext())
    if os.environ.get(LOG_FORMAT_ENV, "").lower() == "json":
        handler.setFormatter(JsonFormatter())
    else:
        handler.setFormatter(logging.Formatter("%(asctime)s %(levelname)s %(name)s: %(request_tag)s%(message)s"))
    logging.basicConfig(level=os.environ.get("PDSERVE_LOG_LEVEL", "INFO"), handlers=[handler], force=True)
    logging.getLogger("opentelemetry.context").addFilter(_AbandonedGeneratorDetach())
