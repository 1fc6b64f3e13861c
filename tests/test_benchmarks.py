"""The benchmarks run end to end and print the JSON the issues specify.

At these tiny sizes on a shared machine no figure is held to a speed. What is checked is what must hold however fast
the machine: counts equal to what was sent, times and rates above zero, and orderings that hold by construction
(a p50 is at most its p99, a p99 at most the maximum, a request's first token no later than its last).
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

PDSERVE = [sys.executable, "-m", "pdserve.cli"]


def _bench(*args: str) -> dict:
    done = subprocess.run([*PDSERVE, "bench", *args, "--json"], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    return json.loads(done.stdout)  # stdout is exactly one JSON object


def test_bench_kv_prints_every_key_and_writes_json_and_plot(tiny_model_dir: Path, tmp_path: Path) -> None:
    result = _bench("kv", "--model", str(tiny_model_dir), "--tokens", "64,128", "--repeats", "1",
                    "--exposed-repeats", "1", "--exposed-tokens", "100", "--out", str(tmp_path))
    for key in ("grpc_gbps", "grpc_ceiling_gbps", "grpc_hot_chunk_gbps", "grpc_prebuilt_gbps", "tcp_gbps", "shm_gbps",
                "shm_copy_gbps", "memcpy_gbps"):
        assert result[key] > 0, key
    cases = result["cases"]
    assert set(cases) == {"64", "128"} and [cases[k]["tokens"] for k in ("64", "128")] == [64, 128]
    assert cases["128"]["kv_bytes"] == 2 * cases["64"]["kv_bytes"] > 0  # KV grows with the tokens, exactly
    assert result["exposed"]["shm"]["transport"] == "shm" and result["exposed"]["grpc"]["transport"] == "grpc"
    assert isinstance(result["exposed_transfer_frac"], float)
    assert json.loads((tmp_path / "kv.json").read_text())["cases"] == result["cases"]
    assert (tmp_path / "kv.png").stat().st_size > 0


def test_bench_decode_reports_step_and_floor(tiny_model_dir: Path, tmp_path: Path) -> None:
    result = _bench("decode", "--model", str(tiny_model_dir), "--batch", "2", "--context", "16", "--steps", "2",
                    "--dtype", "float32", "--out", str(tmp_path))
    assert result["step_ms"] > 0 and result["floor_ms"] > 0 and result["batch"] == 2
    assert [v["runner"] for v in result["variants"]] == ["fast", "hf"] and result["matmul_gflops"] > 0
    for variant in result["variants"]:  # two flops per float32 weight per sequence, and some for attention
        assert variant["gflop_per_step"] * 1e9 > 2 * 2 * variant["weight_bytes"] / 4
        assert variant["compute_floor_ms"] == pytest.approx(variant["gflop_per_step"] / result["matmul_gflops"] * 1e3)
    assert (tmp_path / "decode.json").exists()


def test_bench_decode_times_the_fused_and_the_python_layer_loop_on_one_model(tiny_model_dir: Path,
                                                                             tmp_path: Path) -> None:
    result = _bench("decode", "--model", str(tiny_model_dir), "--batch", "2", "--context", "16", "--steps", "2",
                    "--dtype", "float32", "--runner", "fast", "--layers", "fused,python", "--out", str(tmp_path))
    variants = result["variants"]
    assert [v["layers"] for v in variants] == ["fused", "python"]
    for variant in variants:  # two alternating rounds of 2 timed steps each, and the same greedy picks
        assert len(variant["step_ms_samples"]) == 4 and variant["step_ms"] > 0 and variant["same_tokens"] is True
        assert "tokens" not in variant
    assert result["step_ms"] == variants[0]["step_ms"]


def test_bench_prefill_reports_batching_speedup_and_chunking_cost(tiny_model_dir: Path, tmp_path: Path) -> None:
    result = _bench("prefill", "--model", str(tiny_model_dir), "--lengths", "8,16", "--long", "40", "--chunks",
                    "16", "--repeats", "1", "--out", str(tmp_path))
    assert [row["length"] for row in result["batching"]] == [8, 16]
    assert all(row["speedup"] > 0 for row in result["batching"])
    assert result["long"]["chunked"][0]["chunk"] == 16 and result["long"]["whole_s"] > 0
    assert (tmp_path / "prefill.png").stat().st_size > 0


def test_bench_scenarios_runs_both_modes_and_prints_the_metrics(tiny_model_dir: Path, tmp_path: Path) -> None:
    result = _bench("scenarios", "--model", str(tiny_model_dir), "--scenarios", "smoke,batch_pressure",
                    "--scale", "0.05", "--out", str(tmp_path))
    assert set(result) == {"smoke", "batch_pressure"}
    # At scale 0.05 every request asks for 2 tokens (ignoring eos): smoke sends 4, batch_pressure 12 at once at 8
    # decode slots (the refused ones retry, and all finish).
    sent = {"smoke": 4, "batch_pressure": 12}
    for name, modes in result.items():
        assert set(modes) == {"colocated", "disaggregated"}
        for mode, m in modes.items():
            where = f"{name} {mode}"
            assert m["requests"] == sent[name] and m["generated_tokens"] == 2 * sent[name], where
            assert m["wall_s"] > 0 and m["gen_tok_per_s"] == pytest.approx(m["generated_tokens"] / m["wall_s"]), where
            assert 0 < m["ttft_p50"] <= m["ttft_p99"] <= m["wall_s"], where
            assert m["ttft_p50"] <= m["latency_p50"] and m["latency_p99"] <= m["wall_s"], where
            assert 0 <= m["itl_p50"] <= m["itl_p99"] <= m["itl_max"] <= m["wall_s"], where
    assert (tmp_path / "scenarios.png").stat().st_size > 0


def test_bench_interference_reports_chats_documents_and_goodput(tiny_model_dir: Path, tmp_path: Path) -> None:
    result = _bench("interference", "--model", str(tiny_model_dir), "--duration", "4", "--chat-every", "1",
                    "--doc-every", "2", "--doc-tokens", "200", "--scale", "0.2", "--out", str(tmp_path))
    assert set(result) == {"colocated", "disaggregated"}
    # 4 s of arrivals: a chat every second (4), a document every 2 s from 2 s on (2).
    for mode, m in result.items():
        assert m["chats"] == 4 and 0 <= m["chats_within_slo"] <= 4 and m["slo"] == {"ttft_s": 2.0, "tpot_s": 0.2}
        assert m["wall_s"] > 0 and m["gen_tok_per_s"] > 0, mode
        assert 0 < m["ttft_p50"] <= m["ttft_p99"] <= m["wall_s"] and 0 < m["doc_ttft_p50"] <= m["wall_s"], mode
        assert 0 <= m["itl_p50"] <= m["itl_p99"] <= m["itl_max"] <= m["wall_s"], mode
        assert m["goodput"] == pytest.approx(m["chats_within_slo"] / m["wall_s"]), mode
    assert (tmp_path / "interference.png").stat().st_size > 0


def test_bench_chaos_runs_every_experiment_and_reports_ok(tiny_model_dir: Path, tmp_path: Path) -> None:
    result = _bench("chaos", "--model", str(tiny_model_dir), "--cancels", "20", "--streams", "4", "--max-tokens", "8",
                    "--storm", "40", "--out", str(tmp_path))
    assert set(result) == {"cancel_storm", "storm", "kill_decode", "kill_prefill", "link_fault", "overload"}
    # the storm's requests end OK, cancelled by their client, or refused before they started: nothing else
    assert result["storm"]["unexpected_statuses"] == [] and "unexpected" not in result["storm"]
    assert sum(v for k, v in result["storm"].items() if k in ("finished", "cancelled_mid_stream",
               "cancelled_before_first_token", "refused_before_start")) == 40
    assert all(isinstance(r["ok"], bool) for r in result.values())
    storm, kill_decode, kill_prefill = result["cancel_storm"], result["kill_decode"], result["kill_prefill"]
    # every request of the storm ended one of three ways
    assert storm["requests"] == 20 == (storm["finished_first"] + storm["cancelled_mid_stream"]
                                       + storm["cancelled_before_first_token"])
    # a killed worker's requests are retried or migrated, and all complete (deadlines of 300 s: not a speed)
    assert kill_decode["streams"] == 4 == kill_decode["completed"] and kill_decode["identical"] <= 4
    assert kill_prefill["requests"] == 4 == kill_prefill["completed"]
    assert sum(result["link_fault"]["statuses"].values()) == result["link_fault"]["requests"] == 4
    assert result["overload"]["admitted"] > 0  # the flood's first requests get places
    assert result["overload"]["refused"] > 0  # the flood is 10x what the tiny cluster serves
    assert json.loads((tmp_path / "chaos.json").read_text()) == result


def test_bench_prefix_reports_both_modes_and_the_cache_is_used(tiny_model_dir: Path, tmp_path: Path) -> None:
    result = _bench("prefix", "--model", str(tiny_model_dir), "--system", "64", "--question", "8", "--requests", "4",
                    "--conversations", "2", "--turns", "2", "--reply", "4", "--out", str(tmp_path))
    for workload in (result, result["multi_turn"]):
        for mode in ("off", "on"):
            assert {"ttft_p50", "ttft_p99", "prefill_tokens"} <= set(workload[mode])
        assert workload["off"]["cached_tokens"] == 0 and workload["on"]["cached_tokens"] > 0
    # Deterministic counts (no timing is checked): 4 prompts of 72 tokens; with the cache, 64 of each of the
    # last three come from it (the 8-token question runs).
    assert result["off"]["prefill_tokens"] == 4 * 72 and result["on"]["prefill_tokens"] == 72 + 3 * 8
    assert json.loads((tmp_path / "prefix.json").read_text()) == result and (tmp_path / "prefix.png").exists()


def test_bench_hostile_runs_the_corpus_beside_a_bystander_and_drains(tiny_model_dir: Path, tmp_path: Path) -> None:
    done = subprocess.run([*PDSERVE, "bench", "hostile", "--model", str(tiny_model_dir), "--rounds", "1", "--tokens",
                           "40", "--json", "--out", str(tmp_path)], capture_output=True, text=True, timeout=300)
    result = json.loads(done.stdout)
    verdict = result["verdict"]
    # the ratios are not held here (a shared machine); the exit status follows the verdict
    assert done.returncode == (0 if verdict["ok"] else 1), done.stderr[-2000:]
    assert verdict["no_unexpected_statuses"] and result["corpus"]["unexpected"] == []
    assert verdict["live_gauges_zero"] and result["drain"]["held"] == {}
    corpus = result["corpus"]
    assert set(corpus["kinds_refused"]).isdisjoint(corpus["kinds_served"]) and len(corpus["kinds_refused"]) >= 30
    for side in ("refused", "all"):
        outcomes = corpus["outcomes"][side]
        assert sum(n for statuses in outcomes.values() for n in statuses.values()) == corpus["requests"][side] > 0
    refused_statuses = {status for statuses in corpus["outcomes"]["refused"].values() for status in statuses}
    assert not refused_statuses & {"OK", "HTTP 200", "HTTP 500", "UNKNOWN", "INTERNAL"}, refused_statuses
    for side in ("alone", "refused", "all"):  # a tiny model's stream can come in one response: no gaps, no figures
        stats = result["bystander"][side]
        assert 0 <= stats["gaps"] <= 39
        if stats["gaps"]:
            assert stats["itl_p50_ms"] <= stats["itl_p99_ms"] <= stats["itl_max_ms"]
        else:
            assert stats["itl_p99_ms"] is None and result["bystander"]["p99_ratio"].get(side) is None
            assert result["bystander"]["max_ratio"].get(side) is None
    assert "max_ratio_beside_whole_corpus_within_target" in verdict
    assert (tmp_path / "hostile.json").exists()


def test_bench_abuse_runs_every_phase_and_the_defences_hold(long_tiny_model_dir: Path, tmp_path: Path) -> None:
    """The defences' outcomes, not their latency ratios (a shared machine): the stuck readers are cut while their
    sockets are open and everything they held is freed, the flooder is refused with a retry hint, no big prompt
    gets a 5xx, another key is told nothing of the victim's cached prompt, bad keys get 401 / UNAUTHENTICATED."""
    done = subprocess.run([*PDSERVE, "bench", "abuse", "--model", str(long_tiny_model_dir), "--stuck", "2",
                           "--stuck-rcvbuf", "4096", "--rounds", "3", "--alone", "3", "--tokens", "16",
                           "--client-stall-timeout", "5", "--phase-timeout", "120", "--json", "--out", str(tmp_path)],
                          capture_output=True, text=True, timeout=900)
    result = json.loads(done.stdout)
    assert done.returncode == (0 if result["verdict"]["ok"] else 1), done.stderr[-2000:]
    phases, checks = result["phases"], result["checks"]
    assert list(phases) == ["alone", "stuck", "flood", "big_prompts", "lone_bytes", "cache_probe", "bad_headers"]
    assert all("error" not in phase for phase in phases.values()), {k: v.get("error") for k, v in phases.items()}
    assert all(set(c) == {"phase", "name", "value", "target", "ok", "limit"} for c in checks)
    assert sorted(f"{c['phase']}: {c['name']}" for c in checks if not c["ok"]) == sorted(result["verdict"]["failed"])
    # 1. the reference
    assert phases["alone"]["requests"] == 3 and phases["alone"]["ttft_p50_ms"] <= phases["alone"]["ttft_p99_ms"]
    # 2. both stuck readers cut while their sockets were open; the gateway closed them; nothing held
    stuck = phases["stuck"]
    assert len(stuck["unread_bytes"]) == len(stuck["receive_buffers"]) == 2 and min(stuck["unread_bytes"]) > 0
    assert stuck["stalls_counted"] >= 2 and stuck["live_requests"] == 0 and stuck["all_cut_s"] is not None
    assert stuck["closed_by_gateway"] == 2 and stuck["streams_complete"] == 0  # cut: none got its whole stream
    assert phases["alone"]["bystander_failures"] == stuck["bystander_failures"] == []
    for phase in ("stuck", "flood", "big_prompts"):
        assert phases[phase]["held"] == {} and phases[phase]["drained_s"] is not None, phase
    # 3. the flooder is held to its caps: refused at once, every refusal with its retry hint
    flood = phases["flood"]["flood"]
    assert flood["refusals"]["count"] > 0 and flood["refusals"]["with_retry_after_ms"] == flood["refusals"]["count"]
    assert set(flood["statuses"]) <= {"OK", "RESOURCE_EXHAUSTED", "CANCELLED (the phase ended)"}, flood["statuses"]
    # 4. every big prompt answered 400 (tokenized, too long) or 429 (over the key's caps); never a 5xx
    big = phases["big_prompts"]["big_prompts"]
    assert big["chars"] > 0 and sum(big["statuses"].values()) == big["sent"] > 0
    assert set(big["statuses"]) <= {"HTTP 400", "HTTP 429"} and big["statuses"].get("HTTP 400", 0) > 0
    # 5. both streams timed
    assert phases["lone_bytes"]["lone_byte_ms"] > 0 and phases["lone_bytes"]["ascii_ms"] > 0
    # 6. the victim hits its own cache; the prober is told nothing
    probe = phases["cache_probe"]
    assert probe["victim_cached_tokens"][0] == 0 and probe["victim_cached_tokens"][1] > 0
    assert probe["prober_cached_tokens"] == 0
    # 7. bad Authorization headers
    answers = phases["bad_headers"]["answers"]
    assert [answers[f"HTTP {name}"] for name in ("not UTF-8", "4 KiB bearer", "empty bearer")] == ["HTTP 401"] * 3
    assert answers["HTTP past the parser's line limit"] in ("HTTP 400", "HTTP 431")
    assert answers["gRPC empty bearer"] == answers["gRPC unknown key"] == "UNAUTHENTICATED"
    assert json.loads((tmp_path / "abuse.json").read_text()) == result and (tmp_path / "abuse.png").stat().st_size > 0
