"""`pdserve bench kv`: how fast a prompt's KV moves from prefill to decode, against the ceilings that bound it.

One run, for the KV of 512, 2048 and 8000-token prompts of the default model (8000, not 8192: the context
must keep room for generated tokens), measures side by side:
- grpc: the real KV path, bytes in the stream: KVSender -> a real decode worker's TransferKV (validation,
  checksums), timed from the first message to decode's acknowledgement;
- shm: the same, through the shared-memory segment the decode worker lent, as a prompt with passes of its own
  (every prompt here: each is longer than a batch) sends it: its forward pass computed the KV straight into the
  segment (done before the clock starts, as the gRPC path's KV is computed before its clock), so the sender only
  hashes each tensor where it lies and sends descriptors;
- shm_copy: the same, with the sender copying the KV into the segment first, as for prompts that share a batched
  pass (the segment is one prompt's; the batch's cache is not);
- grpc_prebuilt: the gRPC path with its messages built before the clock starts: what the stream and decode's
  checks cost, without building the messages (one copy of every byte and its checksum, on the sending core);
- grpc_ceiling: raw grpcio bytes streaming with the same chunk size into a sink that only counts them: the
  payload's own bytes, cut into chunk-sized bytes objects before the clock starts;
- grpc_hot_chunk: the same, but one chunk sent over and over, so the sender reads it from cache (the ceiling
  as first measured here; it overstates what moving distinct bytes can reach, and is kept for comparison);
- tcp: one loopback TCP stream into a sink; memcpy: one copy between two warm buffers in one thread.
Then the exposed transfer time: a real prefill worker's Prefill call until its KV is acknowledged by the decode
worker, minus the prefill forward pass alone, as a fraction of the forward pass; for the default (shared
memory, layer-streamed), gRPC, and gRPC-after-the-forward-pass workers. "Alone" is the forward time reported by
the worker that sends its KV only after the pass, so nothing else runs beside it.
Every figure is the median of --repeats runs; the JSON also keeps every sample. For the gRPC and shm paths and the
ceilings, each run also records the CPU time each end spent within its clock (the sending process, and the decode
worker or the sink): what the real paths cost beyond the ceiling, side by side.
"""

from __future__ import annotations

import argparse
import asyncio
import functools
import json
import math
import os
import platform
import random
import socket
import statistics
import sys
import threading
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TypeVar

import grpc
import numpy as np
import torch
import uvloop

from bench.report import add_output_args, publish
from kv_wire import codec
from kv_wire.layout import DEFAULT_CHUNK_BYTES, KVLayout
from kv_wire.segments import SegmentMaps
from kv_wire.sender import Item, KVSender, encode_stream
from model_runner.loading import DTYPES, resolve_model
from pdserve.cluster import Service, spawn_service, stop_all, wait_ready
from protos import decode_pb2, decode_pb2_grpc, prefill_pb2, prefill_pb2_grpc, worker_pb2
from protos import kv_transfer_pb2 as pb
from serving import memory
from serving.models import DEFAULT_MODEL
from serving.server import MESSAGE_LIMITS

TOKENS = (512, 2048, 8000)
HEADLINE_TOKENS = 2048
T = TypeVar("T")
PATHS = ("memcpy", "tcp", "grpc_ceiling", "grpc_hot_chunk", "grpc_prebuilt", "grpc", "shm", "shm_copy")
CPU_PATHS = ("grpc_ceiling", "grpc_prebuilt", "grpc", "shm", "shm_copy")  # both ends' CPU time is reported for these
_SINK_METHOD = "/pdserve.bench.Sink/Bytes"
_SINK_TCP_PORT = "/pdserve.bench.Sink/TcpPort"
_GREEDY = worker_pb2.SamplingParams(temperature=0.0, top_p=1.0)
# Exposed-transfer variants: prefill worker flags.
PREFILL_VARIANTS = {"shm": (), "grpc": ("--no-kv-shm",), "grpc_unstreamed": ("--no-kv-shm", "--no-layer-streaming")}


