"""`pdserve bench serve`: one mixed workload through OpenAI-compatible streaming endpoints, one system after another.

Each system (`--url`, repeatable, `name=url`; `--cluster` starts a local pdserve one) gets the same workload:
- `--chat-streams` closed-loop chat streams: each sends a ~60-word prompt for `--chat-tokens` tokens and, once
  the last one arrives, the next;
- a ~1,100-word document (about 1,500 tokens) every `--doc-interval` seconds, for `--doc-tokens` tokens;
- for `--duration` seconds; then nothing new is sent, and requests in flight get `--drain-timeout` seconds more
  (one not finished by then is cut off and not counted).
Requests go to /v1/completions (or /v1/chat/completions with `--api chat`): greedy, `stream: true`,
`ignore_eos: true` (a vLLM extension llama.cpp and pdserve also honour, so every request generates exactly
`max_tokens`) and `stream_options.include_usage`. Each prompt opens with a fresh nonce and a counter, so no
prompt shares a prefix with another (no prefix cache helps anyone, nor a rerun against a warm server); the
words after it come from a fixed list and a seeded RNG, so every system and every run gets the same text.
A token's arrival is the arrival of a streamed chunk with a choice, its text empty or not (a special token's
chunk has none), but for the chat's opening chunk that names the role: vLLM's own benchmark counts them so. The
output token count is the server's usage when it reports one, else the chunk count. Per system: chat TTFT
p50/p99, chat ITL (gaps between chunks) p50/p99/max, chats completed, document TTFT p50, output tokens/s, and
goodput: requests per second that met the SLO (TTFT <= `--slo-ttft` and time per output token after the first
<= `--slo-tpot`).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import math
import random
import re
import secrets
import select
import shlex
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import aiohttp

from bench.report import add_output_args, publish
from bench.scenarios import percentile
from serving import memory

MAX_REQUESTS_PER_STREAM = 10_000  # a bound on each chat loop besides --duration
FAILURE_PAUSE_S = 0.1  # a chat stream waits this long after a failed request, so a failing server isn't hammered
CLUSTER_START_S = 600.0
WARMUP_TIMEOUT_S = 300.0  # the first request may wait for a server's lazy start (vLLM compiles)
ENDPOINTS = {"completions": "/v1/completions", "chat": "/v1/chat/completions"}

# The prompts' vocabulary: common words and rarer ones of 2-3 tokens; with sentences, about 1.37 tokens a word
# with SmolLM2's tokenizer (1,100 words: about 1,500 tokens).
WORDS = (
    "the of and to in is was for on that with as by at from his her they this which were be are had an or has "
    "their one not but all would there been more when into other some time only its new after most first also "
    "river mountain village harbour library garden window station kitchen festival morning evening winter summer "
    "journey history science music painting language market forest island bridge castle valley coast weather "
    "carefully quietly suddenly gradually beautiful ancient curious gentle narrow distant golden silver wooden "
    "remember discover imagine consider explain describe travel gather follow wonder build measure collect "
    "astronomy photosynthesis architecture philosophy mathematics literature geography engineering medicine "
    "telescope microscope algorithm orchestra cathedral lighthouse parliament university laboratory manuscript "
    "seventeen hundred thousand twelve eighty several numerous countless occasional remarkable extraordinary "
    "kaleidoscope quixotic serendipity juxtapose sphinx obsidian fjord hydrangea "
    "marigold cardamom nutmeg ballad sonata cantata aria clarinet bassoon oboe cartographer "
    "wheelwright shipwright goldsmith weaver potter thatcher thistle heron kestrel otter badger juniper quill "
    "inkwell sextant rudder cobblestone weathervane windmill granary"
).split()


@dataclass(frozen=True)
class System:
    name: str
    url: str  # the server's root, without /v1


def parse_url(value: str) -> System:
    """`name=url` or `url`; a bare host:port is taken as http, and a trailing /v1 is dropped."""
    name, sep, url = value.partition("=")
    if not sep or not re.fullmatch(r"[\w.-]+", name):
        name, url = "", value
    if "://" not in url:
        url = "http://" + url
    if not url.startswith(("http://", "https://")):
        raise argparse.ArgumentTypeError(f"{value!r}: expected [NAME=]http(s)://HOST:PORT")
    url = url.rstrip("/").removesuffix("/v1")
    return System(name or url.split("://", 1)[1], url)


def add_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--url", action="append", default=[], type=parse_url, metavar="[NAME=]URL",
                        help="an OpenAI-compatible server, e.g. vllm=http://127.0.0.1:8101 (repeatable)")
    parser.add_argument("--cluster", action="store_true",
                        help="also start a local pdserve cluster and run it first, as the system 'pdserve'")
    parser.add_argument("--cluster-args", default="", metavar="FLAGS",
                        help="flags for that `pdserve cluster`, e.g. \"--dtype bfloat16 --decode-arg=--max-seqs=16\" "
                        "(a single flag needs the = form: --cluster-args=--no-pin)")
    parser.add_argument("--model", default="", help="the model name sent (default: each server's first "
                        "GET /v1/models id)")
    parser.add_argument("--api", choices=("completions", "chat"), default="completions",
                        help="/v1/completions with a text prompt, or /v1/chat/completions (default: %(default)s)")
    parser.add_argument("--api-key", default="", help="sent as `Authorization: Bearer KEY`")
    parser.add_argument("--duration", type=float, default=30.0, help="seconds of new requests (default: %(default)s)")
    parser.add_argument("--drain-timeout", type=float, default=60.0,
                        help="seconds requests in flight at the end get to finish (default: %(default)s)")
    parser.add_argument("--chat-streams", type=int, default=4, help="closed-loop chat streams (default: %(default)s)")
    parser.add_argument("--chat-words", type=int, default=60, help="words per chat prompt (default: %(default)s)")
    parser.add_argument("--chat-tokens", type=int, default=48, help="tokens per chat reply (default: %(default)s)")
    parser.add_argument("--doc-words", type=int, default=1100, help="words per document (default: %(default)s)")
    parser.add_argument("--doc-tokens", type=int, default=8, help="tokens per document reply (default: %(default)s)")
    parser.add_argument("--doc-interval", type=float, default=3.0,
                        help="seconds between documents; 0: none (default: %(default)s)")
    parser.add_argument("--slo-ttft", type=float, default=1.0, help="TTFT SLO, seconds (default: %(default)s)")
    parser.add_argument("--slo-tpot", type=float, default=0.1,
                        help="time per output token SLO (after the first), seconds (default: %(default)s)")
    parser.add_argument("--seed", type=int, default=0, help="the prompts' words (default: %(default)s)")
    add_output_args(parser, "serve")


def prompt(seed: int, key: str, words: int, lead: str) -> str:
    """`lead`, then `words` words drawn by an RNG seeded with (seed, key), in sentences of 8 to 16 words."""
    rng = random.Random(f"{seed}:{key}")
    sentences, left = [], words
    while left > 0:
        n = min(left, rng.randint(8, 16))
        sentence = " ".join(rng.choice(WORDS) for _ in range(n))
        sentences.append(sentence[0].upper() + sentence[1:] + ".")
        left -= n
    return f"{lead} " + " ".join(sentences)


@dataclass
class Record:
    kind: str  # "chat" or "doc"
    sent: float = 0.0  # time.perf_counter() when sent
    token_times: list[float] = field(default_factory=list)  # seconds after `sent`, one per chunk with text
    usage_tokens: int | None = None  # completion_tokens, when the server reports usage
    prompt_tokens: int | None = None
    done: bool = False  # the stream ended normally (a finish_reason or [DONE])
    error: str = ""

    @property
    def ok(self) -> bool:
        return self.done and not self.error and bool(self.token_times)

    @property
    def output_tokens(self) -> int:
        return self.usage_tokens if self.usage_tokens is not None else len(self.token_times)

    @property
    def tpot(self) -> float:
        """Seconds per output token after the first (0 for a single token)."""
        n = self.output_tokens
        return (self.token_times[-1] - self.token_times[0]) / (n - 1) if n > 1 else 0.0

    def meets(self, slo_ttft: float, slo_tpot: float) -> bool:
        return self.ok and self.token_times[0] <= slo_ttft and self.tpot <= slo_tpot


class SSEParser:
    """Server-sent events from a byte stream: feed() the bytes as they arrive; it returns each complete event's
    data (several `data:` lines joined by newlines). Comments and other fields are skipped."""

    def __init__(self) -> None:
        self._buffer = bytearray()
        self._data: list[str] = []

    def feed(self, chunk: bytes) -> list[str]:
        self._buffer += chunk
        events = []
        while (newline := self._buffer.find(b"\n")) >= 0:
            line = bytes(self._buffer[:newline]).rstrip(b"\r").decode()
            del self._buffer[: newline + 1]
            if not line:  # a blank line ends the event
                if self._data:
                    events.append("\n".join(self._data))
                self._data = []
                continue
            name, _, value = line.partition(":")
            if name == "data":
                self._data.append(value.removeprefix(" "))
        return events


def on_event(record: Record, data: str, elapsed: float) -> None:
    """Apply one event's data, received `elapsed` seconds after the request was sent, to its record."""
    if data == "[DONE]":
        record.done = True
        return
    try:
        payload = json.loads(data)
    except ValueError:
        record.error = f"not JSON: {data[:100]!r}"
        return
    if not isinstance(payload, dict):
        return
    if payload.get("error"):
        error = payload["error"]
        record.error = str(error.get("message", error) if isinstance(error, dict) else error)[:200]
        return
    for choice in payload.get("choices") or []:
        # Every chunk with a choice is a token's arrival, its text empty or not (a special token), as vLLM's
        # benchmark counts them; but for the chat's opening chunk, which names the role and carries no token.
        if "role" not in (choice.get("delta") or {}):
            record.token_times.append(elapsed)
        if choice.get("finish_reason"):
            record.done = True
    usage = payload.get("usage")
    if isinstance(usage, dict):
        record.usage_tokens = usage.get("completion_tokens")
        record.prompt_tokens = usage.get("prompt_tokens")


