"""Shared-memory segments: where the same-host path's KV lands, named and reused.

Fresh pages cost more than the copy itself (a first write to new memory runs at ~1.5 GB/s on the reference
machine, a write to warm memory at ~18 GB/s), so every segment a transfer lands in comes from a pool, sized in
power-of-two classes and kept warm between requests.

One concept, one name: a `Segment` is decode's own (it creates, maps and removes it), a `SegmentPool` keeps
decode's segments warm, `SegmentMaps` are prefill's mappings of them, and a `SegmentView` is prefill's view of
one segment for the one reservation it is lent to.

Shared-memory segments live in /dev/shm as `pdserve-kv-<owner pid>-<random>`. The decode worker creates and
owns them: it lends one to a reservation, prefill (on the same host) writes the KV into it, and the
KV is read from it until it joins the batch. A segment whose request ended any other way is retired (a
writer may still hold it), never lent again. A segment's first page is a stamp: the
hash of the reservation token it is lent to, so prefill writes only into the segment lent to its own
request, and notices (between layers) when the lease was taken back. Segments of a process that was killed
stay in /dev/shm until the next decode worker starts and removes every segment whose owner is gone; a normal
exit removes its own, then its lock.

Whether an owner is gone is told by a lock, not by its pid alone: each owner holds an flock on
`pdserve-kv-<pid>-<tag>.lock` for its life, and its segments' random part starts with that tag. Whoever can take
the lock knows the owner died, also from another pid namespace: containers that share a /dev/shm volume each
number their processes from 1, so a dead container's pid is often a live one here.
"""

from __future__ import annotations

import atexit
import fcntl
import hashlib
import logging
import mmap
import os
import re
import secrets
import threading
from collections import OrderedDict
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from kv_wire.layout import WIRE_DTYPES, KVLayout

log = logging.getLogger(__name__)

SHM_DIR = Path("/dev/shm")
SEGMENT_PREFIX = "pdserve-kv-"
_SEGMENT_NAME = re.compile(r"^pdserve-kv-(\d+)-([0-9a-f]{8})[0-9a-f]{8}$")  # owner pid, owner tag, random
_LOCK_NAME = re.compile(r"^pdserve-kv-(\d+)-([0-9a-f]{8})\.lock$")
STAMP_BYTES = 4096  # the stamp page; KV data starts after it, page-aligned
_MIN_CLASS = 1 << 20


def size_class(nbytes: int) -> int:
    return max(_MIN_CLASS, 1 << (max(nbytes, 1) - 1).bit_length())


def stamp_of(reservation_token: str) -> bytes:
    return hashlib.sha256(b"pdserve-kv-segment\0" + reservation_token.encode()).digest()


class Segment:
    """A named shared-memory segment in /dev/shm, created and mapped by its owner (a decode worker)."""

    def __init__(self, size: int, name: str) -> None:
        self.size, self.name = size, name
        fd = os.open(SHM_DIR / name, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
        try:
            # Allocate the tmpfs pages now: a full /dev/shm fails here, not as SIGBUS in a writer later.
            os.posix_fallocate(fd, 0, size)
            self._map = mmap.mmap(fd, size, flags=mmap.MAP_SHARED)  # no MAP_POPULATE: see SegmentPool
        except BaseException:
            os.unlink(SHM_DIR / name)
            raise
        finally:
            os.close(fd)
        self.array = np.frombuffer(self._map, dtype=np.uint8)

    def close(self) -> None:
        """Unmap (once no view is left) and remove the name."""
        self.array = np.empty(0, dtype=np.uint8)
        try:
            self._map.close()
        except BufferError:  # a view still exists; the mapping goes when it does
            pass
        _unlink(self.name)


class SegmentPool:
    """Hands out segments of at least the requested size and keeps returned ones warm, up to `keep_bytes` idle.

    Thread-safe: the decode engine returns segments from its own thread, once their KV joined the batch.
    `maker` is the one thread to acquire on, at a lower CPU priority (nice +MAKER_NICENESS): making a segment runs
    on the decode worker's own core. Made at equal priority and mapped with MAP_POPULATE (~75 ms for 64 MiB on the
    AVX2 EPYC), it stretched the 25 ms decode step running beside it to 60-70 ms; at a lower priority it stretched
    it to 0.14 s, since populating the mapping holds the process's memory-map lock, which the engine thread then
    waits for. So a segment's pages are allocated (posix_fallocate) but not mapped in advance: decode maps each
    page when it first reads it, once per segment's life in the pool. No step then took over 60 ms beside it.
    """

    def __init__(self, keep_bytes: int) -> None:
        self.keep_bytes = keep_bytes
        self._idle: list[Segment] = []
        self._lock = threading.Lock()
        self.held_bytes = 0
        self.maker = ThreadPoolExecutor(1, thread_name_prefix="kv-segments", initializer=_lower_priority)
        atexit.register(self.close)  # a normal exit removes the names even if nobody called close()

    def acquire(self, nbytes: int) -> Segment:
        size = size_class(nbytes + STAMP_BYTES)
        with self._lock:
            fitting = [s for s in self._idle if s.size >= size]
            if fitting:
                segment = min(fitting, key=lambda s: s.size)
                self._idle.remove(segment)
                self.held_bytes += segment.size
                return segment
        name = f"{SEGMENT_PREFIX}{os.getpid()}-{_owner_tag()}{secrets.token_hex(4)}"
        segment = Segment(size, name)  # outside the lock: populating pages takes a while
        with self._lock:
            self.held_bytes += segment.size
        return segment

    def release(self, segment: Segment) -> None:
        with self._lock:
            self.held_bytes -= segment.size
            self._idle.append(segment)
            self._idle.sort(key=lambda s: s.size)
            evicted = []
            while sum(s.size for s in self._idle) > self.keep_bytes:
                evicted.append(self._idle.pop())  # the largest goes first
        for old in evicted:
            old.close()

    def discard(self, segment: Segment) -> None:
        """Take a held segment out of service for good: unmapped here (once no view is left) and its name removed."""
        with self._lock:
            self.held_bytes -= segment.size
        segment.close()

    @property
    def idle_bytes(self) -> int:
        with self._lock:
            return sum(s.size for s in self._idle)

    def close(self) -> None:
        """Free the idle segments (held ones are freed as they come back: close() is for shutdown)."""
        with self._lock:
            idle, self._idle = self._idle, []
            self.keep_bytes = 0
        for segment in idle:
            segment.close()


MAKER_NICENESS = 10  # CPU weight 110 against the engine's 1024: ~10% of a shared core while both run


def _lower_priority() -> None:
    """In the pool's maker thread: lower this thread's priority alone (Linux threads have their own)."""
    try:
        os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), MAKER_NICENESS)
    except OSError as exc:  # not Linux, or refused: segments are made at the process's priority
        log.warning("could not lower the KV segment maker's priority: %s", exc)


