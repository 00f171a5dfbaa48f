"""Batching's gains, as ratios of runs interleaved in one process: the same work one
request at a time and with 16 in flight, through the services and in process.

    python -m bench.batching --json bench/results/cpu/batching.json
    python -m bench.batching --baseline /path/to/an/older/checkout   # with an A/B at 1 and 16
    python -m bench.batching --baseline /path/to/an/older/checkout --pairs 8 --launches 6

Work: 32 distinct held-out prompts (the committed ones, then the same files' prompts
without their first line) x 128 greedy tokens. tokens/s = completion tokens / wall time
from the first send to the last token. Each repeat runs every configuration once, in
turn; the report gives medians over repeats and the ratios of medians:
  services   target-only and ON (k = 4) through the gateway, 1 and 16 in flight, with
             time to first token and inter-token latency p50/p99
  in process target-only rounds on the batched runtime and the verifier's lockstep
             forward, no RPC: the ceiling of what the services can reach
  baseline   (with --baseline) the same runs on the services of another checkout,
             started beside ours
  pairs      (with --baseline and --pairs) one stream alone, ours against the baseline's:
             alternating pairs of runs of 4 prompts, both stacks started afresh for every
             launch. A process's speed at one forward moves by several percent from one
             start to the next (where its weights and pool landed in memory), so pairs
             from one launch measure that launch's luck; the ratios pool every launch's.
"""

from __future__ import annotations

import argparse
import json
import queue
import statistics
import sys
import tempfile
import threading
import time
from collections.abc import Sequence
from pathlib import Path

import torch
from transformers import AutoTokenizer

from bench.load import Tally, _percentiles_ms, one_request
from specdec import defaults, host
from specdec.client import connect
from specdec.launcher import Stack, StackConfig, free_port
from specdec.runtime import CausalLM, ModelSpec
from specdec.sampling import SamplingParams
from specdec.v1 import common_pb2, generation_pb2
from verify_service.verifier import NO_DRAFT, Prefill, Release, Verifier, Verify

PROMPTS = 32
MAX_NEW_TOKENS = 128
MODES = {
    "target-only": (common_pb2.SPECULATION_MODE_OFF, 0),
    "on-k4": (common_pb2.SPECULATION_MODE_ON, 4),
    "auto": (common_pb2.SPECULATION_MODE_AUTO, 0),
}


def distinct_prompts(count: int) -> list[str]:
    """The held-out prompts, then the same prompts without their first line, deduplicated."""
    texts = defaults.heldout_prompts()
    shorter = [t.split("\n", 1)[1] for t in texts if "\n" in t and t.split("\n", 1)[1].strip()]
    out = list(dict.fromkeys(texts + shorter))
    if len(out) < count:
        raise SystemExit(f"only {len(out)} distinct held-out prompts, {count} asked for")
    return out[:count]


def through_services(
    gateway: str, prompts: Sequence[str | list[int]], in_flight: int, mode: str, max_new_tokens: int = MAX_NEW_TOKENS
) -> dict:
    """Every prompt (text or token ids) once, greedy, `in_flight` streams at a time;
    tokens/s over the whole wall time, with TTFT and ITL percentiles."""
    speculation, k = MODES[mode]
    work: queue.SimpleQueue[str | list[int]] = queue.SimpleQueue()
    for prompt in prompts:
        work.put(prompt)
    tally = Tally()

    def client() -> None:
        channel, stub = connect(gateway)
        with channel:
            while True:
                try:
                    prompt = work.get_nowait()
                except queue.Empty:
                    return
                req = generation_pb2.GenerateRequest(max_new_tokens=max_new_tokens, temperature=0.0)
                if isinstance(prompt, str):
                    req.text = prompt
                else:
                    req.token_ids.ids.extend(prompt)
                req.speculation.mode = speculation
                if k:
                    req.speculation.num_draft_tokens = k
                one_request(stub, req, tally)

    threads = [threading.Thread(target=client, daemon=True) for _ in range(in_flight)]
    start = time.perf_counter()
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    wall = time.perf_counter() - start
    if tally.errors:
        raise SystemExit(f"errors through the services: {dict(tally.errors)}")
    return {
        "tokens_per_s": tally.tokens / wall, "tokens": tally.tokens, "wall_s": wall,
        "ttft_ms": _percentiles_ms(tally.ttft_s), "itl_ms": _percentiles_ms(tally.itl_s),
    }  # fmt: skip