class Client:
    """Streams requests to one server and records when each chunk arrives."""

    def __init__(self, session: aiohttp.ClientSession, system: System, model: str, args: argparse.Namespace) -> None:
        self.session, self.system, self.model, self.args = session, system, model, args
        self.nonce = secrets.token_hex(4)  # fresh each run: nothing is in any server's prefix cache
        self.count = 0

    async def send(self, kind: str, key: str, words: int, max_tokens: int, records: list[Record]) -> Record:
        self.count += 1
        text = prompt(self.args.seed, key, words, f"{self.nonce}-{self.count}:")
        body: dict[str, Any] = {"model": self.model, "max_tokens": max_tokens, "temperature": 0.0, "stream": True,
                                "ignore_eos": True, "stream_options": {"include_usage": True}}
        if self.args.api == "chat":
            body["messages"] = [{"role": "user", "content": text}]
        else:
            body["prompt"] = text
        record = Record(kind, sent=time.perf_counter())
        records.append(record)
        try:
            async with self.session.post(self.system.url + ENDPOINTS[self.args.api], json=body) as response:
                if response.status != 200:
                    record.error = f"HTTP {response.status}: {(await response.text())[:200]}"
                    return record
                parser = SSEParser()
                async for chunk in response.content.iter_any():
                    elapsed = time.perf_counter() - record.sent
                    for data in parser.feed(chunk):
                        on_event(record, data, elapsed)
        except (aiohttp.ClientError, TimeoutError) as exc:
            record.error = f"{type(exc).__name__}: {exc}"[:200]
        if not record.done and not record.error:
            record.error = "the stream ended without a finish_reason or [DONE]"
        return record