@dataclass
class SegmentView:
    """Prefill's view of the segment a decode worker lent to one reservation."""

    whole: np.ndarray
    stamp: bytes
    nbytes: int

    @property
    def data(self) -> np.ndarray:
        return self.whole[STAMP_BYTES : STAMP_BYTES + self.nbytes]

    def tensors(self, layout: KVLayout) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """Each layer's keys and values as tensors over their places in the segment (in wire order), for the
        forward pass to write into: the KV is then in decode's memory as it is computed, and the sender only
        hashes it (KVSender)."""
        flat = torch.from_numpy(self.data).view(WIRE_DTYPES[layout.dtype])
        tensors = flat.view(layout.num_layers, 2, *layout.tensor_shape)
        return [(tensors[layer, 0], tensors[layer, 1]) for layer in range(layout.num_layers)]

    def still_lent(self) -> bool:
        """False once decode took the segment back (released, expired or cancelled): stop writing."""
        return self.whole[: len(self.stamp)].tobytes() == self.stamp


class SegmentMaps:
    """Prefill's side: mappings of decode workers' segments, opened by name and kept for reuse (LRU).

    A mapping keeps its segment's pages alive after decode removed the name (a segment retired after a cancel
    or a retry), so mappings of removed names are dropped whenever a segment is opened and when a request ends.
    """

    def __init__(self, keep_bytes: int = 4 << 30) -> None:
        self.keep_bytes = keep_bytes
        self._maps: OrderedDict[str, tuple[mmap.mmap, np.ndarray]] = OrderedDict()
        self._lock = threading.Lock()  # the metrics scrape reads `mapped_bytes` from another thread

    def open(self, name: str, reservation_token: str, nbytes: int) -> SegmentView | None:
        """The segment, if `name` is a segment on this host lent to this reservation with room for `nbytes`."""
        if not _SEGMENT_NAME.match(name):
            return None
        self.prune()
        mapped = self._maps.get(name)
        if mapped is None:
            try:
                fd = os.open(SHM_DIR / name, os.O_RDWR)
            except OSError:  # another host (or another /dev/shm): the bytes go over gRPC
                return None
            try:
                mapping = mmap.mmap(fd, os.fstat(fd).st_size, flags=mmap.MAP_SHARED | mmap.MAP_POPULATE)
            finally:
                os.close(fd)
            mapped = (mapping, np.frombuffer(mapping, dtype=np.uint8))
            with self._lock:
                self._maps[name] = mapped
                self._evict()
        with self._lock:
            self._maps.move_to_end(name)
        segment = SegmentView(mapped[1], stamp_of(reservation_token), nbytes)
        if segment.whole.size < STAMP_BYTES + nbytes or not segment.still_lent():
            return None
        return segment

    def prune(self) -> None:
        """Drop the mappings of segments whose names decode removed (unmapped once the last view is gone)."""
        with self._lock:
            for name in [name for name in self._maps if not (SHM_DIR / name).exists()]:
                del self._maps[name]

    @property
    def mapped_bytes(self) -> int:
        with self._lock:
            return sum(mapping.size() for mapping, _ in self._maps.values())

    def _evict(self) -> None:
        while len(self._maps) > 1 and sum(m[0].size() for m in self._maps.values()) > self.keep_bytes:
            self._maps.popitem(last=False)  # unmapped once the last view of it is gone

    def close(self) -> None:
        with self._lock:
            self._maps.clear()