def add_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--model", default=DEFAULT_MODEL, help="model whose KV layout is moved (default: %(default)s)")
    parser.add_argument("--tokens", default=",".join(map(str, TOKENS)), help="prompt lengths (default: %(default)s)")
    parser.add_argument("--chunk-bytes", type=int, default=DEFAULT_CHUNK_BYTES)
    parser.add_argument("--repeats", type=int, default=15, help="runs per figure; the median is reported")
    parser.add_argument("--exposed-tokens", type=int, default=HEADLINE_TOKENS,
                        help="prompt length of the exposed-transfer measurement (default: %(default)s)")
    parser.add_argument("--exposed-repeats", type=int, default=5, help="prefill runs per exposed-time figure")
    parser.add_argument("--threads", type=int, default=max(1, (os.cpu_count() or 2) // 2),
                        help="torch threads of the prefill workers (default: %(default)s, as `pdserve cluster`)")
    parser.add_argument("--no-exposed", action="store_true", help="skip the (slow) exposed-transfer measurement")
    add_output_args(parser, "kv")


def run(args: argparse.Namespace) -> int:
    tokens = [int(t) for t in args.tokens.split(",")]
    memory.keep_heap_warm()  # as every pdserve process does; the sink process too (ceilings get the same heap)
    model_dir = resolve_model(args.model)
    # The sending side runs on uvloop, as every pdserve process does (serving.main): grpc.aio's per-message cost
    # is the event loop's, and the real paths and the ceilings they are held against share this loop.
    result = uvloop.run(_bench(args, model_dir, tokens))
    return publish(args, "kv", result, lambda: _table(result), lambda path: _plot(result, path))


async def _bench(args: argparse.Namespace, model_dir: Path, tokens: list[int]) -> dict[str, Any]:
    flags = ["--host", "127.0.0.1", "--port", "0", "--model", str(model_dir)]
    # Senders (this process, the prefill workers) on one half of the cores, receivers on the other, as a
    # deployment sharing a host would pin them: the figures do not depend on where the scheduler put whom.
    cores = sorted(os.sched_getaffinity(0))
    send_cpus, receive_cpus = set(cores[: len(cores) // 2] or cores), set(cores[len(cores) // 2 :])
    os.sched_setaffinity(0, send_cpus)
    decode = spawn_service("decode", "decode_service", [*flags, "--threads", "1", "--max-seqs", "2"], receive_cpus)
    sink = spawn_service("sink", "bench.kv", ["--sink"], receive_cpus)
    prefills = {} if args.no_exposed else {
        # No prefix cache: the exposed-transfer rounds repeat one prompt, and each must run the whole forward pass.
        name: spawn_service("prefill", "prefill_service",
                            [*flags, "--threads", str(args.threads), "--prefix-cache-mb=0", *extra], send_cpus)
        for name, extra in PREFILL_VARIANTS.items()}
    services = [decode, sink, *prefills.values()]
    try:
        wait_ready(services, 300)
        async with grpc.aio.insecure_channel(decode.address, options=MESSAGE_LIMITS) as channel:
            stub = decode_pb2_grpc.DecodeStub(channel)
            model = (await stub.GetInfo(worker_pb2.WorkerInfoRequest())).model
            cases = {}
            for count in tokens:
                cases[str(count)] = await _throughput_case(stub, codec.transfer_kv(channel), model, decode, sink,
                                                           count, args)
                print(f"bench kv: {count} tokens done", file=sys.stderr, flush=True)
            exposed = {} if args.no_exposed else await _exposed(stub, decode.address, prefills, model, args)
    finally:
        stop_all(services, grace_s=10)
    headline = cases.get(str(HEADLINE_TOKENS), next(iter(cases.values())))
    return {
        "machine": _machine(),
        "model": model.name, "kv_bytes_per_token": 2 * model.num_layers * model.num_kv_heads * model.head_dim * 4,
        "chunk_bytes": args.chunk_bytes, "repeats": args.repeats,
        **{key: headline[key] for key in ("grpc_gbps", "grpc_ceiling_gbps", "grpc_hot_chunk_gbps",
                                          "grpc_prebuilt_gbps", "tcp_gbps", "shm_gbps", "shm_copy_gbps",
                                          "memcpy_gbps")},
        "exposed_transfer_frac": exposed.get("shm", {}).get("exposed_transfer_frac"),
        "cases": cases,
        "exposed": exposed,
    }


async def _throughput_case(stub: decode_pb2_grpc.DecodeStub, transfer_kv: grpc.aio.StreamUnaryMultiCallable,
                           model: worker_pb2.ModelInfo, decode: Service, sink: Service, count: int,
                           args: argparse.Namespace) -> dict[str, Any]:
    layout = KVLayout(model.num_layers, model.num_kv_heads, model.head_dim, count, model.dtype)
    generator = torch.Generator().manual_seed(count)
    dtype = DTYPES[model.dtype]  # the decode worker's, as a prefill worker of the same model would send
    kv = [(torch.randn(layout.tensor_shape, generator=generator).to(dtype),
           torch.randn(layout.tensor_shape, generator=generator).to(dtype)) for _ in range(layout.num_layers)]
    nbytes = layout.total_bytes
    samples: dict[str, list[Sample]] = {name: [] for name in PATHS}
    payload = np.random.default_rng(count).integers(0, 256, nbytes, dtype=np.uint8)
    copy_target = np.empty_like(payload)
    real_path = functools.partial(_real_path, stub, transfer_kv, model, layout, kv, args.chunk_bytes,
                                  decode.process.pid)
    sink_pid = sink.process.pid
    async with grpc.aio.insecure_channel(sink.address, options=MESSAGE_LIMITS) as sink_channel:
        raw_stream = sink_channel.stream_unary(_SINK_METHOD)  # no serializers: bytes go out as they are
        sink_tcp = int.from_bytes(await sink_channel.unary_unary(_SINK_TCP_PORT)(b""), "little")
        step = args.chunk_bytes
        chunks = [payload[offset : offset + step].tobytes() for offset in range(0, nbytes, step)]
        hot_chunks = [chunks[0][: len(chunk)] for chunk in chunks]  # the first chunk again (a full slice is itself)
        measure: dict[str, Callable[[int], Awaitable[Sample]]] = {
            "memcpy": lambda _: _wall_only(asyncio.to_thread(_timed_sync, lambda: np.copyto(copy_target, payload))),
            "tcp": lambda _: _wall_only(asyncio.to_thread(_tcp_send, sink_tcp, payload)),
            "grpc_ceiling": lambda _: _timed(lambda: raw_stream(_each(chunks)), sink_pid),
            "grpc_hot_chunk": lambda _: _timed(lambda: raw_stream(_each(hot_chunks)), sink_pid),
            "grpc_prebuilt": lambda repeat: real_path(shm=False, tag=f"prebuilt-{count}-{repeat}", prebuilt=True),
            "grpc": lambda repeat: real_path(shm=False, tag=f"{count}-{repeat}"),
            "shm": lambda repeat: real_path(shm=True, tag=f"{count}-{repeat}", in_place=True),
            "shm_copy": lambda repeat: real_path(shm=True, tag=f"copy-{count}-{repeat}"),
        }
        order = random.Random(count)
        for repeat in range(args.repeats + 1):  # the first round warms buffers and connections; not recorded
            names = list(measure)
            order.shuffle(names)  # interleaved in a new order each round: no path always runs after another
            for name in names:
                sample = await measure[name](repeat)
                if repeat:
                    samples[name].append(sample)
    case: dict[str, Any] = {"tokens": count, "kv_bytes": nbytes}
    for name, runs in samples.items():
        case[f"{name}_gbps"] = nbytes / statistics.median(run.seconds for run in runs) / 1e9
        case[f"{name}_ms_samples"] = [run.seconds * 1e3 for run in runs]
        if name in CPU_PATHS:
            case[f"{name}_sender_cpu_ms"] = statistics.median(run.sender_cpu_s for run in runs) * 1e3
            case[f"{name}_receiver_cpu_ms"] = statistics.median(run.receiver_cpu_s for run in runs) * 1e3
    case["grpc_vs_ceiling"] = case["grpc_gbps"] / case["grpc_ceiling_gbps"]
    case["grpc_prebuilt_vs_ceiling"] = case["grpc_prebuilt_gbps"] / case["grpc_ceiling_gbps"]
    case["shm_vs_grpc"] = case["shm_gbps"] / case["grpc_gbps"]
    case["shm_copy_vs_grpc"] = case["shm_copy_gbps"] / case["grpc_gbps"]
    case["shm_vs_memcpy"] = case["shm_gbps"] / case["memcpy_gbps"]
    return case


async def _real_path(
    stub: decode_pb2_grpc.DecodeStub, transfer_kv: grpc.aio.StreamUnaryMultiCallable, model: worker_pb2.ModelInfo,
    layout: KVLayout, kv: list[tuple[torch.Tensor, torch.Tensor]], chunk_bytes: int, decode_pid: int, shm: bool,
    tag: str, prebuilt: bool = False, in_place: bool = False,
) -> Sample:
    """Reserve on the decode worker, then time the KV stream from its first message to decode's ack.

    `prebuilt`: the messages are built first, and the clock runs only while they are streamed and checked.
    `in_place` (shared memory): the KV is put where the forward pass would have computed it, in the segment, first.
    """
    request_id = f"bench-{'shm' if shm else 'grpc'}-{tag}"
    call = stub.Generate(decode_pb2.DecodeRequest(request_id=request_id, prompt_tokens=layout.num_tokens,
                                                  max_tokens=1, sampling=_GREEDY))
    reservation = (await call.read()).reserved
    segment = None
    if shm:
        segment = SegmentMaps().open(reservation.shm_segment, reservation.token, layout.total_bytes)
        if segment is None:
            raise RuntimeError("the decode worker lent no shared-memory segment this process can open")
        if in_place:
            homes = segment.tensors(layout)
            for home, source in zip((t for pair in homes for t in pair), (t for pair in kv for t in pair)):
                # numpy's copy, one thread: torch's would leave its pool's threads spinning into the clock
                np.copyto(home.view(torch.uint8).numpy(), source.view(torch.uint8).numpy())
            kv = homes
    sender = KVSender(request_id, reservation.token, model.fingerprint, layout, chunk_bytes, segment=segment)
    layers: asyncio.Queue[Item] = asyncio.Queue()  # every layer ready, as after a forward pass
    for index, (keys, values) in enumerate(kv):
        layers.put_nowait((index, keys, values))
    layers.put_nowait(0)  # the first token closes the stream
    stream: AsyncIterator[pb.KVTransfer | bytes] = encode_stream(sender, layers)
    if prebuilt:
        stream = _each([message async for message in stream])
    sample = await _timed(lambda: transfer_kv(stream), decode_pid)
    await _drain(call)  # max_tokens=1: the sequence finishes at once and the reservation is released
    return sample


async def _exposed(stub: decode_pb2_grpc.DecodeStub, decode_address: str, prefills: dict[str, Service],
                   model: worker_pb2.ModelInfo, args: argparse.Namespace) -> dict[str, Any]:
    """Prefill call -> KV acknowledged by decode, against the forward pass alone.

    "Alone" is the forward time the gRPC-after-the-forward-pass worker reports: its pass runs with no transfer
    work beside it, in a worker process like the others. The variants take turns, round by round.
    """
    prompt = np.random.default_rng(0).integers(100, model.vocab_size, args.exposed_tokens).tolist()
    runs: dict[str, list[tuple[float, float, str]]] = {name: [] for name in prefills}
    channels = {name: grpc.aio.insecure_channel(service.address) for name, service in prefills.items()}
    try:
        for repeat in range(args.exposed_repeats + 1):  # the first round warms up; not recorded
            for name, channel in channels.items():
                run = await _prefill_to_ack(stub, decode_address, prefill_pb2_grpc.PrefillStub(channel), prompt,
                                            f"exposed-{name}-{repeat}")
                if repeat:
                    runs[name].append(run)
            print(f"bench kv: exposed transfer round {repeat} done", file=sys.stderr, flush=True)
    finally:
        for channel in channels.values():
            await channel.close()
    alone_s = statistics.median(forward for _, forward, _ in runs["grpc_unstreamed"])
    result: dict[str, Any] = {"tokens": args.exposed_tokens, "threads": args.threads,
                              "forward_alone_ms": alone_s * 1e3}
    for name, samples in runs.items():
        full_s = statistics.median(full for full, _, _ in samples)
        result[name] = {
            "full_path_ms": full_s * 1e3, "exposed_ms": (full_s - alone_s) * 1e3,
            "exposed_transfer_frac": (full_s - alone_s) / alone_s, "transport": samples[0][2],
            # Less noisy, and a lower bound: the time from this run's own forward end to the acknowledgement.
            "after_own_forward_ms": statistics.median(full - forward for full, forward, _ in samples) * 1e3,
            "full_path_ms_samples": [full * 1e3 for full, _, _ in samples],
            "forward_ms_samples": [forward * 1e3 for _, forward, _ in samples],
        }
    return result


async def _prefill_to_ack(
    decode: decode_pb2_grpc.DecodeStub, decode_address: str, prefill: prefill_pb2_grpc.PrefillStub,
    prompt: list[int], request_id: str,
) -> tuple[float, float, str]:
    """(seconds from the Prefill call to TransferDone, the worker's forward seconds, the KV transport)."""
    call = decode.Generate(decode_pb2.DecodeRequest(request_id=request_id, prompt_tokens=len(prompt), max_tokens=1,
                                                    sampling=_GREEDY))
    reservation = (await call.read()).reserved
    started = time.perf_counter()
    transport, forward_s = "", 0.0
    async for event in prefill.Prefill(prefill_pb2.PrefillRequest(
            request_id=request_id, token_ids=prompt, sampling=_GREEDY, decode_address=decode_address,
            reservation_token=reservation.token, shm_segment=reservation.shm_segment)):
        if event.WhichOneof("event") == "first_token":
            forward_s = event.first_token.forward_ms / 1e3
        elif event.WhichOneof("event") == "transfer_done":
            transport = event.transfer_done.transport
    seconds = time.perf_counter() - started
    await _drain(call)
    return seconds, forward_s, transport


# --- helpers -------------------------------------------------------------------------------------------------


async def _drain(call: grpc.aio.UnaryStreamCall) -> None:
    while await call.read() is not grpc.aio.EOF:
        pass


@dataclass(frozen=True)
class Sample:
    """One timed run, and the CPU time each end spent within it (all their threads; nan where not measured)."""

    seconds: float
    sender_cpu_s: float = math.nan
    receiver_cpu_s: float = math.nan


async def _timed(make_call: Callable[[], Any], receiver_pid: int) -> Sample:
    sender_cpu, receiver_cpu = time.process_time(), _cpu_seconds(receiver_pid)
    started = time.perf_counter()
    await make_call()
    seconds = time.perf_counter() - started
    return Sample(seconds, time.process_time() - sender_cpu, _cpu_seconds(receiver_pid) - receiver_cpu)


async def _wall_only(seconds: Awaitable[float]) -> Sample:
    return Sample(await seconds)


def _cpu_seconds(pid: int) -> float:
    """CPU time so far of every live thread of process `pid` (Linux; nan where /proc cannot tell)."""
    nanoseconds = 0
    tasks = list(Path(f"/proc/{pid}/task").glob("*/schedstat"))
    for path in tasks:
        try:
            nanoseconds += int(path.read_text().split()[0])
        except (OSError, ValueError, IndexError):  # a thread that ended meanwhile
            pass
    return nanoseconds / 1e9 if tasks else math.nan


def _timed_sync(work: Callable[[], Any]) -> float:
    started = time.perf_counter()
    work()
    return time.perf_counter() - started


async def _each(messages: Iterable[T]) -> AsyncIterator[T]:
    for message in messages:
        yield message


def _tcp_send(port: int, payload: np.ndarray) -> float:
    with socket.create_connection(("127.0.0.1", port)) as connection:
        connection.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        started = time.perf_counter()
        connection.sendall(len(payload).to_bytes(8, "little"))
        connection.sendall(payload.data)
        connection.recv(1)  # the sink's acknowledgement: every byte arrived
        return time.perf_counter() - started


def _machine() -> dict[str, Any]:
    model_name = ""
    try:
        model_name = next(line.split(":", 1)[1].strip() for line in Path("/proc/cpuinfo").read_text().splitlines()
                          if line.startswith("model name"))
    except (OSError, StopIteration):
        pass
    return {"cpu": model_name or platform.processor(), "cores": os.cpu_count(), "python": platform.python_version(),
            "pinning": "senders on the first half of the cores, receivers on the second",
            "torch": torch.__version__, "grpcio": grpc.__version__, "platform": platform.platform()}


def _table(result: dict[str, Any]) -> str:
    lines = [f"KV transfer, {result['model']} ({result['kv_bytes_per_token']} B/token), chunks of "
             f"{result['chunk_bytes']} B, median of {result['repeats']}; {result['machine']['cpu']}, "
             f"{result['machine']['cores']} cores. GB/s = 1e9 bytes/s.",
             f"{'tokens':>7} {'MB':>7} {'grpc':>7} {'prebuilt':>8} {'ceiling':>8} {'hot':>7} {'tcp':>7} {'shm':>7} "
             f"{'shm_copy':>8} {'memcpy':>7} {'grpc/ceil':>9} {'prebuilt/ceil':>13} {'shm/grpc':>8} "
             f"{'shm_copy/grpc':>13} {'shm/memcpy':>10}"]
    for case in result["cases"].values():
        lines.append(f"{case['tokens']:>7} {case['kv_bytes'] / 1e6:>7.1f} {case['grpc_gbps']:>7.2f} "
                     f"{case['grpc_prebuilt_gbps']:>8.2f} {case['grpc_ceiling_gbps']:>8.2f} "
                     f"{case['grpc_hot_chunk_gbps']:>7.2f} {case['tcp_gbps']:>7.2f} {case['shm_gbps']:>7.2f} "
                     f"{case['shm_copy_gbps']:>8.2f} {case['memcpy_gbps']:>7.2f} {case['grpc_vs_ceiling']:>9.0%} "
                     f"{case['grpc_prebuilt_vs_ceiling']:>13.0%} {case['shm_vs_grpc']:>7.1f}x "
                     f"{case['shm_copy_vs_grpc']:>12.1f}x {case['shm_vs_memcpy']:>10.0%}")
    lines.append("CPU time within the clock, ms, sender / receiver (the decode worker, or the ceiling's sink):")
    lines.append(f"{'tokens':>7} " + " ".join(f"{name:>17}" for name in CPU_PATHS))
    for case in result["cases"].values():
        lines.append(f"{case['tokens']:>7} " + " ".join(
            f"{case[f'{name}_sender_cpu_ms']:>8.1f}/{case[f'{name}_receiver_cpu_ms']:<8.1f}" for name in CPU_PATHS))
    exposed = result["exposed"]
    if exposed:
        lines.append(f"Exposed transfer at {exposed['tokens']} tokens: prefill call -> KV acknowledged, minus the "
                     f"forward pass alone ({exposed['forward_alone_ms']:.0f} ms, {exposed['threads']} thread(s)):")
        for name in PREFILL_VARIANTS:
            e = exposed[name]
            lines.append(f"  {name:<16} full path {e['full_path_ms']:8.1f} ms  exposed {e['exposed_ms']:7.1f} ms = "
                         f"{e['exposed_transfer_frac']:6.1%} of the forward pass; after its own forward pass "
                         f"{e['after_own_forward_ms']:6.1f} ms ({e['transport']})")
    return "\n".join(lines)


def _plot(result: dict[str, Any], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    paths = ["grpc", "grpc_prebuilt", "grpc_ceiling", "grpc_hot_chunk", "tcp", "shm", "shm_copy", "memcpy"]
    cases = list(result["cases"].values())
    figure, axis = plt.subplots(figsize=(8, 4.5))
    width = 0.8 / len(paths)
    for i, name in enumerate(paths):
        axis.bar([c + i * width for c in range(len(cases))], [case[f"{name}_gbps"] for case in cases], width,
                 label=name)
    axis.set_xticks([c + 0.4 - width / 2 for c in range(len(cases))],
                    [f"{case['tokens']} tokens\n{case['kv_bytes'] / 1e6:.0f} MB" for case in cases])
    axis.set_ylabel("GB/s (median)")
    axis.set_title(f"KV transfer, {result['model']}: pdserve paths vs ceilings")
    axis.legend()
    figure.tight_layout()
    figure.savefig(path, dpi=120)
    plt.close(figure)


# --- the sink process ----------------------------------------------------------------------------------------


def _sink() -> None:
    """Counts raw gRPC bytes and TCP bytes; prints one JSON line with its gRPC address, like a pdserve worker."""
    memory.keep_heap_warm()
    listener = socket.create_server(("127.0.0.1", 0))
    threading.Thread(target=_tcp_sink, args=(listener,), daemon=True).start()

    async def count(requests: AsyncIterator[bytes], context: grpc.aio.ServicerContext) -> bytes:
        received = 0
        async for message in requests:
            received += len(message)
        return received.to_bytes(8, "little")

    async def tcp_port(request: bytes, context: grpc.aio.ServicerContext) -> bytes:
        return int(listener.getsockname()[1]).to_bytes(8, "little")

    async def main() -> None:
        server = grpc.aio.server(options=MESSAGE_LIMITS)
        handlers = {"Bytes": grpc.stream_unary_rpc_method_handler(count),  # no deserializer: raw bytes
                    "TcpPort": grpc.unary_unary_rpc_method_handler(tcp_port)}
        server.add_generic_rpc_handlers([grpc.method_handlers_generic_handler("pdserve.bench.Sink", handlers)])
        port = server.add_insecure_port("127.0.0.1:0")
        await server.start()
        print(json.dumps({"address": f"127.0.0.1:{port}"}), flush=True)
        await server.wait_for_termination()

    uvloop.run(main())


def _tcp_sink(listener: socket.socket) -> None:
    buffer = bytearray()
    while True:
        connection, _ = listener.accept()
        with connection:
            header = connection.recv(8, socket.MSG_WAITALL)
            total = int.from_bytes(header, "little")
            if len(buffer) < total:
                buffer = bytearray(total)
            view, received = memoryview(buffer), 0
            while received < total:
                got = connection.recv_into(view[received:total])
                if not got:
                    break
                received += got
            connection.sendall(b"k")


if __name__ == "__main__":
    if sys.argv[1:] == ["--sink"]:
        _sink()
