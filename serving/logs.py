"""Every service's logs: text by default, JSON lines with `PDSERVE_LOG_FORMAT=json`.

A line logged while a request is handled carries its request id (set once per handler with `for_request`; asyncio
tasks inherit it) and the current span's trace and span ids, so a log search and a trace join on the same ids.

Logging never blocks the caller: a line is formatted where it is logged (so it carries that task's ids), put on a
bounded queue, and written to stderr by a thread of its own. When stderr is not read (a full pipe, a stalled log
driver), only that thread waits; once the queue is full, lines are dropped and counted (`dropped_records()`), and
one line says how many when writing resumes.
"""

from __future__ import annotations

import atexit
import contextvars
import json
import logging
import logging.handlers
import math
import os
import queue
import sys
import time

from opentelemetry import trace

LOG_FORMAT_ENV = "PDSERVE_LOG_FORMAT"
QUEUE_RECORDS = 10_000  # lines waiting for stderr; past this they are dropped and counted
EXIT_FLUSH_SECONDS = 2.0  # at exit, how long the queued lines may take to be written
_TEXT_FORMAT = "%(asctime)s %(levelname)s %(name)s: %(request_tag)s%(message)s"
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


class _DroppingQueueHandler(logging.handlers.QueueHandler):
    """Formats a record in the thread that logs it (the filters ran there too) and queues the line; drops it if
    the queue is full. The first line queued after drops is a notice of how many."""

    def __init__(self, records: queue.Queue[logging.LogRecord | None]) -> None:
        super().__init__(records)
        self.records = records
        self.unreported = 0

    def emit(self, record: logging.LogRecord) -> None:
        if self.records.full():  # not worth formatting
            self._drop()
            return
        super().emit(record)

    def enqueue(self, record: logging.LogRecord) -> None:
        try:
            if self.unreported:
                self.records.put_nowait(self.prepare(self._notice()))
                self.unreported = 0
            self.records.put_nowait(record)
        except queue.Full:
            self._drop()

    def _drop(self) -> None:
        global _dropped
        _dropped += 1
        self.unreported += 1

    def _notice(self) -> logging.LogRecord:
        notice = logging.LogRecord(__name__, logging.WARNING, __file__, 0, "%d log lines dropped: stderr was not "
                                   "read fast enough", (self.unreported,), None)
        notice.request_id = notice.request_tag = notice.trace_id = notice.span_id = ""
        return notice


class _FdWriter(logging.Handler):
    """Writes formatted lines straight to a file descriptor, on the listener's thread alone: no lock or buffer for
    a write stuck on a full pipe to hold, that anything else (exit's flushes among them) would wait on."""

    def __init__(self, fd: int) -> None:
        super().__init__()
        self._fd = fd

    def handle(self, record: logging.LogRecord) -> bool:
        self.emit(record)
        return True

    def emit(self, record: logging.LogRecord) -> None:
        data = f"{record.msg}\n".encode("utf-8", "backslashreplace")
        try:
            while data:
                data = data[os.write(self._fd, data) :]
        except OSError:  # stderr closed: nowhere to say so
            pass


class _Listener(logging.handlers.QueueListener):
    def __init__(self, records: queue.Queue[logging.LogRecord | None], writer: logging.Handler) -> None:
        super().__init__(records, writer)
        self.records = records

    def stop_within(self, seconds: float) -> None:
        """Writes what is queued, for `seconds` at most: a stuck stderr must not hold up the process's exit."""
        thread, deadline = self._thread, time.monotonic() + seconds
        if thread is None:
            return
        self._thread = None
        try:
            self.records.put(None, timeout=seconds)  # the listener's sentinel
        except queue.Full:
            return
        thread.join(max(0.0, deadline - time.monotonic()))


_dropped = 0
_listener: _Listener | None = None


def dropped_records() -> int:
    """Log lines this process has dropped because stderr was not keeping up."""
    return _dropped


def _stop_listener() -> None:
    global _listener
    if _listener is not None:
        _listener.stop_within(EXIT_FLUSH_SECONDS)
        _listener = None


