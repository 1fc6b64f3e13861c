"""The `pdserve` command: run a local cluster, or stream a completion from a running gateway.

It starts fast: `pdserve health` is the containers' health probe, under Kubernetes' 1 s default timeout. Only argparse
and what builds the parser load up front (no torch, no transformers, no benchmark); each command imports what it runs.
tests/test_cli_startup.py keeps it so.
"""

from __future__ import annotations

import argparse
import importlib
import json
import os
import sys
import time

import grpc

from pdserve.cluster_config import ClusterConfig
from serving import tls
from serving.settings import ROLES, add_settings, config_class_of, read_settings

DEFAULT_TRACE_DIR = ".pdserve/traces"
DEMO_PROMPT = "<|im_start|>user\nExplain in two sentences why the sky is blue.<|im_end|>\n<|im_start|>assistant\n"


# benchmark (its module under bench/) -> summary; a module is imported only when its benchmark is the command
BENCHES = {
    "kv": "KV transfer: gRPC and shared-memory paths against their ceilings",
    "decode": "the decode step against its memory-bandwidth floor",
    "gemm": "the GEMM kernels the fast runner could call, at the default model's shapes",
    "prefill": "batched and chunked prefill against one prompt at a time",
    "scenarios": "six workloads, colocated against disaggregated",
    "interference": "chat streams while long documents arrive",
    "chaos": "cancel storms, killed workers, broken links and overload",
    "prefix": "a shared system prompt and multi-turn chats, prefix cache off and on",
    "serve": "chats and documents through OpenAI-compatible servers (pdserve, vLLM, llama.cpp)",
    "soak": "a long mixed load with cancels and hostile requests; RSS, fds and live gauges",
    "hostile": "a bystander stream's pace while the hostile corpus runs beside it",
    "abuse": "the tenancy defences: stuck readers, a flooding key, big prompts, cache probes, bad headers",
}


def main(argv: list[str] | None = None) -> None:
    argv = sys.argv[1:] if argv is None else argv
    parser = build_parser(argv)
    args = parser.parse_args(argv)
    sys.exit(args.run(args, parser))


def build_parser(argv: list[str]) -> argparse.ArgumentParser:
    """Every command's flags (a benchmark's only when `argv` names it)."""
    parser = argparse.ArgumentParser(prog="pdserve", description="Disaggregated LLM serving: prefill and decode as "
                                     "separate gRPC services, the KV cache streamed between them.")
    commands = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    _add_cluster(commands)
    _add_client_commands(commands)
    _add_trace_and_health(commands)
    _add_config(commands)
    _add_bench(commands, argv)
    return parser


def _add_cluster(commands: argparse._SubParsersAction) -> None:
    cluster = commands.add_parser("cluster", help="start a gateway, prefill and decode workers on this host",
                                  description="Start a gateway, --prefill N and --decode M workers as local processes, "
                                  "wait until all are healthy, print one JSON line with their addresses and pids, "
                                  "and serve until SIGINT/SIGTERM.")
    add_settings(cluster, ClusterConfig)
    cluster.add_argument("--demo", nargs="?", const=DEMO_PROMPT, default=None, metavar="PROMPT",
                         help="once healthy, stream one completion with its timing breakdown")
    cluster.set_defaults(run=_cluster)


