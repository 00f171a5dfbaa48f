"""The `specdec` command: serve, demo, generate."""

from __future__ import annotations

import argparse
import json
import os
import signal
import sys
import tempfile
import threading
from collections.abc import Sequence
from pathlib import Path

import grpc
from google.protobuf import json_format

from specdec import defaults, doctor
from specdec.arg_types import INT32_MAX, PORT, SECONDS, UINT64_MAX, float_in, int_in
from specdec.client import connect, generate
from specdec.launcher import Stack, StackConfig, StackError
from specdec.requests import SPECULATION_MODES as MODES
from specdec.supervisor import Supervisor
from specdec.v1 import generation_pb2

DEMO_PROMPT = 'def parse_header(line):\n    """Split an HTTP header line into its name and value."""\n'
MAX_NEW_TOKENS = int_in(1, INT32_MAX)  # the request's int32; the server checks its own, lower limit
DRAFT_TOKENS = int_in(1, defaults.MAX_DRAFT_TOKENS)


def _env(name: str, default: str) -> str:
    return os.environ.get(name, default)


def _add_model_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--target", default=_env("SPECDEC_TARGET", defaults.DEFAULT_TARGET), help="target model: path or hub id (default: the embedded pair)")
    parser.add_argument("--draft", default=_env("SPECDEC_DRAFT", defaults.DEFAULT_DRAFT), help="draft model: path or hub id (default: the embedded pair)")
    parser.add_argument("--device", default=_env("SPECDEC_DEVICE", "cpu"), help="torch device of both models")


def _stack_config(args: argparse.Namespace, gateway_address: str, workdir: Path) -> StackConfig:
    return StackConfig(
        target=args.target,
        draft=args.draft,
        workdir=workdir,
        gateway_address=gateway_address,
        device=args.device,
    )


def cmd_serve(args: argparse.Namespace) -> int:
    workdir = Path(args.workdir) if args.workdir else Path(tempfile.mkdtemp(prefix="specdec-"))
    config = _stack_config(args, f"{args.host}:{args.port}", workdir)
    stack = Stack(config)
    stop = threading.Event()
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, lambda *_: stop.set())
    try:
        stack.start()
    except StackError as err:
        stack.stop()
        print(f"specdec serve: {err}", file=sys.stderr)
        return 1
    print(
        f"specdec ready: gateway {config.gateway_address}, verify {config.verify_address}, "
        f"draft {config.draft_address} (target {config.target}, draft {config.draft}; logs in {workdir})",
        flush=True,
    )
    Supervisor(stack).run(stop)  # restarts a service that exits; only a signal stops them all
    codes = stack.stop()
    print(f"specdec stopped: {', '.join(f'{n} exit {c}' for n, c in codes.items())}", flush=True)
    return 0 if all(c == 0 for c in codes.values()) else 1


def _request(args: argparse.Namespace, prompt: str) -> generation_pb2.GenerateRequest:
    request = generation_pb2.GenerateRequest(text=prompt, stop=args.stop)
    for name in ("max_new_tokens", "temperature", "top_k", "top_p", "seed"):
        value = getattr(args, name)
        if value is not None:
            setattr(request, name, value)
    if args.speculation is not None:
        request.speculation.mode = MODES[args.speculation]
    if args.num_draft_tokens is not None:
        request.speculation.num_draft_tokens = args.num_draft_tokens
    return request


def cmd_generate(args: argparse.Namespace) -> int:
    prompt = sys.stdin.read() if args.prompt == "-" else args.prompt
    channel, stub = connect(args.gateway)

    def show(message: generation_pb2.GenerateResponse) -> None:
        if args.json:
            print(json.dumps(json_format.MessageToDict(message, preserving_proto_field_name=True)), flush=True)
        else:
            print(message.text, end="", flush=True)

    try:
        completion = generate(stub, _request(args, prompt), timeout=args.timeout, on_message=show)
    except grpc.RpcError as err:
        print(f"\nspecdec generate: {err.code().name}: {err.details()}", file=sys.stderr)
        return 1
    finally:
        channel.close()
    if args.json:
        summary = {
            "token_ids": completion.token_ids,
            "text": completion.text,
            "finish_reason": completion.finish_reason,
            "usage": json_format.MessageToDict(completion.usage, preserving_proto_field_name=True),
            "acceptance_rate": completion.usage.acceptance_rate,
            "tokens_per_second": completion.tokens_per_s,
            "trace_id": completion.trace_id,
        }
        print(json.dumps(summary), flush=True)
    else:
        print(flush=True)
    return 0