def _stderr_writer() -> logging.Handler:
    try:
        return _FdWriter(sys.stderr.fileno())
    except (AttributeError, OSError, ValueError):  # a stderr with no descriptor (replaced in-process): write to it
        writer = logging.StreamHandler(sys.stderr)
        writer.setFormatter(logging.Formatter("%(message)s"))
        return writer


class _UndecodableMetadata(logging.Filter):
    """Drops grpcio's "Invalid encoding on b'...'" record (and its traceback): it logs the metadata value whole,
    which for a mistyped `authorization` header is a near-miss API key or worker token. The call itself is
    refused (UNAUTHENTICATED) by the servicer as any wrong key."""

    def filter(self, record: logging.LogRecord) -> bool:
        return record.msg != "Invalid encoding on %s"


class _MalformedHttpRequest(logging.Filter):
    """aiohttp logs a request its parser refuses (a header line past 8,190 bytes, say) at ERROR, with a traceback
    whose message quotes the start of the offending line: for an oversized `Authorization`, the start of a key.
    aiohttp answers the client with the error's status all the same; the record becomes one warning naming the
    error's kind and the peer (written only where the logger's level lets warnings through)."""

    def filter(self, record: logging.LogRecord) -> bool:
        exc = record.exc_info[1] if record.exc_info else None
        if record.levelno < logging.ERROR or exc is None or not any(
                kind.__name__ == "BadHttpMessage" for kind in type(exc).__mro__):
            return True
        peer = record.args[0] if isinstance(record.args, tuple) and record.args else "?"
        record.msg, record.args = "refused a malformed HTTP request from %s (%s)", (peer, type(exc).__name__)
        record.levelno, record.levelname, record.exc_info, record.exc_text = logging.WARNING, "WARNING", None, None
        return logging.getLogger(record.name).isEnabledFor(logging.WARNING)


def configure() -> None:
    """Root logging for a service process, as PDSERVE_LOG_LEVEL and PDSERVE_LOG_FORMAT say: lines queued, and
    written to stderr by a thread of their own."""
    global _listener
    _stop_listener()
    records: queue.Queue[logging.LogRecord | None] = queue.Queue(QUEUE_RECORDS)
    handler = _DroppingQueueHandler(records)
    handler.addFilter(_RequestContext())  # in the logging task: its request id and span
    if os.environ.get(LOG_FORMAT_ENV, "").lower() == "json":
        handler.setFormatter(JsonFormatter())
    else:
        handler.setFormatter(logging.Formatter(_TEXT_FORMAT))
    _listener = _Listener(records, _stderr_writer())
    _listener.start()
    logging.basicConfig(level=os.environ.get("PDSERVE_LOG_LEVEL", "INFO"), handlers=[handler], force=True)
    logging.captureWarnings(True)  # warnings.warn writes to stderr in the caller otherwise
    for name, kind in (("opentelemetry.context", _AbandonedGeneratorDetach),
                       ("grpc._cython.cygrpc", _UndecodableMetadata), ("aiohttp.server", _MalformedHttpRequest)):
        logger = logging.getLogger(name)
        if not any(isinstance(f, kind) for f in logger.filters):
            logger.addFilter(kind())


atexit.register(_stop_listener)  # after logging's own exit hook is registered, so it runs before it


class SampledLog:
    """One line per `every_s` at most, standing for the lines it held back: a client flooding past its cap is
    refused hundreds of times a second, and a line each would cost the event loop and drown everyone's log (the
    refusals are counted in full by a metric). The count of a burst's last second comes with the
    next refusal's line, whenever that is."""

    def __init__(self, logger: logging.Logger, what: str, every_s: float = 1.0) -> None:
        self.logger, self.what, self.every_s = logger, what, every_s
        self._last, self._held = -math.inf, 0

    def log(self, message: str) -> None:
        now = time.monotonic()
        if now - self._last < self.every_s:
            self._held += 1
            return
        held = f" (and {self._held} more since the last such line)" if self._held else ""
        self.logger.info("ended with %s: %s%s", self.what, message, held)
        self._last, self._held = now, 0