def _add_client_commands(commands: argparse._SubParsersAction) -> None:
    client = argparse.ArgumentParser(add_help=False)  # what `generate` and `chat` share
    client.add_argument("--address", default="127.0.0.1:50051", help="gateway host:port (default: %(default)s)")
    client.add_argument("--api-key", default=os.environ.get("PDSERVE_API_KEY", ""),
                        help="sent as `authorization: Bearer KEY` (default: $PDSERVE_API_KEY)")
    client.add_argument("--max-tokens", type=int, default=None, help="default: 128, or what the context leaves")
    client.add_argument("--temperature", type=float, default=None, help="0 = greedy (default: 1)")
    client.add_argument("--top-p", type=float, default=None)
    client.add_argument("--seed", type=int, default=None)
    client.add_argument("--stop", action="append", default=[], help="stop string (repeatable)")
    client.add_argument("--timeout", type=float, default=None, help="deadline in seconds, per request")
    tls.add_args(client, "the client's")

    generate = commands.add_parser("generate", parents=[client], help="stream a completion from a running gateway",
                                   description="Stream a completion for PROMPT from a gateway to the terminal "
                                   "(the timing breakdown goes to stderr).")
    generate.add_argument("prompt")
    generate.add_argument("--json", action="store_true", help="print one JSON object instead of streaming text")
    generate.set_defaults(run=_generate)

    chat = commands.add_parser("chat", parents=[client], help="talk to the model, streaming, with its chat template",
                               description="An interactive conversation with a running gateway: each line you type "
                               "is a user turn; the reply streams back, and the whole conversation is sent each turn "
                               "(the gateway applies the model's chat template). /reset starts over; an empty "
                               "line, Ctrl-D or Ctrl-C ends it.")
    chat.add_argument("--system", default="", help="a system message that opens the conversation")
    chat.set_defaults(run=_chat)


def _add_config(commands: argparse._SubParsersAction) -> None:
    config = commands.add_parser("config", help="what a service would run with, and where each value came from")
    actions = config.add_subparsers(dest="action", required=True, metavar="ACTION")
    show = actions.add_parser(
        "show", help="print every setting ROLE would start with",
        description="Print every setting ROLE would start with, given FLAGS (its own flags, --config FILE among "
        "them) and the PDSERVE_<FLAG> environment variables, and where each value came from: default, file, env or "
        "flag. Exits 2, naming the setting, where the service would refuse to start.")
    show.add_argument("--json", action="store_true", help="one JSON object: setting -> {value, source}")
    show.add_argument("role", choices=sorted(ROLES))
    show.add_argument("flags", nargs=argparse.REMAINDER, metavar="FLAGS", help="the service's own flags")
    show.set_defaults(run=_config_show)


def _config_show(args: argparse.Namespace, parser: argparse.ArgumentParser) -> int:
    from serving.server import parse_config

    config_class = config_class_of(args.role)
    sources: dict[str, str] = {}
    values: dict[str, object] = {}
    # exits 2, naming the setting, where the service would refuse to start
    parse_config(f"pdserve config show {args.role}", None, config_class, args.flags, sources, values)
    if args.json:
        print(json.dumps({dest: {"value": values[dest], "source": sources[dest]} for dest in sorted(values)}))
        return 0
    width = max(map(len, values))
    for dest in sorted(values):
        print(f"{dest:<{width}}  {values[dest]!s:<24}  {sources[dest]}")
    return 0


def _add_trace_and_health(commands: argparse._SubParsersAction) -> None:
    trace = commands.add_parser("trace", help="a request's spans as a terminal waterfall, from a local capture",
                                description="Print the span tree of REQUEST_ID's trace (gateway, queue, prefill, "
                                "KV send and receive, decode admission and steps) with durations, read from the "
                                "capture `pdserve cluster --trace-dir DIR` writes.")
    trace.add_argument("request_id", metavar="REQUEST_ID")
    trace.add_argument("--dir", default=os.environ.get("PDSERVE_TRACE_DIR", DEFAULT_TRACE_DIR),
                       help="the capture directory (default: $PDSERVE_TRACE_DIR or %(default)s)")
    trace.add_argument("--all", action="store_true", help="every decode step, not a summary of long runs")
    trace.set_defaults(run=_trace)

    health = commands.add_parser("health", help="exit 0 if a service reports SERVING (a container health check)",
                                 description="Ask ADDRESS's grpc.health.v1 service for its status: exit 0 when "
                                 "SERVING, 1 otherwise (not serving, unreachable, or no answer within --timeout).")
    health.add_argument("address", metavar="ADDRESS", help="host:port of any pdserve service")
    health.add_argument("--timeout", type=float, default=3.0, help="seconds (default: %(default)s)")
    tls.add_args(health, "the probe's")
    health.set_defaults(run=_health)


