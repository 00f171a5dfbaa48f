"""gRPC server plumbing shared by the three services: health, reflection, addresses,
graceful shutdown on SIGTERM/SIGINT."""

from __future__ import annotations

import logging
import os
import signal
import socket
import threading
import time
from collections.abc import Callable
from concurrent import futures
from pathlib import Path

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection

from specdec.errors import Unavailable


UNIX_PREFIX = "unix://"


def setup_logging(service: str) -> logging.Logger:
    from transformers.utils import logging as transformers_logging  # not at import: clients import this module

    transformers_logging.disable_progress_bar()  # service logs are line-oriented
    logging.basicConfig(
        level=os.environ.get("SPECDEC_LOG_LEVEL", "INFO"),
        format=f"%(asctime)s {service} %(levelname)s %(message)s",
    )
    return logging.getLogger(service)


def unix_socket_path(address: str) -> Path | None:
    """The filesystem path of a unix:///abs/path address, else None."""
    if address.startswith(UNIX_PREFIX):
        return Path(address[len(UNIX_PREFIX) :])
    if address.startswith("unix:"):
        return Path(address[len("unix:") :])
    return None


def channel_options() -> list[tuple[str, int]]:
    """Client channel options: reconnect within a second once a peer is back."""
    return [
        ("grpc.initial_reconnect_backoff_ms", 100),
        ("grpc.min_reconnect_backoff_ms", 100),
        ("grpc.max_reconnect_backoff_ms", 1000),
    ]


class Drain:
    """The shutdown clock of a service. After SIGTERM, streams get the grace period to
    finish; one still running near its end ends itself with UNAVAILABLE, so that its
    client reads why instead of the transport's bare cancellation."""

    def __init__(self, service: str) -> None:
        self._service = service
        self._end: float | None = None  # monotonic time after which streams end themselves
        self._at_end: list[Callable[[], None]] = []

    def at_end(self, callback: Callable[[], None]) -> None:
        """Runs callback when streams must end (to wake streams that wait on something)."""
        self._at_end.append(callback)

    def begin(self, grace_s: float) -> None:
        delay = max(0.0, grace_s - min(0.5, grace_s / 2))
        self._end = time.monotonic() + delay
        for callback in self._at_end:
            timer = threading.Timer(delay, callback)
            timer.daemon = True
            timer.start()

    def check(self) -> None:
        """Raises Unavailable once a draining service's streams must end."""
        if self._end is not None and time.monotonic() >= self._end:
            raise Unavailable(f"the {self._service} is shutting down and the stream did not finish in its grace period")


class Service:
    """A gRPC server with health and reflection, stopped gracefully by a signal.

    At most max_workers calls run at once (one handler thread each); gRPC answers calls
    beyond that RESOURCE_EXHAUSTED instead of queueing them without bound."""

    def __init__(
        self, name: str, listen: str, max_workers: int, grace_s: float, max_message_bytes: int = 4 * 2**20
    ) -> None:
        self.name = name
        self.listen = listen
        self.grace_s = grace_s
        self.drain = Drain(f"{name} service")
        self.server = grpc.server(
            futures.ThreadPoolExecutor(max_workers=max_workers, thread_name_prefix=name),
            maximum_concurrent_rpcs=max_workers,
            options=[("grpc.max_receive_message_length", max_message_bytes)],
        )
        self.health = health.HealthServicer()
        health_pb2_grpc.add_HealthServicer_to_server(self.health, self.server)
        self._service_names: list[str] = [health_pb2.DESCRIPTOR.services_by_name["Health"].full_name]
        # Written by Python's C-level signal handler on whichever thread the signal lands.
        self._wake_reader, self._wake_writer = socket.socketpair()
        self._wake_writer.setblocking(False)

    def add(self, full_name: str, register: Callable[[grpc.Server], None]) -> None:
        """Registers a servicer (via its generated add_*_to_server) under its full name."""
        register(self.server)
        self._service_names.append(full_name)

    def start(self) -> None:
        reflection.enable_server_reflection([*self._service_names, reflection.SERVICE_NAME], self.server)
        path = unix_socket_path(self.listen)
        if path is not None:
            path.parent.mkdir(parents=True, exist_ok=True)
            if path.is_socket():
                path.unlink()  # left by a process that did not shut down cleanly
        self.server.add_insecure_port(self.listen)
        self.server.start()
        self.set_serving(True)

    def set_serving(self, serving: bool) -> None:
        """Health of every service name (ignored once shutdown began)."""
        status = health_pb2.HealthCheckResponse.SERVING if serving else health_pb2.HealthCheckResponse.NOT_SERVING
        for name in ["", *self._service_names]:
            self.health.set(name, status)

    def wait_for_signal(self) -> None:
        """Blocks until SIGTERM or SIGINT.

        The kernel may hand a process's signal to any of its threads (grpc's, torch's), and
        then a main thread asleep on a lock never runs the Python handler; it does wake
        from the wakeup fd, which the C-level handler writes on every thread."""
        stop = {signal.SIGTERM, signal.SIGINT}
        for sig in stop:
            signal.signal(sig, lambda *_: None)  # the wakeup fd says which signal came
        signal.set_wakeup_fd(self._wake_writer.fileno(), warn_on_full_buffer=False)
        while not stop.intersection(self._wake_reader.recv(64)):
            pass

    def stop(self) -> None:
        """Stops accepting calls and gives in-flight calls the grace period to finish."""
        self.health.enter_graceful_shutdown()
        self.drain.begin(self.grace_s)
        self.server.stop(self.grace_s).wait()
        path = unix_socket_path(self.listen)
        if path is not None and path.is_socket():
            path.unlink()


def remaining_timeout(context: grpc.ServicerContext) -> float | None:
    """The caller's remaining deadline in seconds, to pass on downstream; None if unset."""
    remaining = context.time_remaining()
    # grpc reports "no deadline" as a practically infinite time remaining.
    return remaining if remaining is not None and remaining < 10**8 else None
