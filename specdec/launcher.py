"""Starts the three services as processes on this machine, waits until each reports
healthy, and stops them cleanly. Used by `specdec serve`, `specdec demo` and the tests.
The pid of each service's latest process is in <workdir>/<service>.pid until the stack
stops, for operators and tests."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

SERVICES = ("draft", "verify", "gateway")


@dataclass(frozen=True)
class StackConfig:
    target: str
    draft: str
    workdir: Path  # sockets and logs
    gateway_address: str = "127.0.0.1:50051"
    device: str = "cpu"
    with_draft: bool = True  # False: the verify service runs without a draft service
    draft_tcp: str = ""  # host:port to reach the draft over TCP instead of a unix socket
    extra_args: dict[str, list[str]] = field(default_factory=dict)  # per service name
    programs: dict[str, list[str]] = field(default_factory=dict)  # per service: run this instead of python -m
    env: dict[str, str] = field(default_factory=dict)  # set in every service's environment

    @property
    def draft_address(self) -> str:
        return self.draft_tcp or f"unix://{self.workdir / 'draft.sock'}"

    @property
    def verify_address(self) -> str:
        return f"unix://{self.workdir / 'verify.sock'}"

    def address(self, service: str) -> str:
        return {"draft": self.draft_address, "verify": self.verify_address, "gateway": self.gateway_address}[service]

    def command(self, service: str) -> list[str]:
        args = {
            "draft": ["--model", self.draft, "--device", self.device],
            "verify": [
                "--model", self.target, "--device", self.device,
                "--draft", self.draft_address if self.with_draft else "",
            ],
            "gateway": ["--tokenizer", self.target, "--verify", self.verify_address],
        }[service]
        module = f"{service}_service" if service != "gateway" else "gateway"
        program = self.programs.get(service) or [sys.executable, "-m", module]
        return [*program, "--listen", self.address(service), *args, *self.extra_args.get(service, [])]


def free_port() -> int:
    """A TCP port on loopback that nobody listens on now."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class StackError(RuntimeError):
    pass


class Stack:
    def __init__(self, config: StackConfig) -> None:
        self.config = config
        self.processes: dict[str, subprocess.Popen] = {}

    def services(self) -> list[str]:
        return [s for s in SERVICES if s != "draft" or self.config.with_draft]

    def log_path(self, service: str) -> Path:
        return self.config.workdir / f"{service}.log"

    def pid_path(self, service: str) -> Path:
        return self.config.workdir / f"{service}.pid"

    def environment(self) -> dict[str, str]:
        """Every service's environment: this process's, with the config's settings."""
        return {**os.environ, **self.config.env, "PYTHONUNBUFFERED": "1"}

    def start(self, timeout_s: float = 180.0) -> None:
        """Starts every service at once and waits until all report SERVING. The verify
        service waits for its draft to come up and pairs with it before it serves
        (--draft-startup-wait-s), so the first request speculates."""
        self.config.workdir.mkdir(parents=True, exist_ok=True)
        deadline = time.monotonic() + timeout_s
        services = self.services()
        for service in services:
            self.start_service(service)
        for service in services:
            self.wait_healthy(service, deadline)

    def start_service(self, service: str) -> subprocess.Popen:
        """Starts (or starts again) one service, without waiting for it to be healthy."""
        log = self.log_path(service).open("ab")
        process = subprocess.Popen(
            self.config.command(service),
            stdout=log,
            stderr=subprocess.STDOUT,
            env=self.environment(),
            start_new_session=True,
        )
        log.close()
        self.processes[service] = process
        written = self.pid_path(service).with_suffix(".pid.new")
        written.write_text(f"{process.pid}\n")
        written.replace(self.pid_path(service))  # readers never see a half-written file
        return process

    def wait_healthy(self, service: str, deadline: float) -> None:
        with grpc.insecure_channel(self.config.address(service)) as channel:
            stub = health_pb2_grpc.HealthStub(channel)
            while True:
                process = self.processes[service]
                if process.poll() is not None:
                    raise StackError(f"{service} exited with {process.returncode}:\n{self.log_tail(service)}")
                try:
                    reply = stub.Check(health_pb2.HealthCheckRequest(), timeout=1.0, wait_for_ready=True)
                    if reply.status == health_pb2.HealthCheckResponse.SERVING:
                        return
                except grpc.RpcError:
                    pass
                if time.monotonic() > deadline:
                    raise StackError(f"{service} did not become healthy in time:\n{self.log_tail(service)}")

    def log_tail(self, service: str, lines: int = 30) -> str:
        try:
            return "\n".join(self.log_path(service).read_text(errors="replace").splitlines()[-lines:])
        except FileNotFoundError:
            return "(no log)"

    def signal(self, service: str, sig: signal.Signals) -> None:
        self.processes[service].send_signal(sig)

    def stop(self, timeout_s: float = 20.0) -> dict[str, int]:
        """SIGTERM to the gateway and the verify service (both drain their streams for
        their grace period), then to the draft, which the draining verify service may
        still use; returns the exit codes."""
        codes: dict[str, int] = {}
        for wave in (("gateway", "verify"), ("draft",)):
            stopping = {s: self.processes.pop(s) for s in wave if s in self.processes}
            for process in stopping.values():
                if process.poll() is None:
                    process.send_signal(signal.SIGCONT)  # a stopped process cannot handle SIGTERM
                    process.terminate()
            for service, process in stopping.items():
                try:
                    process.wait(timeout_s)
                except subprocess.TimeoutExpired:
                    process.kill()
                    process.wait()
                codes[service] = process.returncode
                self.pid_path(service).unlink(missing_ok=True)
        return codes

    def __enter__(self) -> Stack:
        try:
            self.start()
        except BaseException:
            self.stop()
            raise
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()
