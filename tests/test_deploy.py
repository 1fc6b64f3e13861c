"""deploy/: what can be checked without a Docker engine or a Kubernetes cluster. The compose file and every
manifest validate against their published schemas (and broken copies do not); each container's command parses
with its service's own flag parser; ports agree across commands, services and network policies."""

from __future__ import annotations

import re
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest
import yaml

from decode_service.config import DecodeConfig
from gateway.config import GatewayConfig
from prefill_service.config import PrefillConfig
from serving.server import parse_config

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


K8S = DEPLOY / "k8s"
BIN = Path(sys.executable).parent  # the validators' commands, installed with the test extras


def _validate_compose(path: Path) -> subprocess.CompletedProcess[str]:
    return subprocess.run([str(BIN / "check-jsonschema"), "--builtin-schema", "vendor.compose-spec", str(path)],
                          capture_output=True, text=True, timeout=120)


def _validate_k8s(paths: list[Path]) -> subprocess.CompletedProcess[str]:
    return subprocess.run([str(BIN / "kubernetes-validate"), "--strict", "--no-warn", *map(str, paths)],
                          capture_output=True, text=True, timeout=300)


def _manifests() -> list[Path]:
    kustomization = yaml.safe_load((K8S / "kustomization.yaml").read_text())
    return [K8S / name for name in kustomization["resources"]]


def _resources() -> list[dict]:
    return [doc for path in _manifests() for doc in yaml.safe_load_all(path.read_text()) if doc]


def test_the_compose_file_matches_the_compose_spec_and_a_broken_copy_does_not(tmp_path: Path) -> None:
    valid = _validate_compose(DEPLOY / "docker-compose.yml")
    assert valid.returncode == 0, valid.stdout + valid.stderr
    broken = _compose()
    broken["services"]["gateway"]["depends_on"]["prefill"]["condition"] = "service_happy"
    broken["services"]["decode"]["ports"] = 50062
    (tmp_path / "docker-compose.yml").write_text(yaml.safe_dump(broken))
    refused = _validate_compose(tmp_path / "docker-compose.yml")
    assert refused.returncode != 0 and "service_happy" in refused.stdout + refused.stderr


def test_every_manifest_matches_the_kubernetes_schema_and_a_broken_copy_does_not(tmp_path: Path) -> None:
    assert sorted(p.name for p in _manifests()) == sorted(p.name for p in K8S.glob("*.yaml")
                                                          if p.name != "kustomization.yaml")
    valid = _validate_k8s(_manifests())
    assert valid.returncode == 0, valid.stdout + valid.stderr
    kinds = sorted(r["kind"] for r in _resources())
    assert kinds.count("Deployment") == 3 and kinds.count("NetworkPolicy") >= 4
    assert "HorizontalPodAutoscaler" in kinds
    decode = yaml.safe_load_all((K8S / "decode.yaml").read_text())
    deployment = next(doc for doc in decode if doc["kind"] == "Deployment")
    deployment["spec"]["replicas"] = "two"
    deployment["spec"]["template"]["spec"]["containers"][0]["imagePullPolicy_"] = "Always"
    (tmp_path / "decode.yaml").write_text(yaml.safe_dump(deployment))
    refused = _validate_k8s([tmp_path / "decode.yaml"])
    assert refused.returncode != 0 and "replicas" in refused.stdout + refused.stderr


def _container_configs(tmp_path: Path) -> dict[str, object]:
    """Each Deployment's container args, parsed by the service's own parser (mounted files made under tmp)."""
    (tmp_path / "keys").mkdir()
    (tmp_path / "keys" / "keys").write_text("sk-example\n")
    parsed = {}
    for resource in _resources():
        if resource["kind"] != "Deployment":
            continue
        container = resource["spec"]["template"]["spec"]["containers"][0]
        module, *flags = [arg.replace("/etc/pdserve", str(tmp_path)) for arg in container["args"]]
        parsed[resource["metadata"]["name"]] = parse_config(module, None, CONFIGS[module], flags)
    return parsed