def _add_bench(commands: argparse._SubParsersAction, argv: list[str]) -> None:
    """Every benchmark is listed; only the one named on the command line is imported, to add its flags."""
    bench = commands.add_parser("bench", help="benchmarks; results as a table or JSON, plus JSON and plots on disk")
    benches = bench.add_subparsers(dest="bench", required=True, metavar="BENCH")
    chosen = argv[1] if len(argv) > 1 and argv[0] == "bench" else None
    for name, summary in BENCHES.items():
        sub = benches.add_parser(name, help=summary)
        if name == chosen:
            module = importlib.import_module(f"bench.{name}")
            sub.description = (module.__doc__ or "").split("\n\n")[0]
            module.add_args(sub)
            sub.set_defaults(run=lambda args, _parser, module=module: module.run(args))


def cluster_config(args: argparse.Namespace) -> ClusterConfig:
    """`pdserve cluster`'s flags as a ClusterConfig."""
    return read_settings(ClusterConfig, args)  # type: ignore[no-any-return]


def _cluster(args: argparse.Namespace, parser: argparse.ArgumentParser) -> int:
    from pdserve.cluster import serve_until_signal, start

    try:
        config = cluster_config(args)
    except ValueError as exc:
        parser.error(str(exc))
    cluster = start(config)
    print(json.dumps(cluster.summary()), flush=True)
    if args.demo:
        print(f"demo prompt: {args.demo!r}", file=sys.stderr, flush=True)
        _stream_to_terminal(cluster.gateway.address, {"prompt": args.demo, "max_tokens": 64, "temperature": 0.0,
                                                      "request_id": "demo"})
        if args.trace_dir:
            _print_trace("demo", args.trace_dir)
        hints = [f"pdserve chat --address {cluster.gateway.address}"]
        if cluster.gateway.http:
            hints.append(f"curl http://{cluster.gateway.http}/v1/chat/completions -H 'Content-Type: "
                         "application/json' -d '{\"messages\": [{\"role\": \"user\", \"content\": \"Hello\"}]}'")
        print("serving (Ctrl-C stops); try:\n  " + "\n  ".join(hints), file=sys.stderr, flush=True)
    serve_until_signal(cluster)
    return 0


def _print_trace(request_id: str, directory: str) -> None:
    """The demo's waterfall, once every process has written its spans (they are batched)."""
    from pathlib import Path

    from pdserve import waterfall

    deadline = time.monotonic() + 5
    while True:
        spans = waterfall.find_trace(waterfall.load(Path(directory)), request_id)
        if {"decode.step", "kv.receive", "gateway"} <= {s.name for s in spans} or time.monotonic() > deadline:
            break
        time.sleep(0.2)
    if spans:
        print(f"\n$ pdserve trace {request_id} --dir {directory}\n{waterfall.render(spans, request_id)}\n",
              file=sys.stderr, flush=True)


def _identity(args: argparse.Namespace, parser: argparse.ArgumentParser) -> tls.TLS | None:
    """The client certificate the --tls-* flags name, if any; a bad one is a usage error."""
    try:
        return tls.from_args(args)
    except ValueError as exc:
        parser.error(str(exc))


def _health(args: argparse.Namespace, parser: argparse.ArgumentParser) -> int:
    from grpc_health.v1 import health_pb2, health_pb2_grpc

    with tls.channel(args.address, _identity(args, parser)) as channel:
        try:
            reply = health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(), timeout=args.timeout)
        except grpc.RpcError as exc:
            print(f"{args.address}: {exc.code().name}", file=sys.stderr)  # type: ignore[attr-defined]
            return 1
    status = health_pb2.HealthCheckResponse.ServingStatus.Name(reply.status)
    print(f"{args.address}: {status}")
    return 0 if reply.status == health_pb2.HealthCheckResponse.SERVING else 1


