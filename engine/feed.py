"""Split prefill's hand-over between threads: the prefix's KV, layer by layer, from the KV stream to the pass."""

from __future__ import annotations

import threading

import torch

from model_runner.forward import LayerKV


class PrefixFeed:
    """Split prefill: the KV of a prompt's first `tokens` positions, which another worker computes and sends
    layer by layer (decode_service fills it from the KV stream, on its event loop), while this worker's pass over
    the rest of the prompt takes each layer as it comes (on the engine thread)."""

    def __init__(self, tokens: int, layers: int) -> None:
        self.tokens = tokens
        self._layers: list[LayerKV | None] = [None] * layers
        self._arrived = threading.Condition()
        self.failed = ""  # why the prefix will never be whole ("" while it may)

    def put(self, layer: int, keys: torch.Tensor, values: torch.Tensor) -> None:
        """A layer's KV, (kv_heads, tokens, head_dim) each, in memory of its own (the stream's may be reused)."""
        with self._arrived:
            self._layers[layer] = (keys, values)
            self._arrived.notify_all()

    def fail(self, why: str) -> None:
        with self._arrived:
            self.failed = why
            self._arrived.notify_all()

    def take(self, layer: int, timeout: float) -> LayerKV | None:
        """The layer's KV once it is in, waiting at most `timeout` seconds (None: not yet). Handed out once: the
        feed lets go of it."""
        with self._arrived:
            if self._layers[layer] is None and not self.failed:
                self._arrived.wait(timeout)
            kv, self._layers[layer] = self._layers[layer], None
            return kv

    @property
    def arrived(self) -> int:
        """Layers in and not yet taken (for tests and logs)."""
        return sum(kv is not None for kv in self._layers)
