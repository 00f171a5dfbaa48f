"""Load: N concurrent clients stream completions through the gateway for T seconds.

    python -m bench.load --clients 16 --seconds 30            # starts the default pair
    python -m bench.load --gateway 127.0.0.1:50051 --clients 4

Each client sends one request after another (held-out prompts, in turn) until T has
passed, then finishes the request it has in flight. Each speculation mode given runs once
per client count. Reported (stdout, and --json): completed requests/s and tokens/s over
the whole run, time to first token and inter-token latency (p50, p99), rounds and the
draft tokens proposed and accepted in them, and errors by status code. Inter-token
latency is per token: a message bringing n tokens g seconds after the previous one counts
n gaps of g/n.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import threading
import time
from collections import Counter
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import TextIO

import grpc
import numpy as np

from specdec import defaults
from specdec.client import connect
from specdec.launcher import Stack, StackConfig, free_port
from specdec.requests import SPECULATION_MODES
from specdec.v1 import common_pb2, generation_pb2

PROGRESS_S = 5.0  # a progress line this often


@dataclass(frozen=True)
class LoadConfig:
    gateway: str  # address of a running gateway
    clients: int
    seconds: float
    max_new_tokens: int
    speculation: str  # a key of SPECULATION_MODES
    prompts: list[str]


@dataclass
class Tally:
    """What the clients measured, merged under a lock."""

    requests: int = 0
    tokens: int = 0
    rounds: int = 0  # from each completed stream's usage (target-only rounds count)
    proposed: int = 0  # draft tokens
    accepted: int = 0
    ttft_s: list[float] = field(default_factory=list)
    itl_s: list[float] = field(default_factory=list)
    errors: Counter = field(default_factory=Counter)
    lock: threading.Lock = field(default_factory=threading.Lock)


@dataclass
class Streamed:
    """One completed stream as its client saw it."""

    token_ids: list[int]
    ttft_s: float | None  # until the first message with tokens
    gaps_s: list[float]  # one per token after the first message's: a message of n tokens is n equal gaps
    usage: common_pb2.Usage | None  # from the final message
    choices: Counter[str] = field(default_factory=Counter)  # rounds by how AUTO chose their k ("BEST_K", ...)


CHOICE_NAMES = {v: k.removeprefix("AUTO_CHOICE_") for k, v in common_pb2.AutoChoice.items()}


def timed_stream(stub, req: generation_pb2.GenerateRequest) -> Streamed:
    """Runs one Generate call to its end, timing each token's arrival (grpc.RpcError on failure)."""
    streamed = Streamed([], None, [], None)
    start = last = time.perf_counter()
    for message in stub.Generate(req, timeout=600):
        now, n = time.perf_counter(), len(message.token_ids)
        if n and streamed.ttft_s is None:
            streamed.ttft_s = now - start
        elif n:
            streamed.gaps_s += [(now - last) / n] * n
        if n:
            last = now
        streamed.token_ids += message.token_ids
        if message.round.auto_choice:
            streamed.choices[CHOICE_NAMES[message.round.auto_choice]] += 1
        if message.finish_reason:
            streamed.usage = message.usage
    return streamed


def one_request(stub, req: generation_pb2.GenerateRequest, tally: Tally) -> None:
    try:
        streamed = timed_stream(stub, req)
    except grpc.RpcError as err:
        with tally.lock:
            tally.errors[err.code().name] += 1
        return
    with tally.lock:
        tally.requests += 1
        tally.tokens += len(streamed.token_ids)
        if streamed.usage is not None:
            tally.rounds += streamed.usage.rounds
            tally.proposed += streamed.usage.draft_tokens_proposed
            tally.accepted += streamed.usage.draft_tokens_accepted
        if streamed.ttft_s is not None:
            tally.ttft_s.append(streamed.ttft_s)
        tally.itl_s += streamed.gaps_s


def run_load(config: LoadConfig, progress: TextIO = sys.stderr) -> dict:
    tally = Tally()
    end = time.monotonic() + config.seconds
    mode = SPECULATION_MODES[config.speculation]

    def client(index: int) -> None:
        channel, stub = connect(config.gateway)
        with channel:
            i = index
            while time.monotonic() < end:
                req = generation_pb2.GenerateRequest(
                    text=config.prompts[i % len(config.prompts)], max_new_tokens=config.max_new_tokens
                )
                req.speculation.mode = mode
                one_request(stub, req, tally)
                i += config.clients

    started = time.monotonic()
    threads = [threading.Thread(target=client, args=(i,), daemon=True) for i in range(config.clients)]
    for thread in threads:
        thread.start()
    next_report = started + PROGRESS_S
    for thread in threads:
        while thread.is_alive():
            thread.join(timeout=max(0.0, next_report - time.monotonic()))
            if time.monotonic() >= next_report:
                next_report += PROGRESS_S
                with tally.lock:
                    done, tokens, errors = tally.requests, tally.tokens, sum(tally.errors.values())
                print(f"  {time.monotonic() - started:5.1f} s: {done} requests, {tokens} tokens, {errors} errors", file=progress, flush=True)
    wall = time.monotonic() - started
    return report(config, tally, wall)