def cmd_demo(args: argparse.Namespace) -> int:
    with tempfile.TemporaryDirectory(prefix="specdec-demo-") as tmp:
        config = _stack_config(args, f"127.0.0.1:{args.port}", Path(tmp))
        print(f"specdec demo: starting draft ({config.draft}), verify ({config.target}) and gateway ...", flush=True)
        try:
            with Stack(config):
                return _demo_runs(args, config)
        except StackError as err:
            print(f"specdec demo: {err}", file=sys.stderr)
            return 1


def _demo_runs(args: argparse.Namespace, config: StackConfig) -> int:
    channel, stub = connect(config.gateway_address)
    results = {}
    with channel:
        for mode in ("on", "auto", "off"):
            request = generation_pb2.GenerateRequest(text=args.prompt, max_new_tokens=args.max_new_tokens)
            request.speculation.mode = MODES[mode]
            if mode == "on":
                request.speculation.num_draft_tokens = args.num_draft_tokens
            warmup = generation_pb2.GenerateRequest()
            warmup.CopyFrom(request)
            warmup.max_new_tokens = 8
            generate(stub, warmup)  # first calls pay one-off costs; keep them out of the figures
            print(f"\n--- speculation {mode} ---\n{args.prompt}", end="", flush=True)
            results[mode] = generate(stub, request, on_message=lambda m: print(m.text, end="", flush=True))
            print(flush=True)
    off = results["off"]
    print(f"\n{'':16}{'tokens':>8}{'seconds':>10}{'tokens/s':>10}{'acceptance':>12}{'rounds':>8}{'speedup':>9}")
    for mode, c in results.items():
        acceptance = f"{c.usage.acceptance_rate:.2f}" if c.usage.draft_tokens_proposed else "-"
        speedup = c.tokens_per_s / off.tokens_per_s
        print(f"speculation {mode:<4}{len(c.token_ids):>8}{c.elapsed_s:>10.2f}{c.tokens_per_s:>10.1f}{acceptance:>12}{c.usage.rounds:>8}{speedup:>8.2f}x")
    ks = sorted({m.round.draft_tokens for m in results["auto"].messages if m.round.draft_tokens})
    print(f"on: k={args.num_draft_tokens} every round; auto: k in {ks or 'none (target-only)'}")
    same = "yes" if results["on"].token_ids == off.token_ids == results["auto"].token_ids else "NO"
    print(f"outputs identical: {same}")
    return 0 if same == "yes" else 1


