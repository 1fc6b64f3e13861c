"""Which prompt prefixes the gateway sent to which worker: its picture of the workers' prefix caches, for prefix
routing and for placement's cached-token estimate."""

from __future__ import annotations

import collections
import sys

PREFIX_INDEX_BLOCKS = 200_000  # block names remembered per worker (~150 bytes each: ~31 MB per worker when full)
_NAME_BYTES = sys.getsizeof(bytes(16))  # a block name (xxh3-128) as a Python object


class PrefixIndex:
    """Which prompt prefixes the gateway sent to which worker, as chained block names (protos/types.py, salted with
    each request's cache salt, in the block size each worker's GetInfo gives): an approximate picture of each
    worker's prefix cache, kept without asking the workers, least recently sent forgotten first (as SGLang's router
    and llm-d's prefix scorer keep theirs)."""

    def __init__(self, capacity: int = PREFIX_INDEX_BLOCKS) -> None:
        self.capacity = capacity
        self._sent: dict[str, collections.OrderedDict[bytes, None]] = {}

    def best(self, candidates: list[tuple[str, list[bytes]]]) -> str | None:
        """Of (address, the prompt's block names in that worker's block size), the address whose recorded blocks
        cover the longest prefix of its names; None when none covers any."""
        best, longest = None, 0
        for address, names in candidates:
            matched = self.matched(address, names)
            if matched > longest:
                best, longest = address, matched
        return best

    def matched(self, address: str, names: list[bytes]) -> int:
        """How many of the prompt's leading blocks (`names`) were sent to `address`."""
        sent = self._sent.get(address)
        if sent is None:
            return 0
        matched = 0
        while matched < len(names) and names[matched] in sent:
            matched += 1
        return matched

    def record(self, address: str, names: list[bytes]) -> None:
        sent = self._sent.setdefault(address, collections.OrderedDict())
        for name in reversed(names):  # the root most recent, as the worker's cache keeps it
            sent[name] = None
            sent.move_to_end(name)
        while len(sent) > self.capacity:
            sent.popitem(last=False)

    def forget(self, address: str) -> None:
        self._sent.pop(address, None)

    @property
    def nbytes(self) -> int:
        """What the index holds in memory, its names included (O(1) per worker: every name is 16 bytes)."""
        return sum(sys.getsizeof(sent) + len(sent) * _NAME_BYTES for sent in list(self._sent.values()))