async def first_model(session: aiohttp.ClientSession, system: System) -> str:
    async with session.get(f"{system.url}/v1/models") as response:
        response.raise_for_status()
        return str((await response.json())["data"][0]["id"])


async def drive(system: System, args: argparse.Namespace) -> tuple[list[Record], float, str]:
    """The workload against one server: its records, the wall time they took, and the model name used."""
    headers = {"Authorization": f"Bearer {args.api_key}"} if args.api_key else {}
    timeout = aiohttp.ClientTimeout(total=None, connect=10)  # the drain timeout bounds the rest
    async with aiohttp.ClientSession(headers=headers, timeout=timeout,
                                     connector=aiohttp.TCPConnector(limit=0)) as session:
        async with asyncio.timeout(WARMUP_TIMEOUT_S):
            model = args.model or await first_model(session, system)
            client = Client(session, system, model, args)
            warmup = await client.send("chat", "warmup", 8, 4, [])
        if not warmup.ok:
            raise RuntimeError(f"the warm-up request failed: {warmup.error or 'no tokens'}")
        records: list[Record] = []
        started = time.perf_counter()
        end = started + args.duration

        async def chat_stream(stream: int) -> None:
            for k in range(MAX_REQUESTS_PER_STREAM):
                if time.perf_counter() >= end:
                    return
                record = await client.send("chat", f"chat:{stream}:{k}", args.chat_words, args.chat_tokens, records)
                if not record.ok:
                    await asyncio.sleep(FAILURE_PAUSE_S)

        async def documents() -> None:
            count = math.ceil(args.duration / args.doc_interval - 0.5) if args.doc_interval > 0 else 0
            async with asyncio.TaskGroup() as group:
                for k in range(count):  # at 0.5, 1.5, 2.5 ... intervals: chats start on their own
                    await asyncio.sleep(max(0.0, started + (k + 0.5) * args.doc_interval - time.perf_counter()))
                    group.create_task(client.send("doc", f"doc:{k}", args.doc_words, args.doc_tokens, records))

        tasks = [asyncio.create_task(chat_stream(s)) for s in range(args.chat_streams)]
        tasks.append(asyncio.create_task(documents()))
        _, pending = await asyncio.wait(tasks, timeout=args.duration + args.drain_timeout)
        for task in pending:
            task.cancel()
        for outcome in await asyncio.gather(*tasks, return_exceptions=True):
            if isinstance(outcome, Exception):
                raise outcome
        finished = [r.sent + r.token_times[-1] for r in records if r.ok]
        return records, max(args.duration, max(finished, default=started) - started), model