def _percentiles_ms(values: list[float]) -> dict[str, float]:
    if not values:
        return {"p50": 0.0, "p99": 0.0}
    p50, p99 = np.percentile(np.array(values) * 1e3, [50, 99])
    return {"p50": round(float(p50), 3), "p99": round(float(p99), 3)}


def report(config: LoadConfig, tally: Tally, wall_s: float) -> dict:
    settings = {k: v for k, v in asdict(config).items() if k != "prompts"}
    return {
        **settings,
        "wall_s": round(wall_s, 3),
        "requests": tally.requests,
        "tokens": tally.tokens,
        "errors": dict(tally.errors),
        "requests_per_s": round(tally.requests / wall_s, 3),
        "tokens_per_s": round(tally.tokens / wall_s, 1),
        "rounds": tally.rounds,
        "draft_tokens_proposed": tally.proposed,
        "draft_tokens_accepted": tally.accepted,
        "acceptance_rate": round(tally.accepted / tally.proposed, 3) if tally.proposed else 0.0,
        "ttft_ms": _percentiles_ms(tally.ttft_s),
        "itl_ms": _percentiles_ms(tally.itl_s),
    }


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.load", description=__doc__.split("\n\n")[0])
    parser.add_argument("--gateway", default="", help="a running gateway; default: start the services on --target/--draft")
    parser.add_argument("--target", default=defaults.DEFAULT_TARGET, help="target model when starting the services")
    parser.add_argument("--draft", default=defaults.DEFAULT_DRAFT, help="draft model when starting the services")
    parser.add_argument("--clients", type=int, nargs="+", default=[1, 4, 16], help="concurrent clients; several values run one after another")
    parser.add_argument("--seconds", type=float, default=30.0, help="how long each run starts new requests")
    parser.add_argument("--max-new-tokens", type=int, default=128, help="tokens per request")
    parser.add_argument(
        "--speculation", choices=tuple(SPECULATION_MODES), nargs="+", default=["auto"],
        help="speculation modes; several run one after another at each client count",
    )
    parser.add_argument("--json", default="", help="write the reports to this file")
    args = parser.parse_args(argv)
    prompts = defaults.heldout_prompts()

    stack = None
    gateway = args.gateway
    if not gateway:
        gateway = f"127.0.0.1:{free_port()}"
        workdir = Path(tempfile.mkdtemp(prefix="specdec-load-"))
        stack = Stack(StackConfig(target=args.target, draft=args.draft, workdir=workdir, gateway_address=gateway))
        print(f"starting the services (logs in {workdir}) ...", file=sys.stderr, flush=True)
        stack.start()
    reports = []
    try:
        for clients in args.clients:
            for mode in args.speculation:
                config = LoadConfig(gateway, clients, args.seconds, args.max_new_tokens, mode, prompts)
                print(f"{clients} clients, speculation {mode}, for {args.seconds:.0f} s:", file=sys.stderr, flush=True)
                reports.append(run_load(config))
                r = reports[-1]
                print(
                    f"clients {clients:3d}  speculation {mode:4s}  requests/s {r['requests_per_s']:7.2f}  "
                    f"tokens/s {r['tokens_per_s']:8.1f}  TTFT p50/p99 {r['ttft_ms']['p50']:.1f}/{r['ttft_ms']['p99']:.1f} ms  "
                    f"ITL p50/p99 {r['itl_ms']['p50']:.2f}/{r['itl_ms']['p99']:.2f} ms  "
                    f"draft tokens per round {r['draft_tokens_proposed'] / max(1, r['rounds']):.1f}  "
                    f"acceptance {r['acceptance_rate']:.2f}  errors {r['errors'] or 0}",
                    flush=True,
                )
    finally:
        if stack is not None:
            stack.stop()
    if args.json:
        Path(args.json).write_text(json.dumps(reports, indent=1) + "\n")
    return 1 if any(r["errors"] for r in reports) else 0


if __name__ == "__main__":
    sys.exit(main())
