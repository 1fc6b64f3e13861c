"""`pdserve bench serve`: its SSE parsing and metrics on synthetic timings, then short runs against real clusters."""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
from pathlib import Path

import pytest

from bench.serve import Record, SSEParser, System, on_event, parse_url, prompt, summarize
from pdserve.cluster import Cluster


def test_sse_parser_joins_events_split_anywhere() -> None:
    stream = ('data: {"a": 1}\r\n\r\n: a comment\n\nevent: x\ndata: line one\ndata:line two\n\n'
              'data: {"t": "é"}\n\ndata: [DONE]\n\n').encode()
    for step in (1, 3, len(stream)):  # byte by byte splits "é" across two feeds
        parser = SSEParser()
        events = [e for i in range(0, len(stream), step) for e in parser.feed(stream[i : i + step])]
        assert events == ['{"a": 1}', "line one\nline two", '{"t": "é"}', "[DONE]"]
    assert SSEParser().feed(b"data: no blank line yet\n") == []


def test_on_event_counts_token_chunks_and_reads_usage_and_errors() -> None:
    record = Record("chat")
    on_event(record, '{"choices": [{"delta": {"role": "assistant", "content": ""}}]}', 0.1)  # chat's opening
    on_event(record, '{"choices": [{"text": "Hello", "finish_reason": null}], "usage": null}', 0.2)
    on_event(record, '{"choices": [{"delta": {"content": ""}, "finish_reason": null}]}', 0.3)  # a special token
    on_event(record, '{"choices": [{"delta": {"content": " there"}, "finish_reason": null}]}', 0.35)
    on_event(record, '{"choices": [{"text": "", "finish_reason": "length"}]}', 0.4)  # the token that ended it
    on_event(record, '{"choices": [], "usage": {"prompt_tokens": 7, "completion_tokens": 5}}', 0.4)
    on_event(record, "[DONE]", 0.4)
    assert record.token_times == [0.2, 0.3, 0.35, 0.4] and record.done and record.ok
    assert (record.usage_tokens, record.prompt_tokens, record.output_tokens) == (5, 7, 5)
    assert record.tpot == pytest.approx(0.2 / 4)  # four gaps' worth of tokens by usage

    failed = Record("doc")
    on_event(failed, '{"error": {"message": "overloaded", "code": 503}}', 0.5)
    on_event(failed, "[DONE]", 0.5)
    assert failed.error == "overloaded" and not failed.ok


def _record(kind: str, times: list[float], usage: int | None = None, error: str = "", done: bool = True) -> Record:
    return Record(kind, token_times=times, usage_tokens=usage, done=done, error=error)


def test_summary_percentiles_goodput_and_slo_misses() -> None:
    records = [
        _record("chat", [0.2, 0.25, 0.30, 0.35]),  # in SLO: TTFT 0.2, 0.05 s per token
        _record("chat", [1.5, 1.55, 1.60, 1.65]),  # misses: TTFT 1.5 > 1
        _record("chat", [0.1, 0.4, 0.7, 1.0]),  # misses: 0.3 s per token > 0.1
        _record("chat", [0.3, 0.32], usage=5),  # two chunks of 5 tokens: 0.02 / 4 s per token, in SLO
        _record("doc", [0.8, 0.9]),  # in SLO
        _record("doc", [], error="HTTP 503: busy"),  # failed: counts against the SLO fraction
        _record("chat", [0.2], done=False),  # cut off by the drain timeout: counted nowhere
    ]
    m = summarize(records, wall_s=4.0, slo_ttft=1.0, slo_tpot=0.1)
    assert (m["chats_completed"], m["docs_completed"], m["failed"], m["unfinished"]) == (4, 1, 1, 1)
    assert (m["in_slo"], m["chats_in_slo"], m["docs_in_slo"]) == (3, 2, 1)
    assert m["goodput_req_per_s"] == pytest.approx(3 / 4.0)
    assert m["slo_fraction"] == pytest.approx(3 / 6)
    assert m["chat_ttft_p50"] == pytest.approx(0.25)  # median of 0.1, 0.2, 0.3, 1.5
    assert m["chat_itl_max"] == pytest.approx(0.3)
    itls = sorted([0.05] * 6 + [0.3] * 3 + [0.02])
    assert m["chat_itl_p50"] == pytest.approx((itls[4] + itls[5]) / 2)
    assert m["chat_itl_p99"] == pytest.approx(0.3)
    assert m["doc_ttft_p50"] == pytest.approx(0.8)
    assert m["output_tokens"] == 4 + 4 + 4 + 5 + 2 and m["output_tok_per_s"] == pytest.approx(19 / 4.0)
    assert m["errors"] == ["HTTP 503: busy"] and not m["usage_reported"]

    # a stricter SLO fails everything; no requests at all is no goodput, not a division by zero
    assert summarize(records, 4.0, slo_ttft=0.01, slo_tpot=0.1)["in_slo"] == 0
    assert summarize([], 1.0, 1.0, 0.1)["slo_fraction"] == 0.0