def summarize(records: list[Record], wall_s: float, slo_ttft: float, slo_tpot: float) -> dict[str, Any]:
    """The per-system figures (seconds, tokens/s, requests/s). Requests cut off by the drain timeout count
    nowhere but in `unfinished`; failed ones count against the SLO fraction."""
    completed = [r for r in records if r.ok]
    failed = [r for r in records if r.error]
    chats = [r for r in completed if r.kind == "chat"]
    docs = [r for r in completed if r.kind == "doc"]
    chat_ttfts = [r.token_times[0] for r in chats]
    itls = [b - a for r in chats for a, b in zip(r.token_times, r.token_times[1:])]
    met = [r for r in completed if r.meets(slo_ttft, slo_tpot)]
    prompt_tokens = [r.prompt_tokens for r in docs if r.prompt_tokens is not None]
    return {
        "chat_ttft_p50": percentile(chat_ttfts, 50), "chat_ttft_p99": percentile(chat_ttfts, 99),
        "chat_itl_p50": percentile(itls, 50), "chat_itl_p99": percentile(itls, 99),
        "chat_itl_max": max(itls, default=0.0),
        "chat_tpot_p50": percentile([r.tpot for r in chats], 50), "chats_completed": len(chats),
        "doc_ttft_p50": percentile([r.token_times[0] for r in docs], 50), "docs_completed": len(docs),
        "doc_prompt_tokens": sum(prompt_tokens) / len(prompt_tokens) if prompt_tokens else None,
        "output_tokens": sum(r.output_tokens for r in completed), "wall_s": wall_s,
        "output_tok_per_s": sum(r.output_tokens for r in completed) / wall_s,
        "goodput_req_per_s": len(met) / wall_s, "in_slo": len(met),
        "chats_in_slo": sum(r.kind == "chat" for r in met), "docs_in_slo": sum(r.kind == "doc" for r in met),
        "slo_fraction": len(met) / (len(completed) + len(failed)) if completed or failed else 0.0,
        "failed": len(failed), "unfinished": len(records) - len(completed) - len(failed),
        "usage_reported": bool(completed) and all(r.usage_tokens is not None for r in completed),
        "errors": sorted({r.error for r in failed})[:5],
    }


@contextlib.contextmanager
def local_cluster(flags: str) -> Iterator[System]:
    """`pdserve cluster FLAGS` as a child process, its HTTP on a free loopback port, its logs in a temporary file,
    stopped on exit."""
    command = [sys.executable, "-m", "pdserve.cli", "cluster", "--http-port", "0", *shlex.split(flags)]
    log = tempfile.NamedTemporaryFile("w", prefix="pdserve-bench-serve-", suffix=".log", delete=False)
    print(f"bench serve: starting `pdserve cluster {flags}` (its logs: {log.name})", file=sys.stderr, flush=True)
    process = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=log, text=True)
    try:
        assert process.stdout is not None
        deadline = time.monotonic() + CLUSTER_START_S
        while not select.select([process.stdout], [], [], 1.0)[0]:
            if process.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(f"the local cluster did not start (exit code {process.poll()}; see {log.name})")
        line = process.stdout.readline()
        if not line:
            raise RuntimeError(f"the local cluster exited while starting (exit code {process.wait()}; see {log.name})")
        http = json.loads(line)["gateway"].get("http")
        if not http:
            raise RuntimeError("the local cluster serves no HTTP (--http-port -1 in --cluster-args?)")
        yield System("pdserve", f"http://{http}")
    finally:
        process.send_signal(signal.SIGTERM)
        try:
            process.wait(timeout=30)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait()
        log.close()


