"""The docker-compose deployment, for real.

The compose file is checked against the Compose Specification. Then the image is built on
a local Debian base (no registry is reachable), and the compose project comes up on CPU:
the GPU reservations are the only thing taken out, and Jaeger is stood in for by the OTLP
receiver of tests/otlp_receiver.py under the same name and port. A completion streams
from the published gateway port through the three containers; the draft and verify pair
over the socket volume they share; all three services' spans reach the collector.

Needs a Docker engine with docker-compose and mmdebstrap (scripts/docker-engine sets them
up) and fails, saying so, without them. scripts/docker-test-images builds the images; it
keeps two between runs: the base, and the dependency stage tagged with the hash of
everything that goes into it. Everything else the test makes (image, containers, volumes,
network) it removes.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import uuid
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import grpc
import pytest
import yaml
from grpc_health.v1 import health_pb2, health_pb2_grpc
from prometheus_client.parser import text_string_to_metric_families

from specdec.client import Completion, connect, generate
from specdec.v1 import generation_pb2, pairing_pb2
from specdec.launcher import free_port
from tests.helpers import request, wait_for

REPO = Path(__file__).resolve().parent.parent
COMPOSE_FILE = REPO / "docker-compose.yml"
SERVICES = ("draft", "verify", "gateway")
PROMPT = "def parse(line):"
MAX_NEW_TOKENS = 32

def sh(*args: str | Path, timeout: float, env: dict[str, str] | None = None) -> str:
    """Runs a command to completion; its output ends up in the failure when it fails."""
    result = subprocess.run([str(a) for a in args], capture_output=True, text=True, timeout=timeout, env=env)
    if result.returncode != 0:
        raise AssertionError(
            f"{' '.join(map(str, args))} exited {result.returncode}:\n{result.stdout[-4000:]}\n{result.stderr[-4000:]}"
        )
    return result.stdout


def require_engine() -> None:
    missing = [tool for tool in ("docker", "docker-compose", "mmdebstrap") if shutil.which(tool) is None]
    if missing:
        pytest.fail(f"{', '.join(missing)} not installed: run scripts/docker-engine (as root, with apt)")
    info = subprocess.run(["docker", "info"], capture_output=True, text=True, timeout=30)
    if info.returncode != 0:
        pytest.fail(f"no Docker engine answers ({info.stderr.strip()[-300:]}): run scripts/docker-engine (as root)")


def image_exists(name: str) -> bool:
    return subprocess.run(["docker", "image", "inspect", name], capture_output=True).returncode == 0


def cpu_variant(app_image: str, spans_dir: Path) -> dict[str, Any]:
    """docker-compose.yml without the GPU reservations, with the OTLP receiver as jaeger."""
    spec = yaml.safe_load(COMPOSE_FILE.read_text())
    for service in spec["services"].values():
        reservations = service.get("deploy", {}).get("resources", {}).get("reservations", {})
        if reservations.pop("devices", None) is not None:
            # drop the now empty levels too: reservations, resources, deploy
            if not reservations:
                del service["deploy"]["resources"]["reservations"]
            if not service["deploy"]["resources"]:
                del service["deploy"]["resources"]
            if not service["deploy"]:
                del service["deploy"]
    spec["services"]["jaeger"] = {
        "image": app_image,
        "command": ["python", "-m", "tests.otlp_receiver", "--listen", "0.0.0.0:4317", "--out", "/spans/spans.jsonl"],
        "volumes": [f"{REPO / 'tests'}:/app/tests:ro", f"{spans_dir}:/spans"],
    }
    return spec


def wait_serving(address: str, timeout_s: float) -> None:
    def serving() -> bool:
        with grpc.insecure_channel(address) as channel:
            try:
                reply = health_pb2_grpc.HealthStub(channel).Check(
                    health_pb2.HealthCheckRequest(), timeout=2.0, wait_for_ready=True
                )
            except grpc.RpcError:
                return False
        return reply.status == health_pb2.HealthCheckResponse.SERVING

    wait_for(serving, f"the gateway to serve on {address}", timeout_s)


@dataclass
class Deployment:
    compose: list[str]  # docker-compose with this project's name and files
    spans_file: Path  # where the receiver standing in for Jaeger writes
    completion: Completion
    info: generation_pb2.GatewayInfo

    def spans(self) -> list[dict[str, Any]]:
        if not self.spans_file.exists():
            return []
        return [json.loads(line) for line in self.spans_file.read_text().splitlines() if line.strip()]

    def exec(self, service: str, code: str) -> str:
        return sh(*self.compose, "exec", "-T", service, "python", "-c", code, timeout=60)


@pytest.fixture(scope="module")
def deployment(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Deployment]:
    require_engine()
    workdir = tmp_path_factory.mktemp("compose")
    run_id = uuid.uuid4().hex[:10]
    project, app_image = f"specdectest{run_id}", f"specdec-test-app:{run_id}"
    spans_dir = workdir / "spans"
    spans_dir.mkdir()
    variant = workdir / "docker-compose.cpu.yml"
    variant.write_text(yaml.safe_dump(cpu_variant(app_image, spans_dir), sort_keys=False))
    port = free_port()
    env = {**os.environ, "SPECDEC_IMAGE": app_image, "SPECDEC_DEVICE": "cpu", "SPECDEC_GATEWAY_PORT": str(port)}
    # --project-directory: relative paths (./models) resolve against the checkout
    compose = ["docker-compose", "--project-name", project, "--project-directory", str(REPO), "--file", str(variant)]
    try:
        sh(sys.executable, REPO / "scripts" / "docker-test-images", "--app", app_image, timeout=1800)
        # up returns once every service is started, each after its dependencies are healthy
        sh(*compose, "up", "--detach", "--no-build", timeout=240, env=env)
        gateway = f"127.0.0.1:{port}"
        wait_serving(gateway, timeout_s=120)
        channel, stub = connect(gateway)
        with channel:
            completion = generate(stub, request(PROMPT, max_new_tokens=MAX_NEW_TOKENS), timeout=120)
            info = stub.GetInfo(generation_pb2.GatewayInfoRequest(), timeout=30)
        yield Deployment(compose, spans_dir / "spans.jsonl", completion, info)
    finally:
        logs = subprocess.run([*compose, "logs", "--no-color", "--tail=40"], capture_output=True, text=True, env=env)
        print(logs.stdout, logs.stderr, file=sys.stderr)  # in the report when setup fails
        # every step runs even when one fails; what is left is checked at the end
        down = subprocess.run(
            [*compose, "down", "--volumes", "--remove-orphans", "--timeout", "10"],
            capture_output=True,
            text=True,
            env=env,
            timeout=300,
        )
        subprocess.run(["docker", "rmi", app_image], capture_output=True, timeout=300)
        label = f"label=com.docker.compose.project={project}"
        left = sh("docker", "ps", "--all", "--quiet", "--filter", label, timeout=60).split()
        left += sh("docker", "volume", "ls", "--quiet", "--filter", label, timeout=60).split()
        left += [app_image] if image_exists(app_image) else []
        assert not left, f"left behind: {left}\n{down.stdout}{down.stderr}"


def test_compose_file_follows_the_compose_specification() -> None:
    validator = Path(sys.executable).parent / "check-jsonschema"
    sh(validator, "--builtin-schema", "vendor.compose-spec", COMPOSE_FILE, timeout=60)


def test_docker_compose_reads_the_compose_file() -> None:
    if shutil.which("docker-compose") is None:
        pytest.fail("docker-compose not installed: run scripts/docker-engine (as root, with apt)")
    config = yaml.safe_load(sh("docker-compose", "--file", COMPOSE_FILE, "config", timeout=60))
    for name in ("draft", "verify"):
        (device,) = config["services"][name]["deploy"]["resources"]["reservations"]["devices"]
        assert device["driver"] == "nvidia" and device["capabilities"] == ["gpu"]
    assert set(config["services"]) == {*SERVICES, "jaeger"}


def test_a_completion_streams_from_the_published_port_through_the_containers(deployment: Deployment) -> None:
    completion = deployment.completion
    assert completion.finish_reason == "length"
    assert len(completion.token_ids) == completion.usage.completion_tokens == MAX_NEW_TOKENS
    assert completion.text
    assert all(message.speculation.speculating for message in completion.messages)
    assert completion.usage.draft_tokens_proposed > 0


def test_draft_and_verify_pair_over_the_socket_volume_they_share(deployment: Deployment) -> None:
    verify = deployment.info.verify
    assert verify.draft_address == "unix:///sockets/draft.sock"
    assert verify.device == "cpu"
    pairing = verify.pairing
    assert pairing.state == pairing_pb2.PAIRING_STATE_PAIRED, pairing.detail
    assert pairing.transport == pairing_pb2.TRANSPORT_UNIX_SOCKET
    assert pairing.same_host and pairing.tokenizer_match
    assert pairing.link == pairing_pb2.GPU_LINK_NONE_CPU
    # two containers (two host names) on one kernel (one boot id)
    draft = pairing.draft.host
    assert draft.hostname and not pairing.verifier_host.startswith(draft.hostname + " ")
    assert draft.boot_id and f"boot id {draft.boot_id[:8]}..." in pairing.verifier_host


def test_spans_of_all_three_services_reach_the_collector(deployment: Deployment) -> None:
    trace_id = deployment.completion.messages[0].trace_id
    assert len(trace_id) == 32 and int(trace_id, 16)

    def services() -> set[str] | None:
        found = {span["service"] for span in deployment.spans() if span["trace_id"] == trace_id}
        return found if found >= {f"specdec-{s}" for s in SERVICES} else None

    wait_for(services, f"spans of trace {trace_id} from all three services", timeout_s=60)


def test_each_service_serves_prometheus_metrics_on_9464(deployment: Deployment) -> None:
    scrape = "import urllib.request; print(urllib.request.urlopen('http://127.0.0.1:9464/metrics', timeout=10).read().decode())"
    counted = {
        "draft": "specdec_draft_tokens_proposed_total",
        "verify": "specdec_tokens_generated_total",
        "gateway": "specdec_tokens_generated_total",
    }
    for service, name in counted.items():
        text = deployment.exec(service, scrape)
        samples = {s.name: s.value for family in text_string_to_metric_families(text) for s in family.samples}
        assert samples.get(name, 0) > 0, f"{service}: {name} missing or zero"
