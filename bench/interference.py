"""`pdserve bench interference`: steady chat streams while long documents arrive, colocated against disaggregated.

Short chat requests arrive at a steady rate. Every few seconds, a ~1,500-token document prompt arrives too.
Colocated, each document is prefilled between the chats' decode steps and stalls them. Disaggregated, it runs
on the prefill worker. Per mode this reports the chats' ITL (p50, p99, max) and TTFT (p50, p99), the
documents' TTFT, throughput, and goodput: chat requests per second that met both SLOs (TTFT and time per
output token), which are reported with it.
"""

from __future__ import annotations

import argparse
import asyncio
import sys
from typing import Any

from bench.report import publish
from bench.scenarios import Request, add_mode_args, drive, metrics, percentile, plot, scaled, start_mode
from model_runner.loading import resolve_model


def add_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--duration", type=float, default=30.0, help="seconds of arrivals (default: %(default)s)")
    parser.add_argument("--chat-every", type=float, default=1.5, help="seconds between chat arrivals")
    parser.add_argument("--doc-every", type=float, default=8.0, help="seconds between document arrivals")
    parser.add_argument("--doc-tokens", type=int, default=1500, help="document prompt length")
    parser.add_argument("--slo-ttft", type=float, default=2.0, help="chat TTFT SLO, seconds (default: 2.0)")
    parser.add_argument("--slo-tpot", type=float, default=0.2,
                        help="chat time per output token SLO, seconds (default: 0.2)")
    add_mode_args(parser, "interference")
    # 8 slots made the colocated baseline refuse chats (its sequences live longer), inflating its TTFT p99 to
    # 11 s; with 16 it never ran out. Both modes get the same.
    parser.set_defaults(max_seqs=16)


def workload(args: argparse.Namespace) -> tuple[list[Request], list[bool]]:
    """The requests in arrival order, and which of them are chats."""
    chats = [Request(t * args.chat_every, scaled(64, args.scale), scaled(48, args.scale))
             for t in range(int(args.duration / args.chat_every))]
    docs = [Request(2.0 + t * args.doc_every, scaled(args.doc_tokens, args.scale), scaled(8, args.scale))
            for t in range(int((args.duration - 2.0) / args.doc_every) + 1)]
    tagged = sorted([(r, True) for r in chats] + [(r, False) for r in docs], key=lambda pair: pair[0].at_s)
    return [r for r, _ in tagged], [chat for _, chat in tagged]


def run(args: argparse.Namespace) -> int:
    model_dir = resolve_model(args.model)
    requests, is_chat = workload(args)
    result: dict[str, Any] = {}
    timelines: dict[str, list[list[float]]] = {}
    for mode in args.modes:
        cluster = start_mode(mode, model_dir, args)
        try:
            records = asyncio.run(drive(cluster.gateway.address, requests))
        finally:
            cluster.stop()
        timelines[mode] = [r.token_times for r in records]
        chats = [r for r, chat in zip(records, is_chat) if chat]
        docs = [r for r, chat in zip(records, is_chat) if not chat]
        overall = metrics(records)
        chat = metrics(chats)
        met = [r for r in chats if r.token_times[0] <= args.slo_ttft
               and (r.token_times[-1] - r.token_times[0]) / max(1, len(r.token_times) - 1) <= args.slo_tpot]
        result[mode] = {
            "wall_s": overall["wall_s"], "gen_tok_per_s": overall["gen_tok_per_s"],
            "ttft_p50": chat["ttft_p50"], "ttft_p99": chat["ttft_p99"],
            "itl_p50": chat["itl_p50"], "itl_p99": chat["itl_p99"], "itl_max": chat["itl_max"],
            "doc_ttft_p50": percentile([r.token_times[0] for r in docs], 50),
            "goodput": len(met) / overall["wall_s"], "chats_within_slo": len(met), "chats": len(chats),
            "slo": {"ttft_s": args.slo_ttft, "tpot_s": args.slo_tpot}, "colocate_below": args.colocate_below,
        }
        print(f"bench interference: {mode} done", file=sys.stderr, flush=True)
    return publish(args, "interference", result, lambda: _table(result),
                   lambda path: plot({"interference": result}, {"interference": timelines}, path))


def _table(result: dict[str, Any]) -> str:
    slo = next(iter(result.values()))["slo"]
    lines = [f"chat SLO: TTFT <= {slo['ttft_s']} s and time per output token <= {slo['tpot_s']} s",
             f"{'mode':<14} {'ITL p50':>8} {'ITL p99':>8} {'ITL max':>8} {'TTFT p50':>9} {'TTFT p99':>9} "
             f"{'doc TTFT':>9} {'tok/s':>7} {'goodput':>8} {'in SLO':>7}"]
    for mode, m in result.items():
        lines.append(f"{mode:<14} {m['itl_p50']:>8.3f} {m['itl_p99']:>8.3f} {m['itl_max']:>8.3f} "
                     f"{m['ttft_p50']:>9.3f} {m['ttft_p99']:>9.3f} {m['doc_ttft_p50']:>9.2f} "
                     f"{m['gen_tok_per_s']:>7.1f} {m['goodput']:>8.3f} {m['chats_within_slo']:>3}/{m['chats']:<3}")
    return "\n".join(lines)