def in_process(model: CausalLM, prompts: list[list[int]], in_flight: int) -> dict:
    """Target-only rounds of every prompt on the verifier's lockstep forward, `in_flight`
    sessions at a time, a new one joining as soon as one finishes (continuous batching)."""
    verifier = Verifier(model)
    waiting = list(enumerate(prompts))
    left: dict[str, int] = {}
    tokens = 0
    start = time.perf_counter()
    while waiting or left:
        while waiting and len(left) < in_flight:
            i, ids = waiting.pop(0)
            sid = f"p{i}"
            verifier.open(Prefill(sid, ids, SamplingParams(), seed=i, capacity=len(ids) + MAX_NEW_TOKENS))
            verifier.forward([], {sid: len(ids) - 1})
            left[sid] = MAX_NEW_TOKENS
        rounds = [Verify(sid, NO_DRAFT) for sid in left]
        for step, verified in zip(rounds, verifier.forward(rounds, {}).verified):
            tokens += len(verified.tokens)
            left[step.session_id] -= 1
            if not left[step.session_id]:
                del left[step.session_id]
                verifier.release(Release(step.session_id))
    wall = time.perf_counter() - start
    return {"tokens_per_s": tokens / wall, "tokens": tokens, "wall_s": wall}


def start_stack(checkout: Path | None, threads: int) -> Stack:
    """The default pair's services, from this checkout or (for an A/B) another one."""
    workdir = Path(tempfile.mkdtemp(prefix="specdec-batching-"))
    programs = {}
    if checkout is not None:
        modules = {"draft": "draft_service", "verify": "verify_service", "gateway": "gateway"}
        programs = {service: ["env", "-C", str(checkout), sys.executable, "-m", m] for service, m in modules.items()}
    args = {"verify": ["--threads", str(threads)]} if threads else {}
    config = StackConfig(
        target=str(Path(defaults.DEFAULT_TARGET).resolve()), draft=str(Path(defaults.DEFAULT_DRAFT).resolve()),
        workdir=workdir, gateway_address=f"127.0.0.1:{free_port()}", extra_args=args, programs=programs,
    )  # fmt: skip
    stack = Stack(config)
    stack.start()
    return stack


def single_stream_pairs(baseline: Path, prompts: list[str], launches: int, pairs: int, threads: int) -> dict:
    """ours / baseline tokens/s of one stream alone, per mode: every pair runs the same 4
    prompts on both stacks, in alternating order; medians and quartiles over all pairs."""
    ratios: dict[str, list[float]] = {mode: [] for mode in ("target-only", "on-k4")}
    launch_medians: dict[str, list[float]] = {mode: [] for mode in ratios}
    for launch in range(launches):
        stacks = {"ours": start_stack(None, threads), "baseline": start_stack(baseline, threads)}
        try:
            for mode in ratios:
                for stack in stacks.values():  # warm: the first requests pay one-time costs
                    through_services(stack.config.gateway_address, prompts[:2], 1, mode)
            for mode in ratios:
                these = []
                for i in range(pairs):
                    work = [prompts[(4 * (launch * pairs + i) + j) % len(prompts)] for j in range(4)]
                    order = list(stacks.items()) if i % 2 == 0 else list(stacks.items())[::-1]
                    tps = {
                        name: through_services(s.config.gateway_address, work, 1, mode)["tokens_per_s"]
                        for name, s in order
                    }
                    these.append(tps["ours"] / tps["baseline"])
                ratios[mode] += these
                launch_medians[mode].append(statistics.median(these))
                print(
                    f"[launch {launch + 1}/{launches}] {mode}: ours / baseline median {launch_medians[mode][-1]:.3f}",
                    flush=True,
                )
        finally:
            for stack in stacks.values():
                stack.stop()
    report = {}
    for mode, rs in ratios.items():
        q1, _, q3 = statistics.quantiles(rs, n=4)
        report[mode] = {
            "median": round(statistics.median(rs), 3), "quartiles": [round(q1, 3), round(q3, 3)], "pairs": len(rs),
            "launch_medians": [round(m, 3) for m in launch_medians[mode]],
        }  # fmt: skip
    return report


