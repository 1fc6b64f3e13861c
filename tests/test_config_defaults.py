"""Every config default has one home, its dataclass: a service started with no flags gets exactly that config."""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import yaml

from decode_service.config import DecodeConfig
from gateway.config import GatewayConfig
from model_runner.loading import ModelConfig, add_model_args, model_config
from pdserve import cli
from pdserve.cluster import ClusterConfig, role_args
from prefill_service.config import PrefillConfig
from serving.server import ServerConfig, add_server_args, parse_config, server_config
from serving.settings import ROLES, config_class_of, role_of

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
    # the flags are generated from ClusterConfig's settings: lists, repeats and bounds included
    argv = ["cluster", "--prefill", "2", "--prefill-ports", "5001,5002", "--decode-arg=--max-seqs=8",
            "--decode-arg=--lease=9", "--no-pin", "--log-format", "json"]
    config = cli.cluster_config(cli.build_parser(argv).parse_args(argv))
    assert (config.prefill_ports, config.decode_args, config.pin, config.log_format) == (
        (5001, 5002), ("--max-seqs=8", "--lease=9"), False, "json")
    for argv, named in ((["cluster", "--decode", "0"], "--decode 0: must be >= 1"),
                        (["cluster", "--prefill", "2", "--prefill-ports", "5001"], "1 ports for 2 workers")):
        with pytest.raises(ValueError, match=named):
            cli.cluster_config(cli.build_parser(argv).parse_args(argv))


def test_each_role_names_its_config_class_once() -> None:
    # one registry (serving/settings.py ROLES) gives the config file's tables, `pdserve config show`'s roles and
    # each service's table
    classes = {"gateway": GatewayConfig, "prefill": PrefillConfig, "decode": DecodeConfig}
    assert {role: config_class_of(role) for role in ROLES} == classes
    assert {role_of(cls): cls for cls in classes.values()} == classes
    with pytest.raises(LookupError, match="ServerConfig"):
        role_of(ServerConfig)


@pytest.mark.parametrize("field, value, flag", [
    ("prefill_pass_ms", -1.0, "--prefill-pass-ms"),
    ("prefill_pass_steps", -0.5, "--prefill-pass-steps"),
    ("prefill_pass_steps", float("nan"), "--prefill-pass-steps"),
])
def test_a_decode_pass_budget_out_of_range_is_refused_naming_its_flag(field: str, value: float, flag: str) -> None:
    with pytest.raises(ValueError, match=flag):
        DecodeConfig(server=ServerConfig(), model=ModelConfig(), **{field: value})


# Where each service runs, what it loads and how it reaches the others: a deployment's own business. Everything else
# is the tuning profile, which every way of deploying pdserve must run alike.
DEPLOYMENT_FIELDS = {
    "gateway": ("server", "prefill", "decode", "model", "http_port", "api_key_file"),
    "prefill": ("server", "model", "kv_shm"),  # Kubernetes pods share no /dev/shm: --no-kv-shm
    "decode": ("server", "model", "kv_shm", "kv_port"),  # ... and decode takes KV on a port of its own there
}
CONFIGS = {"gateway": GatewayConfig, "prefill": PrefillConfig, "decode": DecodeConfig}
DEPLOY = Path(__file__).resolve().parent.parent / "deploy"


def _profile(role: str, argv: list[str]) -> Any:
    """The config `argv` starts `role` with, its deployment fields set to the defaults'."""
    parser = argparse.ArgumentParser()
    CONFIGS[role].add_args(parser)
    args = parser.parse_args(argv)
    if role == "gateway":
        args.api_key_file = ""  # a path inside the pod
    config = CONFIGS[role].from_args(args)
    reference = CONFIGS[role].from_args(parser.parse_args(["--decode", DECODE] if role == "gateway" else []))
    return dataclasses.replace(config, **{name: getattr(reference, name) for name in DEPLOYMENT_FIELDS[role]})


def _compose_args(role: str) -> list[str]:
    services = yaml.safe_load((DEPLOY / "docker-compose.yml").read_text())["services"]
    command = services[role]["command"]
    return command[1:]


