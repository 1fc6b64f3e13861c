"""Every config default has one home, its dataclass: a service started with no flags gets exactly that config."""

from __future__ import annotations

import argparse
import dataclasses
from typing import Any

import pytest

from decode_service.server import DecodeConfig
from gateway.server import GatewayConfig
from model_runner.loading import ModelConfig, add_model_args, model_config
from pdserve import cli
from pdserve.cluster import ClusterConfig
from prefill_service.server import PrefillConfig
from serving.server import ServerConfig, add_server_args, server_config

DECODE = "127.0.0.1:1"  # the gateway's one required flag


@pytest.mark.parametrize("config, argv, required", [
    (GatewayConfig, ["--decode", DECODE], {"decode": [DECODE]}),
    (PrefillConfig, [], {"model": ModelConfig()}),
    (DecodeConfig, [], {"model": ModelConfig()}),
], ids=["gateway", "prefill", "decode"])
def test_a_service_with_no_flags_gets_its_dataclass_defaults(config: Any, argv: list[str],
                                                             required: dict[str, Any]) -> None:
    parser = argparse.ArgumentParser()
    config.add_args(parser)
    parsed = config.from_args(parser.parse_args(argv))
    # each service listens on its own default port; the rest of its server config is ServerConfig's
    server = dataclasses.replace(ServerConfig(), port=parsed.server.port)
    assert parsed == config(server=server, **required)


def test_the_shared_server_and_model_flags_default_to_their_dataclasses() -> None:
    parser = argparse.ArgumentParser()
    add_server_args(parser)
    add_model_args(parser)
    args = parser.parse_args([])
    assert server_config(args) == ServerConfig()
    assert model_config(args) == ModelConfig()


def test_pdserve_cluster_with_no_flags_gets_cluster_config_defaults() -> None:
    # the CLI writes its defaults out (so that `pdserve --help` imports nothing heavy): they must agree
    args = cli.build_parser(["cluster"]).parse_args(["cluster"])
    assert cli.cluster_config(args) == ClusterConfig()


@pytest.mark.parametrize("field, value, flag", [
    ("prefill_pass_ms", -1.0, "--prefill-pass-ms"),
    ("prefill_pass_steps", -0.5, "--prefill-pass-steps"),
    ("prefill_pass_steps", float("nan"), "--prefill-pass-steps"),
])
def test_a_decode_pass_budget_out_of_range_is_refused_naming_its_flag(field: str, value: float, flag: str) -> None:
    with pytest.raises(ValueError, match=flag):
        DecodeConfig(server=ServerConfig(), model=ModelConfig(), **{field: value})
