"""How a request ends when it does not finish, in one exception for every stage of the gateway: the status its client
sees, whatever the transport. The gRPC edge (server.py) aborts with it; the HTTP edge (openai_api.py) maps it to a
status code and an OpenAI error object."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import grpc

if TYPE_CHECKING:
    from gateway.workers import Worker


# The one table from a failure's status to HTTP's, for every edge: the gRPC edge sends the status itself, the HTTP
# edge this code and an OpenAI error object of ERROR_TYPE (499, nginx's "client closed request", for a cancel).
HTTP_STATUS = {
    grpc.StatusCode.INVALID_ARGUMENT: 400, grpc.StatusCode.FAILED_PRECONDITION: 400,
    grpc.StatusCode.UNAUTHENTICATED: 401, grpc.StatusCode.PERMISSION_DENIED: 403, grpc.StatusCode.NOT_FOUND: 404,
    grpc.StatusCode.ALREADY_EXISTS: 409, grpc.StatusCode.RESOURCE_EXHAUSTED: 429,
    grpc.StatusCode.CANCELLED: 499, grpc.StatusCode.UNAVAILABLE: 503, grpc.StatusCode.DEADLINE_EXCEEDED: 504,
}
ERROR_TYPE = {400: "invalid_request_error", 401: "authentication_error", 403: "permission_error",
              404: "not_found_error", 409: "conflict_error", 413: "invalid_request_error", 429: "rate_limit_error",
              499: "cancelled", 503: "service_unavailable", 504: "timeout"}


def error_body(status: int, message: str, param: str | None = None, code: str | None = None) -> dict[str, Any]:
    """An OpenAI error object."""
    return {"error": {"message": message, "type": ERROR_TYPE.get(status, "server_error"), "param": param,
                      "code": code}}


class InvalidRequest(ValueError):
    """A request the gateway refuses; the message names the field. It ends as INVALID_ARGUMENT."""


class GatewayError(Exception):
    """A request failure with the status the client should see.

    Raised inside the journey, `worker` is the worker that failed, when one did, `retryable` says whether another
    worker might succeed and `suspects` names more addresses a retry should avoid. `retry_after_ms` is set when the
    request was refused for load (RESOURCE_EXHAUSTED): the client's hint when to come back."""

    def __init__(self, code: grpc.StatusCode, message: str, worker: Worker | None = None,
                 retryable: bool = False, suspects: tuple[str, ...] = (), retry_after_ms: int = 0) -> None:
        super().__init__(message)
        self.code = code
        self.message = message
        self.worker = worker
        self.retryable = retryable
        self.suspects = suspects
        self.retry_after_ms = retry_after_ms


class NoDecodeCapacity(GatewayError):
    """Every decode worker refused the reservation for room: the request waits (`capacity_wait_s`) and asks again."""