def _kubernetes_args(role: str) -> list[str]:
    manifests = yaml.safe_load_all((DEPLOY / "k8s" / f"{role}.yaml").read_text())
    deployment = next(m for m in manifests if m and m["kind"] == "Deployment")
    return deployment["spec"]["template"]["spec"]["containers"][0]["args"][1:]


@pytest.mark.parametrize("role", ["gateway", "prefill", "decode"])
def test_compose_kubernetes_and_pdserve_cluster_run_one_profile(role: str) -> None:
    """Every tuning flag has one value wherever pdserve is deployed: `pdserve cluster` (what the benchmarks run),
    docker-compose and the Kubernetes base each start `role` with the same config but for where it runs."""
    cluster = _profile(role, role_args(ClusterConfig(), role) + (["--decode", DECODE] if role == "gateway" else []))
    assert _profile(role, _compose_args(role)) == cluster, "docker-compose.yml tunes differently"
    assert _profile(role, _kubernetes_args(role)) == cluster, "the Kubernetes base tunes differently"
    assert cluster == _profile(role, ["--decode", DECODE] if role == "gateway" else []), \
        "pdserve cluster passes a tuning flag: make it the service's default instead"


def test_a_config_file_then_the_environment_then_flags_set_a_service_s_settings(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Last wins: the field's default, the file's [decode] table (keys as flags, dashes or underscores), the
    PDSERVE_<FLAG> variable, the flag; and each value says where it came from."""
    path = tmp_path / "pdserve.toml"
    path.write_text('[decode]\nmax-seqs = 16\nprefill_pass_ms = 20\nno-kv-shm = true\nlease = 12.5\n'
                    '[gateway]\nmax-in-flight = 8\n')
    monkeypatch.setenv("PDSERVE_PREFILL_PASS_MS", "25")
    monkeypatch.setenv("PDSERVE_LEASE", "40")
    sources: dict[str, str] = {}
    config = parse_config("python -m decode_service", None, DecodeConfig, ["--config", str(path), "--lease", "50"],
                          sources)
    assert (config.max_seqs, config.prefill_pass_ms, config.kv_shm, config.lease_s) == (16, 25.0, False, 50.0)
    assert config.prefill_chunk == DecodeConfig(server=ServerConfig(), model=ModelConfig()).prefill_chunk
    assert sources["max_seqs"] == "file" and sources["kv_shm"] == "file" and sources["prefill_pass_ms"] == "env"
    assert sources["lease_s"] == "flag" and sources["prefill_chunk"] == "default"
    gateway = parse_config("python -m gateway", None, GatewayConfig, ["--config", str(path), "--decode", DECODE])
    assert gateway.admission.max_in_flight == 8  # its own table; the [decode] one is not its


def test_a_repeatable_flag_replaces_the_file_s_list_and_a_bad_variable_is_named(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> None:
    path = tmp_path / "pdserve.toml"
    path.write_text('[gateway]\ndecode = ["old:1", "old:2"]\n')
    from_file = parse_config("python -m gateway", None, GatewayConfig, ["--config", str(path)])
    assert from_file.decode == ["old:1", "old:2"]
    flagged = parse_config("python -m gateway", None, GatewayConfig, ["--config", str(path), "--decode=new:3"])
    assert flagged.decode == ["new:3"]  # not old:1, old:2, new:3
    monkeypatch.setenv("PDSERVE_MAX_IN_FLIGHT", "many")
    with pytest.raises(SystemExit) as exited:
        parse_config("python -m gateway", None, GatewayConfig, ["--decode", DECODE])
    assert exited.value.code == 2 and "PDSERVE_MAX_IN_FLIGHT = 'many': expected an integer" in capsys.readouterr().err


@pytest.mark.parametrize("text, named", [
    ("[decode]\nmax-seqz = 16\n", "max-seqz: no such setting"),
    ("[decode]\nmax-seqs = 0\n", "--max-seqs 0: must be >= 1"),
    ("[decode]\nno-kv-shm = 3\n", "no-kv-shm: expected true or false"),
    ("[decoder]\nmax-seqs = 16\n", "unknown tables ['decoder']"),
    ("[decode\n", "--config"),
])
def test_a_bad_config_file_stops_the_service_naming_what_is_wrong(
        tmp_path: Path, capsys: pytest.CaptureFixture[str], text: str, named: str) -> None:
    path = tmp_path / "pdserve.toml"
    path.write_text(text)
    with pytest.raises(SystemExit) as exited:
        parse_config("python -m decode_service", None, DecodeConfig, ["--config", str(path)])
    assert exited.value.code == 2 and named in capsys.readouterr().err


def test_pdserve_config_show_prints_each_setting_and_where_it_came_from(tmp_path: Path) -> None:
    path = tmp_path / "pdserve.toml"
    path.write_text("[prefill]\nprefix-cache-mb = 64\n")
    shown = subprocess.run([sys.executable, "-m", "pdserve.cli", "config", "show", "--json", "prefill",
                            "--config", str(path), "--max-queued-tokens", "1024"], capture_output=True, text=True,
                           timeout=120, env={**os.environ, "PDSERVE_PREFILL_CHUNK": "128"})
    assert shown.returncode == 0, shown.stderr
    settings = json.loads(shown.stdout)
    assert settings["prefix_cache_mb"] == {"value": 64.0, "source": "file"}
    assert settings["prefill_chunk"] == {"value": 128, "source": "env"}
    assert settings["max_queued_tokens"] == {"value": 1024, "source": "flag"}
    assert settings["batch_tokens"]["source"] == "default"
    refused = subprocess.run([sys.executable, "-m", "pdserve.cli", "config", "show", "prefill", "--prefill-chunk",
                              "0"], capture_output=True, text=True, timeout=120)
    assert refused.returncode == 2 and "--prefill-chunk 0: must be >= 1" in refused.stderr


def test_pdserve_cluster_passes_its_config_file_to_every_service(tmp_path: Path) -> None:
    config = ClusterConfig(config_file=str(tmp_path / "pdserve.toml"))
    for role in ("gateway", "prefill", "decode"):
        assert f"--config={tmp_path / 'pdserve.toml'}" in role_args(config, role)


def test_a_worker_s_prompt_gemm_flag_wins_over_the_environment_auto_included(
        tiny_model_dir: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from model_runner import gemm

    monkeypatch.setenv("PDSERVE_PROMPT_GEMM", "fp32")
    assert parse_config("python -m prefill_service", None, PrefillConfig,
                        ["--model", str(tiny_model_dir)]).model.prompt_gemm == "fp32"  # the variable alone
    config = parse_config("python -m prefill_service", None, PrefillConfig,
                          ["--model", str(tiny_model_dir), "--prompt-gemm", "auto"])
    assert config.model.prompt_gemm == "auto"
    try:
        config.model.load()  # the flag, not the variable, decides where its prompt GEMMs run
        assert gemm.prompt_gemm() != "fp32"
    finally:
        gemm.choose_prompt_gemm(None)


def test_auto_prompt_gemms_go_to_float32_only_on_a_prefill_worker_whose_kernel_lacks_avx512_bf16(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """Where it was measured faster (docs/kernels.md): a prefill worker, on AVX-512 without AVX512-BF16.
    PDSERVE_GEMM=avx512 runs the kernel's AVX-512 code without its BF16 instructions on any AVX-512 CPU."""
    import torch

    from model_runner import gemm

    monkeypatch.setenv("PDSERVE_GEMM", "avx512")
    path = gemm.kernel_path(torch.bfloat16)
    try:
        chosen = {}
        for worker in (False, True):
            gemm.choose_prompt_gemm("auto", prompt_worker=worker)
            chosen[worker] = gemm.prompt_gemm()
        if gemm.amx_prompts():
            assert chosen == {False: "amx", True: "amx"}
        elif path == "avx512":  # this CPU has AVX-512: the prefill worker's prompts go to float32, decode's stay
            assert chosen == {False: "kernel", True: "fp32"}
        else:  # AVX2 (the kernel's AVX2 path ~ torch's float32 GEMM there) or no kernel at all
            assert chosen == {False: "kernel", True: "kernel"}
        gemm.choose_prompt_gemm("kernel", prompt_worker=True)  # a flag still wins
        assert gemm.prompt_gemm() == "kernel"
    finally:
        gemm.choose_prompt_gemm(None)
