"""Shared fixtures: toy model pairs saved like real checkpoints, and real service stacks."""

from __future__ import annotations

import shutil
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

import pytest

from specdec import defaults, fingerprint
from specdec.launcher import Stack, StackConfig, free_port
from specdec.v1 import pairing_pb2
from specdec.toy_models import ToySize, build_model, build_tokenizer, perturbed_copy


@dataclass(frozen=True)
class ToyModels:
    target: Path
    same: Path  # the target's own weights: every greedy proposal is accepted
    close: Path  # the target with noisy weights: partial acceptance
    far: Path  # unrelated weights, same tokenizer: mostly rejected


@pytest.fixture(scope="session")
def toy(tmp_path_factory: pytest.TempPathFactory) -> ToyModels:
    root = tmp_path_factory.mktemp("toy")
    tokenizer = build_tokenizer(root / "tokenizer")
    target = build_model(root / "target", tokenizer, ToySize(), seed=0)
    same = Path(shutil.copytree(target, root / "same"))
    close = perturbed_copy(target, root / "close", noise=0.05, seed=1)
    far = build_model(root / "far", tokenizer, ToySize(), seed=7)
    return ToyModels(target, same, close, far)


StackFactory = Callable[..., Stack]


NO_EXPORT = {"OTEL_EXPORTER_OTLP_ENDPOINT": "", "OTEL_EXPORTER_OTLP_TRACES_ENDPOINT": ""}


def start_stack(
    tmp_path_factory: pytest.TempPathFactory,
    target: Path,
    draft: Path,
    with_draft: bool = True,
    args: dict[str, list[str]] | None = None,
    draft_tcp: str = "",
    programs: dict[str, list[str]] | None = None,
    env: dict[str, str] | None = None,
) -> Stack:
    # unix socket paths must stay under ~100 characters
    workdir = Path(tmp_path_factory.mktemp("stack", numbered=True))
    config = StackConfig(
        target=str(target),
        draft=str(draft),
        workdir=workdir,
        gateway_address=f"127.0.0.1:{free_port()}",
        with_draft=with_draft,
        extra_args=args or {},
        draft_tcp=draft_tcp,
        programs=programs or {},
        env=env or {},
    )
    stack = Stack(config)
    try:
        stack.start()
    except BaseException:
        stack.stop()
        raise
    return stack


def stop_all(stacks: list[Stack]) -> None:
    # Together: each stop waits for its services' graceful shutdown, seconds apiece.
    with ThreadPoolExecutor(max(1, len(stacks))) as pool:
        list(pool.map(Stack.stop, stacks))


@pytest.fixture(scope="session")
def session_stacks() -> Iterator[list[Stack]]:
    """The stacks started once per session, stopped together when it ends."""
    stacks: list[Stack] = []
    yield stacks
    stop_all(stacks)


@pytest.fixture(scope="session")
def shared_stack(toy: ToyModels, tmp_path_factory: pytest.TempPathFactory, session_stacks: list[Stack]) -> Stack:
    """The default stack (toy target, close draft over a unix socket, default flags, no
    trace export), started once for the tests that only send it requests and read it:
    starting a stack costs seconds of CPU per service."""
    session_stacks.append(start_stack(tmp_path_factory, toy.target, toy.close, env=NO_EXPORT))
    return session_stacks[-1]


@pytest.fixture(scope="session")
def default_pair_stack(tmp_path_factory: pytest.TempPathFactory, session_stacks: list[Stack]) -> Stack:
    """The embedded pair (models/target, models/draft), started once: its verify service
    also measures the target's forward costs for seconds before it serves."""
    target, draft = Path(defaults.DEFAULT_TARGET), Path(defaults.DEFAULT_DRAFT)
    # Patient draft deadlines: its tests assert on speculation, which a missed deadline
    # turns off for the rest of a request.
    args = {"verify": ["--threads", "2", "--draft-deadline-min-ms", "10000"]}
    session_stacks.append(start_stack(tmp_path_factory, target, draft, args=args, env=NO_EXPORT))
    return session_stacks[-1]


@pytest.fixture(scope="session")
def far_stack(toy: ToyModels, tmp_path_factory: pytest.TempPathFactory, session_stacks: list[Stack]) -> Stack:
    """The toy target with the `far` draft (same tokenizer, unrelated weights), started once."""
    session_stacks.append(start_stack(tmp_path_factory, toy.target, toy.far, env=NO_EXPORT))
    return session_stacks[-1]


@pytest.fixture(scope="module")
def stack_factory(tmp_path_factory: pytest.TempPathFactory) -> Iterator[StackFactory]:
    """Starts real draft/verify/gateway processes; all are stopped when the module ends."""
    stacks: list[Stack] = []

    def start(target: Path, draft: Path, **kwargs) -> Stack:
        stacks.append(start_stack(tmp_path_factory, target, draft, **kwargs))
        return stacks[-1]

    yield start
    stop_all(stacks)


BOOT = "b7c1f2a0-1111-4c4c-9e9e-000000000001"


@pytest.fixture
def facts(toy):
    target_fp = fingerprint.load_fingerprint(str(toy.target))

    def make(gpu: str = "", boot: str = BOOT, host: str = "node-a", tokenizer=None, total: int = 100, used: int = 10):
        return pairing_pb2.PeerFacts(
            host=pairing_pb2.HostIdentity(boot_id=boot, hostname=host, pid=1),
            device=pairing_pb2.DeviceFacts(device="cuda:0" if gpu else "cpu", gpu_uuid=gpu),
            model=pairing_pb2.ModelFacts(vocab_size=400),
            tokenizer=tokenizer or target_fp,
            memory=pairing_pb2.MemoryFacts(kind="host", total_bytes=total, weights_bytes=5, used_bytes=used, kv_budget_bytes=10),
        )

    return make