def stamp(segment: Segment, reservation_token: str | None) -> None:
    """Mark a segment as lent to this reservation, or (None) as taken back."""
    value = stamp_of(reservation_token) if reservation_token is not None else bytes(32)
    segment.array[: len(value)] = np.frombuffer(value, dtype=np.uint8)


def data_region(segment: Segment, nbytes: int) -> np.ndarray:
    return segment.array[STAMP_BYTES : STAMP_BYTES + nbytes]


_owner: tuple[int, str, int] | None = None  # this process's (pid, tag, lock fd)
_owner_guard = threading.Lock()


def _owner_tag() -> str:
    """This process's tag, the first 8 hex characters of its segments' random part; its lock file is flocked
    from the first call until the process ends (the kernel lets go of a killed one's)."""
    global _owner
    with _owner_guard:
        if _owner is None or _owner[0] != os.getpid():  # (a forked child is an owner of its own)
            pid, tag = os.getpid(), secrets.token_hex(4)
            lock = SHM_DIR / f"{SEGMENT_PREFIX}{pid}-{tag}.lock"
            fd = -1
            try:  # locked under a temporary name, then renamed: a sweep never sees it unlocked
                staging = lock.with_name(lock.name + ".new")
                fd = os.open(staging, os.O_CREAT | os.O_RDWR | os.O_CLOEXEC, 0o600)
                fcntl.flock(fd, fcntl.LOCK_EX)
                os.rename(staging, lock)
            except OSError as exc:  # no /dev/shm: the segments fail anyway; a sweep falls back to the pid
                log.warning("no owner lock for shared-memory KV segments: %s", exc)
            _owner = (pid, tag, fd)
        return _owner[1]


def _release_owner() -> None:
    """At a normal exit: remove this process's segments (held ones too), then its lock, the last. A lock removed
    first would leave a sweep only the pid to judge them by, which another pid namespace may reuse. A segment that
    cannot be removed keeps the lock file: it is free once this process is gone, so the next sweep takes both."""
    if _owner is None or _owner[0] != os.getpid():
        return
    prefix = f"{SEGMENT_PREFIX}{_owner[0]}-{_owner[1]}"
    for path in SHM_DIR.glob(f"{prefix}*"):
        if _SEGMENT_NAME.match(path.name):
            _unlink(path.name)
    if not _segments_left(prefix):
        _unlink(f"{prefix}.lock")


def _segments_left(prefix: str) -> bool:
    """Whether a segment named `prefix` + random is in /dev/shm: its owner's lock must stay while one is."""
    return any(_SEGMENT_NAME.match(path.name) for path in SHM_DIR.glob(f"{prefix}*"))


atexit.register(_release_owner)  # at import: it runs after every pool's close (atexit runs last-in, first-out)


def remove_orphans() -> int:
    """Unlink every pdserve segment in /dev/shm that this user owns and whose owner process is gone, and the
    owners' lock files; returns how many segments. Another user's segments are left alone: they are not ours to
    judge and /dev/shm's sticky bit forbids removing them anyway."""
    removed = 0
    if not SHM_DIR.is_dir():
        return 0
    uid = os.getuid()
    for path in SHM_DIR.glob(f"{SEGMENT_PREFIX}*"):
        match = _SEGMENT_NAME.match(path.name)
        try:
            mine = path.stat().st_uid == uid
        except OSError:  # gone meanwhile
            continue
        if match and mine and not _owner_alive(int(match.group(1)), match.group(2)):
            removed += _unlink(path.name)
    for path in SHM_DIR.glob(f"{SEGMENT_PREFIX}*.lock"):  # after their segments: a lock left alone means alive
        match = _LOCK_NAME.match(path.name)
        if match and not _owner_alive(int(match.group(1)), match.group(2)) and not _segments_left(path.name[:-5]):
            _unlink(path.name)
    if removed:
        log.info("removed %d shared-memory KV segments left by dead processes", removed)
    return removed


def _owner_alive(pid: int, tag: str) -> bool:
    """Whether the owner of the segments tagged `tag` lives: its lock is held. Without a lock file (an owner that
    could not make one), whether its pid lives in this pid namespace."""
    try:
        fd = os.open(SHM_DIR / f"{SEGMENT_PREFIX}{pid}-{tag}.lock", os.O_RDWR | os.O_CLOEXEC)
    except FileNotFoundError:
        return _alive(pid)
    except OSError:  # another user's lock: not ours to judge
        return True
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)  # held by its owner (this process too) while it lives
    except BlockingIOError:
        return True
    finally:
        os.close(fd)
    return False


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # someone else's live process
        return True
    return True


def _unlink(name: str) -> int:
    try:
        os.unlink(SHM_DIR / name)
        return 1
    except FileNotFoundError:
        return 0
    except PermissionError:  # not ours after all (owner changed under us): leave it
        log.warning("cannot remove shared-memory segment %s: permission denied", name)
        return 0