def test_urls_names_and_prompts() -> None:
    assert parse_url("vllm=http://127.0.0.1:8101/v1/") == System("vllm", "http://127.0.0.1:8101")
    assert parse_url("127.0.0.1:8102") == System("127.0.0.1:8102", "http://127.0.0.1:8102")
    with pytest.raises(argparse.ArgumentTypeError):
        parse_url("x=ftp://host")
    a, b = prompt(0, "chat:0:0", 60, "n-1:"), prompt(0, "chat:0:0", 60, "n-2:")
    assert a.startswith("n-1: ") and a[4:] == b[4:] and len(a.split()) == 61  # the same words each run
    assert prompt(0, "chat:0:1", 60, "n-1:") != a and prompt(1, "chat:0:0", 60, "n-1:") != a


def test_bench_serve_against_real_clusters(tiny_cluster: Cluster, tiny_model_dir: Path, tmp_path: Path) -> None:
    """One --url (the session's cluster) and --cluster (a second one it starts and stops), a few seconds each."""
    duration = 3.0
    command = [sys.executable, "-m", "pdserve.cli", "bench", "serve", "--url", f"tiny=http://{tiny_cluster.gateway.http}",
               "--cluster", "--cluster-args", f"--model {tiny_model_dir} --prefill 1 --decode 1 --threads 1",
               "--duration", str(duration), "--chat-streams", "2", "--chat-words", "12", "--chat-tokens", "8",
               "--doc-words", "120", "--doc-tokens", "4", "--doc-interval", "1", "--drain-timeout", "60",
               "--out", str(tmp_path), "--json"]
    done = subprocess.run(command, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    result = json.loads(done.stdout)
    assert list(result) == ["pdserve", "tiny"]  # the local cluster runs first
    for name, m in result.items():
        assert m["chats_completed"] > 0 and m["docs_completed"] == 3, name  # documents at 0.5, 1.5 and 2.5 s
        assert (m["failed"], m["unfinished"]) == (0, 0), m["errors"]
        assert m["chat_ttft_p50"] > 0 and m["chat_ttft_p99"] >= m["chat_ttft_p50"] and m["doc_ttft_p50"] > 0
        assert 0 < m["chat_itl_p50"] <= m["chat_itl_p99"] <= m["chat_itl_max"]
        completed = m["chats_completed"] + m["docs_completed"]
        assert 0 <= m["goodput_req_per_s"] <= completed / duration and 0 <= m["slo_fraction"] <= 1
        assert m["usage_reported"] and m["output_tokens"] == 8 * m["chats_completed"] + 4 * 3  # ignore_eos held
        assert m["output_tok_per_s"] > 0 and m["doc_prompt_tokens"] > 120
    document = json.loads((tmp_path / "serve.json").read_text())
    assert document["systems"] == result and document["slo"] == {"ttft_s": 1.0, "tpot_s": 0.1}
    assert (tmp_path / "serve.png").stat().st_size > 0
