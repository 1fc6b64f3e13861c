"""Reservations: the capacity a decode worker promises a request before any prefill starts.

A reservation holds one sequence slot and the KV bytes of prompt + max_tokens. It lives exactly as long as the
gateway's Generate call on this worker, and while it waits for KV it also has a lease: KV that has not fully
arrived when the lease ends is refused and everything is freed. The lease guards against a dead, frozen or cut-off
prefill worker, not a slow one: the prefill worker renews it while the prompt waits in its queue (`renew`), and
each message of the KV stream renews it once the stream is open. All methods run on the event loop thread.
"""

from __future__ import annotations

import asyncio
import enum
import secrets
import time
from dataclasses import dataclass, field
from typing import Any

import grpc

from kv_wire.layout import KVTransferError
from kv_wire.segments import Segment
from protos.types import SamplingParams


class ReservationState(enum.Enum):
    """Life of a reservation: the capacity held for one request, from Generate's first event to its end.

    Not kv_wire's TransferState, the life of one KV stream: a reservation may see no stream (colocated, or its
    lease ran out) and a stream may claim no reservation (a forged token). A reservation is TRANSFERRING from
    the moment a stream claims it; the stream's COMPLETE makes it ADMITTED; a stream that FAILED fails its
    Generate call instead, which ends in CLOSED like every other ending.
    """

    WAITING = "waiting"  # reserved; no KV yet
    TRANSFERRING = "transferring"  # a KV stream presented the token and is arriving
    ADMITTED = "admitted"  # KV complete and validated, or a colocated prompt: the sequence is in the engine
    CLOSED = "closed"  # finished, failed, cancelled or expired: holds nothing


@dataclass(frozen=True)
class DecodeParams:
    request_id: str
    prompt_tokens: int
    max_tokens: int
    sampling: SamplingParams
    ignore_eos: bool
    prompt: tuple[int, ...] = ()  # colocated: the prompt this worker prefills itself
    decoded_tokens: int = 0  # colocated: how many of its last tokens decode steps generated (a migrated stream's)
    cache_salt: str = ""  # colocated: its prompt's prefix-cache namespace
    heartbeat_ms: int = 0  # colocated: a `prefilling` event this often until the first token (0: none)
    tpot_target_ms: int = 0  # the time between tokens it asks for (0: none): bounds the colocated passes' budget
    split_tokens: int = 0  # split prefill: the prompt's first tokens, whose KV a prefill worker sends (0: none)

    @property
    def kv_tokens(self) -> int:
        """Prompt tokens whose KV comes over TransferKV: all of them, those of a split prefill's prefix, or none
        (colocated: but a reservation's token admits no stream then, as nothing is lent or awaited)."""
        return self.split_tokens or self.prompt_tokens

@dataclass(frozen=True)
class Failure:
    code: grpc.StatusCode
    message: str


@dataclass
class Reservation:
    params: DecodeParams
    token: str
    kv_bytes: int
    expires_at: float  # time.monotonic() by which the KV must have arrived, unless renewed
    state: ReservationState = ReservationState.WAITING
    sequence: Any = None  # the engine's Sequence once admitted
    segment: Segment | None = None  # shared-memory segment lent to prefill until the KV is admitted
    transfer: asyncio.Task | None = None  # the TransferKV handler that claimed this reservation
    feed: Any = None  # split prefill: the engine's PrefixFeed, which the KV stream fills layer by layer
    # What the Generate stream relays: (token_ids, finish_reason) tuples or one Failure.
    events: asyncio.Queue[tuple[list[int], str] | Failure] = field(default_factory=asyncio.Queue)

    def fail(self, code: grpc.StatusCode, message: str) -> None:
        """Push a failure to the gateway's stream at once (it frees the reservation on its way out), and stop a split
        prompt's pass from waiting for a prefix that will never be whole."""
        if self.feed is not None:
            self.feed.fail(message)
        if self.state is not ReservationState.CLOSED:
            self.events.put_nowait(Failure(code, message))

    def extend(self, lease_s: float) -> None:
        self.expires_at = time.monotonic() + lease_s

    def loop_expiry(self) -> float:
        """`expires_at` on the running event loop's clock."""
        return asyncio.get_running_loop().time() + (self.expires_at - time.monotonic())


