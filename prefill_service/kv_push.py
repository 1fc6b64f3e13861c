"""The prefill worker's side of the KV handoff: one request's KV stream to its decode worker (KVPush), over a
bounded set of channels, one per decode worker address (DecodeChannels)."""

from __future__ import annotations

import asyncio
import threading
import time
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass

import grpc
import torch

from kv_wire import codec
from kv_wire.layout import TransferState
from kv_wire.sender import Item, KVSender, encode_stream


class KVPush:
    """One request's KV on its way to decode: the stream opens with the first layer and closes with the trailer."""

    def __init__(self, channel: grpc.aio.Channel, sender: KVSender, abandon: threading.Event) -> None:
        self._transfer_kv, self.sender, self._abandon = codec.transfer_kv(channel), sender, abandon
        self._items: asyncio.Queue[Item] = asyncio.Queue()
        self.call: asyncio.Future | None = None
        self.started_at = 0.0

    def deliver(self, item: tuple[int, torch.Tensor, torch.Tensor] | int) -> None:
        """A finished layer (or the first token, which closes the stream). Runs on the event loop."""
        if self.call is None:
            if self._abandon.is_set():  # queued just before the request ended: send nothing
                return
            self.started_at = time.perf_counter()
            self.call = asyncio.ensure_future(self._transfer_kv(encode_stream(self.sender, self._items)))
            self.call.add_done_callback(self._on_transfer_end)
        self._items.put_nowait(item)

    def _on_transfer_end(self, call: asyncio.Future) -> None:
        if not call.cancelled() and call.exception() is None:
            self.sender.state = TransferState.COMPLETE
            return
        self.sender.state = TransferState.FAILED
        # A refused transfer stops the forward pass at its next layer instead of computing for nothing.
        self._abandon.set()

    def cancel(self) -> None:
        if self.call is None:
            return
        if not self.call.done():
            self.call.cancel()
        # End the request stream even when the call ended first (decode refused or released it): gRPC's task
        # reading the stream does not stop with the call, and would wait for a next item until collected
        self._items.put_nowait(None)


@dataclass
class _Lent:
    channel: grpc.aio.Channel
    in_flight: int = 0  # transfers using it now
    last_used: float = 0.0


class DecodeChannels:
    """One channel per decode worker address, bounded: decode pods come and go (each new pod IP is a new address),
    so a channel unused for `max_idle_s` is closed, and beyond `max_channels` the least recently used idle one is.
    A channel with a transfer in flight (between `acquire` and `release`) is never closed."""

    def __init__(self, connect: Callable[[str], grpc.aio.Channel], max_channels: int = 256,
                 max_idle_s: float = 300.0, clock: Callable[[], float] = time.monotonic) -> None:
        self._connect, self.max_channels, self.max_idle_s, self._clock = connect, max_channels, max_idle_s, clock
        self._channels: OrderedDict[str, _Lent] = OrderedDict()  # least recently used first
        self._closing: set[asyncio.Task] = set()

    def acquire(self, address: str) -> grpc.aio.Channel:
        lent = self._channels.get(address)
        if lent is None:
            lent = self._channels[address] = _Lent(self._connect(address))
        lent.in_flight += 1
        lent.last_used = self._clock()
        self._channels.move_to_end(address)
        self._evict()
        return lent.channel

    def held(self, address: str) -> grpc.aio.Channel:
        """The channel to `address` between an `acquire` and its `release` (it is not closed meanwhile)."""
        return self._channels[address].channel

    def release(self, address: str) -> None:
        lent = self._channels[address]
        lent.in_flight -= 1
        lent.last_used = self._clock()
        self._channels.move_to_end(address)

    def __len__(self) -> int:
        return len(self._channels)

    def _evict(self) -> None:
        """Close idle channels: those unused for max_idle_s, then the least recently used beyond max_channels.
        Walks from the least recently used and stops at the first recent one, so each call costs about what it
        closes plus the transfers in flight."""
        stale_before, excess = self._clock() - self.max_idle_s, len(self._channels) - self.max_channels
        idle: list[str] = []
        for address, lent in self._channels.items():
            if lent.last_used > stale_before and len(idle) >= excess:
                break
            if not lent.in_flight:
                idle.append(address)
        for address in idle:
            task = asyncio.ensure_future(self._channels.pop(address).channel.close())
            self._closing.add(task)
            task.add_done_callback(self._closing.discard)

    async def close(self) -> None:
        lent, self._channels = list(self._channels.values()), OrderedDict()
        await asyncio.gather(*(each.channel.close() for each in lent), *self._closing)
