"""`pdserve bench soak` for 20 s on the tiny model: the report's samples, statuses and gauges are real."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from bench.soak import KINDS

DURATION_S = 20


@pytest.fixture(scope="module")
def soak(tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> tuple[dict[str, Any], int, Path]:
    out = tmp_path_factory.mktemp("soak")
    done = subprocess.run([sys.executable, "-m", "pdserve.cli", "bench", "soak", "--model", str(tiny_model_dir),
                           "--duration", str(DURATION_S), "--sample-every", "1", "--out", str(out), "--json"],
                          capture_output=True, text=True, timeout=300)
    assert done.returncode in (0, 1), done.stderr[-3000:]  # 1: a verdict that failed, still reported
    return json.loads(done.stdout), done.returncode, out


def test_soak_samples_every_process_counts_every_status_and_drains(soak: tuple[dict[str, Any], int, Path]) -> None:
    result, returncode, out = soak
    assert json.loads((out / "soak.json").read_text()) == result and (out / "soak.png").stat().st_size > 0
    assert returncode == (0 if result["verdict"]["ok"] else 1)
    assert result["config"]["duration_s"] == DURATION_S and result["config"]["warmup_s"] == 0.2 * DURATION_S
    assert result["config"]["rss_window_s"] == 5  # 5 samples: 20% of 20 s is less

    # 1. RSS and fds of each process, about once a second, the last after the drain
    samples = result["samples"]
    assert len(samples["t_s"]) >= DURATION_S - 2 and samples["t_s"][-1] >= DURATION_S
    assert set(samples["rss_mb"]) == set(samples["fds"]) == set(result["processes"]) == {"gateway", "prefill-0",
                                                                                          "decode-0"}
    for name in result["processes"]:
        assert len(samples["rss_mb"][name]) == len(samples["fds"][name]) == len(samples["t_s"])
        assert all(rss > 50 for rss in samples["rss_mb"][name]), name  # torch and the model: tens of MB at least
        assert all(fds > 5 for fds in samples["fds"][name]), name
        process = result["processes"][name]
        assert process["exit_code"] is None and process["rss_mb_warmup_peak"] > 50
        # RSS levels (each window's floor) net of caches, just after warm-up and at the end; judged by their ratio
        assert 50 < process["net_rss_mb_after_warmup"] <= process["rss_mb_after_warmup"]
        assert 50 < process["net_rss_mb_at_end"] <= process["rss_mb_at_end"] <= process["rss_mb_peak_after_warmup"]
        window = [rss for t, rss in zip(samples["t_s"], samples["rss_mb"][name])
                  if DURATION_S - 5 < t <= DURATION_S]
        assert min(window) <= process["rss_mb_at_end"] <= sorted(window)[len(window) // 2]  # a floor, not a median
        assert process["net_rss_growth"] == pytest.approx(
            process["net_rss_mb_at_end"] / process["net_rss_mb_after_warmup"] - 1, abs=1e-4)
        assert process["rss_ok"] == (process["net_rss_growth"] <= 0.05)
        assert process["fds_ok"] == (process["fds_peak_after_warmup"] <= process["fds_warmup_peak"] + 8)
    assert max(samples["gateway_live_requests"]) > 0  # the samples saw the load
    assert max(samples["cache_mb"]["prefill-0"]) > 0  # long prompts reached the prefill worker's prefix cache

    # 2. every request counted once, under its kind; every hostile kind ran
    by_kind = result["by_kind"]
    assert result["requests"] == sum(sum(c.values()) for c in by_kind.values()) == sum(result["statuses"].values())
    assert result["requests"] > 200
    assert result["hostile_kinds_run"] == result["hostile_kinds"] == sum(not k.weight for k in KINDS.values())
    unexpected = {(name, outcome): n for name, counts in by_kind.items() for outcome, n in counts.items()
                  if outcome not in KINDS[name].expected}
    assert result["unexpected"] == sum(unexpected.values())
    assert {(u["kind"], u["outcome"]): u["count"] for u in result["unexpected_examples"]} == unexpected
    # the ordinary load, its cancels and its abandoned streams met no surprise
    assert not [key for key in unexpected if KINDS[key[0]].weight], unexpected
    assert by_kind["grpc_stream"].get("OK", 0) > 0 and by_kind["grpc_long_prompt"].get("OK", 0) > 0
    assert by_kind["http_stream"].get("HTTP 200", 0) > 0 and by_kind["grpc_cancel"].get("CANCELLED", 0) > 0
    assert by_kind["http_abandoned_stream"].get("abandoned", 0) > 0
    assert set(by_kind["grpc_stop_huge"]) == {"INVALID_ARGUMENT"} and set(by_kind["http_nan"]) == {"HTTP 400"}
    assert set(by_kind["http_body_too_large"]) == {"HTTP 413"}
    assert set(by_kind["grpc_duplicate_id"]) == {"ALREADY_EXISTS"}

    # 3. nothing held once the load stopped: every live gauge and GetInfo count read 0
    assert result["drained_s"] is not None and result["held_at_end"] == {}, (
        result["held_at_end"], result.get("drained_late_s"), result.get("worker_warnings"))
    gauges = result["live_gauges_end"]
    assert {"metrics.pdserve_live_requests", "metrics.pdserve_queued_requests"} <= set(gauges["gateway"])
    assert {"metrics.pdserve_live_prefills", "metrics.pdserve_queued_tokens", "info.queued_tokens"} <= set(
        gauges["prefill-0"])
    assert {"metrics.pdserve_live_sequences", "metrics.pdserve_live_kv_bytes", "metrics.pdserve_live_buffer_bytes",
            "info.live_reservations", "info.live_transfers"} <= set(gauges["decode-0"])
    assert all(value == 0 for values in gauges.values() for value in values.values())
    assert result["verdict"]["live_gauges_zero"] and result["verdict"]["no_service_exited"]


def test_soak_hostile_requests_get_their_precise_status(soak: tuple[dict[str, Any], int, Path]) -> None:
    result, _, _ = soak
    assert not result["unexpected_examples"], result["unexpected_examples"]
