"""deploy/: what can be checked without a Docker engine. Each container's command parses with its service's own
flag parser, and the compose file wires tracing to Jaeger and finds the pools by DNS."""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml

from decode_service.server import DecodeConfig
from gateway.server import GatewayConfig
from pdserve.serving import parse_config
from prefill_service.server import PrefillConfig

DEPLOY = Path(__file__).resolve().parent.parent / "deploy"
CONFIGS = {"gateway": GatewayConfig, "prefill_service": PrefillConfig, "decode_service": DecodeConfig}


def _compose() -> dict:
    return yaml.safe_load((DEPLOY / "docker-compose.yml").read_text())


def test_every_compose_command_parses_with_its_service_parser() -> None:
    services = _compose()["services"]
    parsed = {}
    for name in ("gateway", "prefill", "decode"):
        module, *flags = services[name]["command"]  # the image's entrypoint is `python -m`
        parsed[name] = parse_config(module, None, CONFIGS[module], flags)
    assert parsed["gateway"].prefill == ["prefill:50061"] and parsed["gateway"].decode == ["decode:50062"]
    assert parsed["prefill"].server.port == 50061 and parsed["decode"].server.port == 50062
    assert all(config.server.host == "0.0.0.0" for config in parsed.values())  # reachable from other containers


def test_compose_sends_every_service_s_spans_to_jaeger() -> None:
    services = _compose()["services"]
    assert services["jaeger"]["image"].startswith("jaegertracing/jaeger:2.")
    assert "4317:4317" in services["jaeger"]["ports"] and "16686:16686" in services["jaeger"]["ports"]
    for name in ("gateway", "prefill", "decode"):
        environment = services[name]["environment"]
        assert environment["OTEL_EXPORTER_OTLP_ENDPOINT"] == "http://jaeger:4317"
        assert environment["PDSERVE_PORT"] == str(parse_config("x", None, CONFIGS[services[name]["command"][0]],
                                                               services[name]["command"][1:]).server.port)


def test_a_broken_command_is_caught(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exited:
        parse_config("decode_service", None, DecodeConfig, ["--max-seqs", "0"])
    assert exited.value.code == 2 and "--max-seqs 0" in capsys.readouterr().err