def _trace(args: argparse.Namespace, parser: argparse.ArgumentParser) -> int:
    from pathlib import Path

    from pdserve import waterfall

    return waterfall.main(args.request_id, Path(args.dir), args.all)


def _sampling(args: argparse.Namespace) -> dict[str, object]:
    fields: dict[str, object] = {"stop": args.stop}
    for name in ("max_tokens", "temperature", "top_p", "seed"):
        if getattr(args, name) is not None:
            fields[name] = getattr(args, name)
    return fields


def _chat(args: argparse.Namespace, parser: argparse.ArgumentParser) -> int:
    from pdserve.client import stream

    identity = _identity(args, parser)
    opening = [{"role": "system", "content": args.system}] if args.system else []
    messages = list(opening)
    interactive = sys.stdin.isatty()
    while True:
        try:
            line = input("you> " if interactive else "")
        except (EOFError, KeyboardInterrupt):
            break
        if not line.strip():
            break
        if line.strip() == "/reset":
            messages = list(opening)
            continue
        messages.append({"role": "user", "content": line})
        reply = []
        try:
            for response in stream(args.address, args.timeout, args.api_key, identity, messages=messages,
                                   **_sampling(args)):
                sys.stdout.write(response.text)
                sys.stdout.flush()
                reply.append(response.text)
        except KeyboardInterrupt:  # stops this reply (leaving the stream cancels it); the conversation goes on
            print(" [interrupted]")
        except grpc.RpcError as exc:
            print(f"pdserve chat: {exc.code().name}: {exc.details()}", file=sys.stderr)  # type: ignore[attr-defined]
            return 1
        print()
        messages.append({"role": "assistant", "content": "".join(reply)})
    return 0


def _generate(args: argparse.Namespace, parser: argparse.ArgumentParser) -> int:
    fields = {"prompt": args.prompt, **_sampling(args)}
    try:
        if args.json:
            from pdserve.client import generate

            completion = generate(args.address, args.timeout, args.api_key, _identity(args, parser), **fields)
            print(json.dumps({"request_id": completion.request_id, "text": completion.text,
                              "token_ids": completion.token_ids, "finish_reason": completion.finish_reason,
                              "usage": {"prompt_tokens": completion.usage.prompt_tokens,
                                        "completion_tokens": completion.usage.completion_tokens}
                              if completion.usage else None}))
        else:
            _stream_to_terminal(args.address, fields, args.timeout, args.api_key, _identity(args, parser))
    except grpc.RpcError as exc:
        print(f"pdserve generate: {exc.code().name}: {exc.details()}", file=sys.stderr)  # type: ignore[attr-defined]
        return 1
    return 0


def _stream_to_terminal(address: str, fields: dict[str, object], timeout: float | None = None,
                        api_key: str = "", identity: tls.TLS | None = None) -> None:
    from pdserve.client import stream

    for response in stream(address, timeout, api_key, identity, **fields):
        sys.stdout.write(response.text)
        sys.stdout.flush()
        if response.finish_reason:
            t, u = response.timing, response.usage
            print(f"\n[{response.finish_reason}] {u.prompt_tokens} prompt + {u.completion_tokens} generated tokens | "
                  f"TTFT {t.ttft_ms:.0f} ms (reserve {t.reserve_ms:.1f}, prefill queue {t.prefill_queue_ms:.1f}, "
                  f"prefill {t.prefill_ms:.0f}) | KV {t.kv_bytes / 1e6:.2f} MB in {t.kv_transfer_ms:.1f} ms "
                  f"({t.kv_exposed_ms:.1f} ms exposed) | decode {t.decode_tokens_per_s:.1f} tok/s | "
                  f"total {t.total_ms:.0f} ms", file=sys.stderr, flush=True)


if __name__ == "__main__":
    main()