def cmd_doctor(args: argparse.Namespace) -> int:
    gateway = args.gateway or _env("SPECDEC_GATEWAY", defaults.GATEWAY_ADDRESS)
    where = args.verify or gateway
    try:
        info = doctor.fetch_info(args.verify, gateway, args.requests, args.timeout)
    except grpc.RpcError as err:
        print(f"specdec doctor: cannot ask {where}: {err.code().name}: {err.details()}", file=sys.stderr)
        return 2
    found = doctor.checks(info)
    print(json.dumps(doctor.report_json(found, info), indent=1) if args.json else doctor.report_text(found))
    return 0 if all(c.verdict != doctor.FAIL for c in found) else 1


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="specdec", description="Speculative decoding as a gRPC service pair.")
    sub = parser.add_subparsers(dest="command", required=True)

    serve = sub.add_parser(
        "serve", help="run draft, verify and gateway on this machine until Ctrl-C, restarting any that exits"
    )
    _add_model_args(serve)
    serve.add_argument("--host", default=_env("SPECDEC_HOST", "127.0.0.1"), help="gateway host to listen on")
    serve.add_argument("--port", type=PORT, default=_env("SPECDEC_PORT", "50051"), help="gateway port")
    serve.add_argument("--workdir", default=_env("SPECDEC_WORKDIR", ""), help="folder for sockets and logs (default: a new temporary one)")
    serve.set_defaults(func=cmd_serve)

    demo = sub.add_parser("demo", help="start the services, stream a prompt with and without speculation, print the figures")
    _add_model_args(demo)
    demo.add_argument("--port", type=PORT, default=_env("SPECDEC_DEMO_PORT", "50061"), help="gateway port of the demo")
    demo.add_argument("--prompt", default=DEMO_PROMPT, help="prompt to complete")
    demo.add_argument("--max-new-tokens", type=MAX_NEW_TOKENS, default=256)
    demo.add_argument("--num-draft-tokens", type=DRAFT_TOKENS, default=defaults.NUM_DRAFT_TOKENS)
    demo.set_defaults(func=cmd_demo)

    gen = sub.add_parser("generate", help="stream a completion from a running gateway")
    gen.add_argument("prompt", help="prompt text, or - to read it from standard input")
    gen.add_argument("--gateway", default=_env("SPECDEC_GATEWAY", defaults.GATEWAY_ADDRESS), help="gateway HOST:PORT")
    gen.add_argument("--max-new-tokens", type=MAX_NEW_TOKENS, help="tokens to generate at most; the server caps it too")
    gen.add_argument("--temperature", type=float_in(0.0), help="softmax temperature; 0 is greedy")
    gen.add_argument("--top-k", type=int_in(0, INT32_MAX), help="keep the k most likely tokens; 0 disables")
    gen.add_argument("--top-p", type=float_in(0.0, 1.0, above=True), help="nucleus sampling mass in (0, 1]")
    gen.add_argument("--seed", type=int_in(0, UINT64_MAX), help="seed for reproducible sampling")
    gen.add_argument("--stop", action="append", default=[], help="stop sequence (repeatable)")
    gen.add_argument(
        "--speculation", choices=sorted(MODES), help="auto, on or off (default: the server's, auto unless configured)"
    )
    gen.add_argument("--num-draft-tokens", type=DRAFT_TOKENS, help="draft tokens per round in mode on (default 4)")
    gen.add_argument("--timeout", type=SECONDS, default=None, help="deadline of the request, in seconds")
    gen.add_argument("--json", action="store_true", help="one JSON object per streamed message, then a summary")
    gen.set_defaults(func=cmd_generate)

    sub.add_parser(
        "bench",
        add_help=False,  # its own options, see `specdec bench --help`
        help="speculation against target-only and against transformers' assisted generation, side by side; "
        "--load: AUTO against the peers' schedules of k under load",
    ).set_defaults(func=None)

    doc = sub.add_parser(
        "doctor", help="check the deployment guide's five points and load against live services (exit 1 when one fails)"
    )
    doc.add_argument("--gateway", help="gateway HOST:PORT to ask (default $SPECDEC_GATEWAY or 127.0.0.1:50051)")
    doc.add_argument("--verify", help="verify service address to ask directly instead (host:port or unix:///path)")
    doc.add_argument(
        "--requests", type=int_in(1, defaults.RECENT_CAPACITY), default=100,
        help="recent requests the length and acceptance checks cover",
    )  # fmt: skip
    doc.add_argument("--timeout", type=SECONDS, default=10.0, help="deadline of the query, in seconds")
    doc.add_argument("--json", action="store_true", help="one JSON object: each check's verdict and figure")
    doc.set_defaults(func=cmd_doctor)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    args, rest = parser.parse_known_args(argv)
    if args.command == "bench":
        if "--load" in rest:  # the load sweep: AUTO against the peers' schedules of k
            from bench.load_sweep import main as load_main

            return load_main([a for a in rest if a != "--load"])
        from bench.benchmark import main as bench_main  # loads transformers' generate only when asked

        return bench_main(rest)
    if rest:
        parser.error(f"unrecognized arguments: {' '.join(rest)}")
    return args.func(args)


if __name__ == "__main__":
    sys.exit(main())