def run(args: argparse.Namespace) -> int:
    if not args.url and not args.cluster:
        raise SystemExit("pdserve bench serve: give at least one --url, or --cluster")
    systems: list[System | None] = [None] * args.cluster + list(args.url)  # None: the local cluster, started first
    result: dict[str, Any] = {}
    timelines: dict[str, list[list[float]]] = {}
    for system in systems:
        name = system.name if system else "pdserve"
        name = name if name not in result else f"{name}#{len(result) + 1}"
        try:
            with local_cluster(args.cluster_args) if system is None else contextlib.nullcontext(system) as target:
                print(f"bench serve: {name} ({target.url}) for {args.duration:g} s", file=sys.stderr, flush=True)
                # The client's own pauses would count as every system's gaps: a full collection of this process
                # (~190,000 objects once imported) took 73 ms; frozen, it walks only what the run makes.
                memory.freeze_startup_objects()
                records, wall_s, model = asyncio.run(drive(target, args))
        except (OSError, RuntimeError, aiohttp.ClientError, KeyError, IndexError, ValueError) as exc:
            result[name] = {"url": system.url if system else "", "error": f"{type(exc).__name__}: {exc}"}
            print(f"bench serve: {name} failed: {result[name]['error']}", file=sys.stderr, flush=True)
            continue
        result[name] = {"url": target.url, "model": model, **summarize(records, wall_s, args.slo_ttft, args.slo_tpot)}
        timelines[name] = [r.token_times for r in records if r.ok and r.kind == "chat"]
    workload = {key: getattr(args, key) for key in ("api", "duration", "drain_timeout", "chat_streams", "chat_words",
                                                    "chat_tokens", "doc_words", "doc_tokens", "doc_interval", "seed")}
    document = {"workload": workload, "slo": {"ttft_s": args.slo_ttft, "tpot_s": args.slo_tpot}, "systems": result}
    status = publish(args, "serve", result, lambda: _table(result, args), lambda path: plot(result, timelines, path),
                     document)
    return status or int(any("error" in m for m in result.values()))


def _table(result: dict[str, Any], args: argparse.Namespace) -> str:
    lines = [f"{args.chat_streams} chat streams ({args.chat_words} words -> {args.chat_tokens} tokens), a document "
             f"({args.doc_words} words -> {args.doc_tokens} tokens) every {args.doc_interval:g} s, for "
             f"{args.duration:g} s; SLO: TTFT <= {args.slo_ttft:g} s, time per output token <= {args.slo_tpot:g} s",
             f"{'system':<16} {'TTFT p50':>8} {'TTFT p99':>8} {'ITL p50':>8} {'ITL p99':>8} {'ITL max':>8} "
             f"{'chats':>6} {'doc TTFT':>8} {'tok/s':>7} {'goodput':>8} {'in SLO':>7}"]
    for name, m in result.items():
        if "error" in m:
            lines.append(f"{name:<16} {m['error']}")
            continue
        lines.append(f"{name:<16} {m['chat_ttft_p50']:>8.3f} {m['chat_ttft_p99']:>8.3f} {m['chat_itl_p50']:>8.3f} "
                     f"{m['chat_itl_p99']:>8.3f} {m['chat_itl_max']:>8.3f} {m['chats_completed']:>6} "
                     f"{m['doc_ttft_p50']:>8.2f} {m['output_tok_per_s']:>7.1f} {m['goodput_req_per_s']:>8.3f} "
                     f"{m['slo_fraction']:>7.0%}")
        if m["failed"] or m["unfinished"]:
            lines.append(f"{'':<16} {m['failed']} failed, {m['unfinished']} cut off: {'; '.join(m['errors'])}")
    return "\n".join(lines)


def plot(result: dict[str, Any], timelines: dict[str, list[list[float]]], path: Path) -> None:
    """Chat TTFT and ITL p50/p99 per system (left), and each system's CDF of chat ITL (right)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    names = [name for name in result if "error" not in result[name]]
    figure, (bars, cdf) = plt.subplots(1, 2, figsize=(12, 4.5))
    keys = ("chat_ttft_p50", "chat_ttft_p99", "chat_itl_p50", "chat_itl_p99")
    width = 0.8 / max(1, len(names))
    for i, name in enumerate(names):
        bars.bar([k + i * width for k in range(len(keys))], [result[name][key] for key in keys], width, label=name)
        gaps = sorted(b - a for times in timelines[name] for a, b in zip(times, times[1:]))
        cdf.step(gaps, [(j + 1) / len(gaps) for j in range(len(gaps))], where="post", label=name)
    bars.set_xticks([k + width * (len(names) - 1) / 2 for k in range(len(keys))],
                    ["TTFT p50", "TTFT p99", "ITL p50", "ITL p99"])
    bars.set_ylabel("seconds (chat requests)")
    cdf.set_xscale("log")
    cdf.set_xlabel("chat inter-token latency (s)")
    cdf.set_ylabel("fraction of gaps")
    if names:
        bars.legend()
        cdf.legend()
    figure.tight_layout()
    figure.savefig(path, dpi=100)
    plt.close(figure)