def test_every_container_command_parses_and_the_ports_agree_with_services_and_policies(tmp_path: Path) -> None:
    configs = _container_configs(tmp_path)
    gateway, prefill, decode = configs["gateway"], configs["prefill"], configs["decode"]
    assert gateway.prefill == ["prefill.pdserve.svc.cluster.local:50061"]  # type: ignore[attr-defined]
    assert gateway.decode == ["decode.pdserve.svc.cluster.local:50062"]  # type: ignore[attr-defined]
    assert (prefill.server.port, decode.server.port, decode.kv_port) == (50061, 50062, 50063)  # type: ignore
    services = {r["metadata"]["name"]: r for r in _resources() if r["kind"] == "Service"}
    assert services["prefill"]["spec"]["clusterIP"] == "None" == services["decode"]["spec"]["clusterIP"]  # DNS pools

    def allowed(port: int, pod: str) -> set[str]:
        """The pod names whose traffic may reach `pod` on `port`."""
        sources = set()
        for policy in (r for r in _resources() if r["kind"] == "NetworkPolicy"):
            selected = policy["spec"]["podSelector"].get("matchLabels", {})
            if selected.get("app.kubernetes.io/name", pod) != pod or "app.kubernetes.io/part-of" in selected:
                continue
            for rule in policy["spec"].get("ingress", []):
                if port in [p["port"] for p in rule.get("ports", [])]:
                    sources |= {peer["podSelector"]["matchLabels"]["app.kubernetes.io/name"]
                                for peer in rule.get("from", [{"podSelector": {"matchLabels": {
                                    "app.kubernetes.io/name": "anyone"}}}])}
        return sources

    assert allowed(50063, "decode") == {"prefill"}  # the KV port: prefill only
    assert allowed(50062, "decode") == {"gateway"}  # decode's control RPCs: the gateway only
    assert allowed(50061, "prefill") == {"gateway"}
    assert allowed(50051, "gateway") == {"anyone"}


SECRET_NAME = re.compile(r"TOKEN|SECRET|PASSWORD|_KEYS?$")  # PDSERVE_WORKER_TOKEN, PDSERVE_API_KEYS, *_KEY


def _environments() -> Iterator[tuple[str, str, object]]:
    """(where, name, value) of every environment variable the compose files and the manifests set."""
    for service, spec in _compose()["services"].items():  # (compose.test.yml sets no environment)
        environment = spec.get("environment", {})
        if isinstance(environment, list):
            environment = dict(item.partition("=")[::2] for item in environment)
        for name, value in environment.items():
            yield f"docker-compose.yml {service}", name, value
    for resource in _resources():
        pod = resource.get("spec", {}).get("template", {}).get("spec", {})
        for container in pod.get("containers", []) + pod.get("initContainers", []):
            for variable in container.get("env", []):
                yield f"k8s {resource['metadata']['name']}", variable["name"], variable.get("value", variable)


def test_no_manifest_carries_a_default_secret() -> None:
    """A secret written into a file of this repository (the compose file's worker token had a default) is known to
    everyone who reads it: a secret comes from the user (compose: `${NAME:?message}`, refusing to start without
    it), from a Kubernetes Secret (valueFrom), or is a path to a mounted file."""
    secrets = [(where, name, value) for where, name, value in _environments() if SECRET_NAME.search(name)]
    assert any(name == "PDSERVE_WORKER_TOKEN" for _, name, _ in secrets)  # the check sees the compose token
    for where, name, value in secrets:
        assert (isinstance(value, dict) and "valueFrom" in value or str(value).startswith("/")
                or re.fullmatch(r"\$\{" + name + r":\?[^}]+\}", str(value))), f"{where}: {name}={value!r}"
    for path in [DEPLOY / "docker-compose.yml", *DEPLOY.glob("podman/*.yml"), *K8S.glob("*.yaml")]:
        defaults = re.findall(r"\$\{(\w+):?-[^}]*\}", path.read_text())  # ${NAME:-default}, comments included
        assert not [name for name in defaults if SECRET_NAME.search(name)], f"{path.name}: a secret's default"
    assert not [r for r in _resources() if r["kind"] == "Secret"]  # created by the user (deploy/README.md)


def test_the_image_s_early_layer_holds_every_module_model_loading_imports(tmp_path: Path) -> None:
    """The Dockerfile converts the model and builds the kernels from a few files copied before the rest (so that
    a code change does not redo them): those files alone must import model_runner.loading."""
    dockerfile = (DEPLOY / "Dockerfile").read_text()
    early = dockerfile[:dockerfile.index("RUN python -c \"from model_runner.loading import resolve_model")]
    root = DEPLOY.parent
    for line in early.splitlines():
        words = line.split()
        if words[:1] != ["COPY"] or words[1].startswith("--") or words[1] == "pyproject.toml":
            continue
        *sources, target = words[1:]
        for source in sources:
            path = root / source
            destination = tmp_path / target / (path.name if path.is_file() else "")
            if path.is_dir():
                subprocess.run(["cp", "-r", str(path), str(destination)], check=True)
            else:
                destination.parent.mkdir(parents=True, exist_ok=True)
                destination.write_bytes(path.read_bytes())
    # only what was copied: without the editable install's finder, which would find the rest of the checkout
    probe = ("import sys; sys.meta_path[:] = [f for f in sys.meta_path if 'Editable' not in "
             "getattr(f, '__name__', type(f).__name__)]; import model_runner.loading")
    done = subprocess.run([sys.executable, "-c", probe], cwd=tmp_path,
                          capture_output=True, text=True, timeout=120, env={"PYTHONPATH": str(tmp_path),
                                                                           "PATH": "/usr/bin:/bin"})
    assert done.returncode == 0, done.stderr[-2000:]