def summarize(runs: dict[str, list[dict]]) -> dict:
    medians = {name: statistics.median(r["tokens_per_s"] for r in rs) for name, rs in runs.items()}
    ttft_p99 = {
        name: statistics.median(r["ttft_ms"]["p99"] for r in rs) for name, rs in runs.items() if "ttft_ms" in rs[0]
    }

    def ratio(a: str, b: str, of: dict[str, float] = medians) -> float | None:
        return round(of[a] / of[b], 3) if a in of and b in of else None

    ratios = {
        "services target-only 16 / 1": ratio("services target-only x16", "services target-only x1"),
        "services on-k4 16 / 1": ratio("services on-k4 x16", "services on-k4 x1"),
        "in process target-only 16 / 1": ratio("in-process target-only x16", "in-process target-only x1"),
        "single stream target-only ours / baseline": ratio("services target-only x1", "baseline target-only x1"),
        "single stream on-k4 ours / baseline": ratio("services on-k4 x1", "baseline on-k4 x1"),
    }
    for mode in ("target-only", "on-k4"):
        ratios[f"TTFT p99 at 16 in flight, {mode} ours / baseline"] = ratio(
            f"services {mode} x16", f"baseline {mode} x16", ttft_p99
        )
    return {
        "median_tokens_per_s": {k: round(v, 1) for k, v in medians.items()},
        "median_ttft_p99_ms": {k: round(v, 1) for k, v in ttft_p99.items()},
        "ratios": ratios,
    }


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.batching", description=__doc__.split("\n\n")[0])
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--in-flight", type=int, default=16)
    parser.add_argument("--threads", type=int, default=0, help="the verify service's torch threads (0: its default)")
    parser.add_argument("--baseline", default="", help="another checkout whose services run beside ours, single stream")
    parser.add_argument(
        "--pairs", type=int, default=0, help="with --baseline: only the single-stream A/B, pairs a launch"
    )
    parser.add_argument("--launches", type=int, default=6, help="with --pairs: fresh starts of both stacks")
    parser.add_argument("--json", default="", help="write the report to this file")
    args = parser.parse_args(argv)
    prompts = distinct_prompts(PROMPTS)
    machine = {"cpu": host.cpu_model(), "cpus": torch.get_num_threads(), "torch": torch.__version__}
    if args.pairs:
        if not args.baseline:
            parser.error("--pairs needs --baseline")
        work = {"prompts_per_run": 4, "max_new_tokens": MAX_NEW_TOKENS, "greedy": True, "launches": args.launches}
        report = {"machine": machine, "work": work, "single_stream_ours_over_baseline": single_stream_pairs(
            Path(args.baseline), prompts, args.launches, args.pairs, args.threads
        )}  # fmt: skip
        print(json.dumps(report, indent=1))
        if args.json:
            Path(args.json).write_text(json.dumps(report, indent=1) + "\n")
        return 0
    tokenizer = AutoTokenizer.from_pretrained(defaults.DEFAULT_TARGET)
    prompt_ids = [tokenizer.encode(p) for p in prompts]
    model = CausalLM.load(ModelSpec(defaults.DEFAULT_TARGET))
    stacks = {"services": start_stack(None, args.threads)}
    if args.baseline:
        stacks["baseline"] = start_stack(Path(args.baseline), args.threads)
    runs: dict[str, list[dict]] = {}
    try:
        for repeat in range(args.repeats):
            for in_flight in (1, args.in_flight):
                name = f"in-process target-only x{in_flight}"
                runs.setdefault(name, []).append(in_process(model, prompt_ids, in_flight))
                print(
                    f"[{repeat + 1}/{args.repeats}] {name}: {runs[name][-1]['tokens_per_s']:.1f} tokens/s", flush=True
                )
                for mode in ("target-only", "on-k4"):
                    for label, stack in stacks.items():
                        name = f"{label} {mode} x{in_flight}"
                        result = through_services(stack.config.gateway_address, prompts, in_flight, mode)
                        runs.setdefault(name, []).append(result)
                        print(
                            f"[{repeat + 1}/{args.repeats}] {name}: {result['tokens_per_s']:.1f} tokens/s, TTFT p50/p99 "
                            f"{result['ttft_ms']['p50']:.1f}/{result['ttft_ms']['p99']:.1f} ms, ITL p50/p99 "
                            f"{result['itl_ms']['p50']:.2f}/{result['itl_ms']['p99']:.2f} ms",
                            flush=True,
                        )
    finally:
        for stack in stacks.values():
            stack.stop()
    report = {
        "machine": machine,
        "work": {"prompts": PROMPTS, "max_new_tokens": MAX_NEW_TOKENS, "in_flight": args.in_flight, "greedy": True},
        **summarize(runs),
        "runs": runs,
    }
    print(json.dumps({k: report[k] for k in ("machine", "median_tokens_per_s", "ratios")}, indent=1))
    if args.json:
        Path(args.json).write_text(json.dumps(report, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