class CapacityExhausted(Exception):
    pass


class ReservationTable:
    def __init__(self, max_seqs: int, kv_budget_bytes: int, kv_bytes_per_token: int, lease_s: float) -> None:
        self.max_seqs = max_seqs
        self.kv_budget_bytes = kv_budget_bytes
        self.kv_bytes_per_token = kv_bytes_per_token
        self.lease_s = lease_s
        self._live: dict[str, Reservation] = {}

    def reserve(self, params: DecodeParams) -> Reservation:
        """Keyed by its token, so each attempt is its own reservation: a gateway retrying a request id need not
        wait for this worker to have processed the earlier attempt's cancellation."""
        kv_bytes = (params.prompt_tokens + params.max_tokens) * self.kv_bytes_per_token
        if len(self._live) >= self.max_seqs:
            raise CapacityExhausted(f"all {self.max_seqs} sequence slots are reserved")
        if self.kv_bytes + kv_bytes > self.kv_budget_bytes:
            raise CapacityExhausted(f"KV budget: {kv_bytes} bytes needed, "
                                    f"{self.kv_budget_bytes - self.kv_bytes} of {self.kv_budget_bytes} free")
        reservation = Reservation(params=params, token=secrets.token_urlsafe(24), kv_bytes=kv_bytes,
                                  expires_at=time.monotonic() + self.lease_s)
        self._live[reservation.token] = reservation
        return reservation

    def claim(self, request_id: str, token: str) -> Reservation:
        """The one KV stream that presents the right token takes the reservation; any other is refused."""
        reservation = self._unexpired(request_id, token)
        if reservation.state is not ReservationState.WAITING:
            raise KVTransferError(grpc.StatusCode.PERMISSION_DENIED,
                                  f"reservation for request {request_id!r} was already used "
                                  f"({reservation.state.value})")
        reservation.state = ReservationState.TRANSFERRING
        return reservation

    def renew(self, request_id: str, token: str) -> Reservation:
        """A prefill worker still working on the request's prompt: its lease starts again."""
        reservation = self._unexpired(request_id, token)
        if reservation.state is ReservationState.ADMITTED:
            raise KVTransferError(grpc.StatusCode.FAILED_PRECONDITION,
                                  f"reservation for request {request_id!r} has its KV: it has no lease to renew")
        reservation.extend(self.lease_s)
        return reservation

    def _unexpired(self, request_id: str, token: str) -> Reservation:
        """Tokens are 192 random bits, so looking one up by value leaks nothing usable through timing."""
        reservation = self._live.get(token)
        if reservation is None or reservation.params.request_id != request_id:
            raise KVTransferError(grpc.StatusCode.PERMISSION_DENIED,
                                  f"no live reservation for request {request_id!r} with this token "
                                  "(forged, expired or already released)")
        if time.monotonic() >= reservation.expires_at and reservation.state is not ReservationState.ADMITTED:
            raise KVTransferError(grpc.StatusCode.PERMISSION_DENIED,
                                  f"reservation for request {request_id!r} expired")
        return reservation

    def release(self, reservation: Reservation) -> None:
        reservation.state = ReservationState.CLOSED
        if self._live.get(reservation.token) is reservation:
            del self._live[reservation.token]

    @property
    def kv_bytes(self) -> int:
        return sum(r.kv_bytes for r in self._live.values())

    def count(self, *states: ReservationState) -> int:
        return sum(r.state in states for r in self._live.values())

    @property
    def awaiting_kv(self) -> int:
        """Reservations waiting for or receiving their KV."""
        return self.count(ReservationState.WAITING, ReservationState.TRANSFERRING)
