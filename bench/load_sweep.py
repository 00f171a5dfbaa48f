"""`specdec bench --load`: AUTO against the peers' schedules of k under load, on one engine.

    specdec bench --load                 # the embedded pair: closed and open loop (under an hour here)
    specdec bench --load --quick         # a few seconds a point, two stream counts, one rate

Two stacks serve the same pair: one under `--speculation-policy goodput` (AUTO's batch
chooser; it also serves fixed k and target-only, asked per request) and one under `table`
(MLC's schedule: k by requests in flight). Both raise `--max-sessions` to the most streams
measured, so the widest point measures decoding, not queueing. Each point runs every
policy: auto, table, fixed k = 2, 4, 8 (ON) and target-only (OFF), in turn, `repeats` times
with the order reversed every other repeat (paired, interleaved: this host's speed drifts).

- Closed loop: N streams in flight, each sending one request after another for `seconds`.
- Open loop: requests arrive as a seeded Poisson process at fractions of the saturation
  rate (target-only's requests/s at the most streams of the closed loop), each stream
  bounded by `seconds`; a request meets the objective when its time to first token and
  its inter-token latency p99 are within `slo_ttft_ms` and `slo_itl_ms`.

For every point: aggregate tokens/s, requests/s, TTFT and inter-token latency p50/p99 (over
every token's gap, a message of n tokens counting as n equal gaps; and over requests, each
request's mean gap after its first token, which is how AIPerf and genai-perf count it) and,
for every completed request, whether its tokens equal target-only's for the same prompt
(greedy) or the same prompt and seed (sampled: the shared-noise coupling keeps them equal).
A third stack pairs the target with a mismatched draft (the draft's architecture with
untrained weights) for AUTO against target-only at `mismatched_streams` streams.

Written: load.json, load.md (tables, AUTO over the best fixed schedule) and load.png
(tokens/s against streams in flight, one curve per policy).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import threading
import time
from collections import Counter
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path

import grpc
import numpy as np

from bench.benchmark import mismatched_draft
from bench.flags import config_from_args
from bench.load import timed_stream
from specdec import defaults
from specdec.client import connect
from specdec.launcher import Stack, StackConfig, free_port
from specdec.v1 import common_pb2, generation_pb2

# policy -> (the stack that serves it, the request's speculation mode, its k)
POLICIES: dict[str, tuple[str, int, int]] = {
    "auto": ("goodput", common_pb2.SPECULATION_MODE_AUTO, 0),
    "table": ("table", common_pb2.SPECULATION_MODE_AUTO, 0),
    "k=2": ("goodput", common_pb2.SPECULATION_MODE_ON, 2),
    "k=4": ("goodput", common_pb2.SPECULATION_MODE_ON, 4),
    "k=8": ("goodput", common_pb2.SPECULATION_MODE_ON, 8),
    "target-only": ("goodput", common_pb2.SPECULATION_MODE_OFF, 0),
}
FIXED = ("k=2", "k=4", "k=8", "target-only")  # the schedules AUTO is held against


@dataclass(frozen=True)
class SweepConfig:
    target: str = defaults.DEFAULT_TARGET
    draft: str = defaults.DEFAULT_DRAFT
    streams: tuple[int, ...] = (1, 2, 4, 8, 16, 32)
    rates: tuple[float, ...] = (0.5, 0.8, 1.0, 1.2)  # open loop, in multiples of the saturation rate
    temperatures: tuple[float, ...] = (0.0, 0.8)
    policies: tuple[str, ...] = tuple(POLICIES)
    seconds: float = 10.0  # each point's requests start within this long
    repeats: int = 3
    max_new_tokens: int = 128
    prompts: int = 16  # held-out prompts, in turn
    slo_ttft_ms: float = 1000.0
    slo_itl_ms: float = 100.0
    seed: int = 0
    # Closed-loop points of a stack whose draft is mismatched (the draft's architecture with
    # untrained weights): AUTO against target-only; () for none.
    mismatched_streams: tuple[int, ...] = (1, 16)
    out: Path = Path("bench/results/cpu")


QUICK = {
    "streams": (1, 4), "rates": (1.0,), "temperatures": (0.0,), "seconds": 2.0, "repeats": 1, "prompts": 4,
    "mismatched_streams": (1,),
}  # fmt: skip


@dataclass
class Point:
    """What one run of one policy at one point measured."""

    tokens: int = 0
    requests: int = 0
    ttft_s: list[float] = field(default_factory=list)
    itl_s: list[float] = field(default_factory=list)
    per_request_itl_p99_s: list[float] = field(default_factory=list)
    request_itl_s: list[float] = field(default_factory=list)  # each request's mean gap (AIPerf's inter-token latency)
    outputs: list[tuple[int, list[int]]] = field(default_factory=list)  # (prompt index, tokens)
    errors: dict[str, int] = field(default_factory=dict)
    choices: Counter[str] = field(default_factory=Counter)  # AUTO's rounds by how it chose their k
    lock: threading.Lock = field(default_factory=threading.Lock)


def _request(prompt: str, index: int, policy: str, temperature: float, max_new_tokens: int):
    _, mode, k = POLICIES[policy]
    req = generation_pb2.GenerateRequest(
        text=prompt, max_new_tokens=max_new_tokens, temperature=temperature, seed=1000 + index
    )
    req.speculation.mode = mode
    if k:
        req.speculation.num_draft_tokens = k
    return req


def _one(stub, req: generation_pb2.GenerateRequest, index: int, point: Point) -> None:
    try:
        streamed = timed_stream(stub, req)
    except grpc.RpcError as err:
        with point.lock:
            point.errors[err.code().name] = point.errors.get(err.code().name, 0) + 1
        return
    ttft, gaps = streamed.ttft_s, streamed.gaps_s
    with point.lock:
        point.requests += 1
        point.tokens += len(streamed.token_ids)
        point.outputs.append((index, streamed.token_ids))
        point.choices.update(streamed.choices)
        point.itl_s += gaps
        if ttft is not None:  # a request's TTFT and its inter-token p99 stay paired for the objective
            point.ttft_s.append(ttft)
            point.per_request_itl_p99_s.append(float(np.percentile(gaps, 99)) if gaps else 0.0)
            if gaps:
                point.request_itl_s.append(sum(gaps) / len(gaps))


def closed_loop(gateway: str, streams: int, request: Callable[[int], tuple], seconds: float) -> tuple[Point, float]:
    """`streams` clients, each sending one request after another until `seconds` pass."""
    point, started = Point(), time.monotonic()

    def client(first: int) -> None:
        channel, stub = connect(gateway)
        with channel:
            i = first
            while time.monotonic() < started + seconds:
                _one(stub, *request(i), point)
                i += streams

    threads = [threading.Thread(target=client, args=(i,)) for i in range(streams)]
    for thread in threads:
        thread.start()
    return point, _joined(threads, started)


def open_loop(
    gateway: str, rate: float, request: Callable[[int], tuple], seconds: float, seed: int
) -> tuple[Point, float]:
    """Requests arriving at `rate` per second (seeded Poisson) for `seconds`, each on its own thread."""
    gaps = np.random.default_rng(seed).exponential(1 / rate, size=max(1, int(rate * seconds * 3) + 10))
    arrivals = [float(at) for at in np.cumsum(gaps) if at < seconds]
    point = Point()
    channel, stub = connect(gateway)
    with channel:
        threads = [threading.Thread(target=_one, args=(stub, *request(i), point)) for i in range(len(arrivals))]
        started = time.monotonic()
        for thread, at in zip(threads, arrivals):
            time.sleep(max(0.0, started + at - time.monotonic()))
            thread.start()
        return point, _joined(threads, started)


def _joined(threads: list[threading.Thread], started: float) -> float:
    """Seconds from `started` until every thread has ended."""
    for thread in threads:
        thread.join()
    return time.monotonic() - started


def _ms(values: list[float]) -> dict[str, float]:
    if not values:
        return {"p50": 0.0, "p99": 0.0}
    p50, p99 = np.percentile(np.array(values) * 1e3, [50, 99])
    return {"p50": round(float(p50), 2), "p99": round(float(p99), 2)}


def summarise(point: Point, wall_s: float, references: dict[int, list[int]], config: SweepConfig) -> dict:
    mismatched = sum(tokens != references[i] for i, tokens in point.outputs)
    met = sum(
        ttft * 1e3 <= config.slo_ttft_ms and itl * 1e3 <= config.slo_itl_ms
        for ttft, itl in zip(point.ttft_s, point.per_request_itl_p99_s)
    )
    return {
        "tokens_per_s": round(point.tokens / wall_s, 1),
        "requests_per_s": round(point.requests / wall_s, 3),
        "requests": point.requests,
        "ttft_ms": _ms(point.ttft_s),
        "itl_ms": _ms(point.itl_s),
        "request_itl_ms": _ms(point.request_itl_s),
        "slo_met": round(met / point.requests, 3) if point.requests else 0.0,
        "differ_from_target_only": mismatched,
        "errors": point.errors,
        "auto_choices": _shares(point.choices),
    }


def _shares(counts: Counter[str]) -> dict[str, float]:
    total = sum(counts.values())
    return {name: round(n / total, 3) for name, n in counts.most_common()} if total else {}


def start_stacks(config: SweepConfig, workdir: Path) -> dict[str, Stack]:
    """One stack per policy the sweep needs, started together (each loads its models)."""
    sessions = max(config.streams)
    stacks = {}
    for policy in sorted({POLICIES[p][0] for p in config.policies}):
        args = ["--max-sessions", str(sessions), "--max-queued", str(4 * sessions), "--speculation-policy", policy]
        (workdir / policy).mkdir(parents=True, exist_ok=True)
        stacks[policy] = Stack(StackConfig(
            target=config.target, draft=config.draft, workdir=workdir / policy,
            gateway_address=f"127.0.0.1:{free_port()}", extra_args={"verify": args},
        ))  # fmt: skip
    with ThreadPoolExecutor(len(stacks)) as pool:
        started = [pool.submit(stack.start) for stack in stacks.values()]
    try:
        for future in started:
            future.result()
    except BaseException:
        for stack in stacks.values():
            stack.stop()
        raise
    return stacks


def run_sweep(
    config: SweepConfig, progress: Callable[[str], None] = lambda line: print(line, file=sys.stderr, flush=True)
) -> dict:
    workdir = Path(tempfile.mkdtemp(prefix="specdec-load-"))
    progress(f"starting the services (logs in {workdir}) ...")
    runs = _sweep(config, start_stacks(config, workdir), progress)
    result = {"config": {k: v for k, v in asdict(config).items() if k != "out"}, "runs": runs}
    result["points"] = points(runs)
    if config.mismatched_streams:
        draft = mismatched_draft(config.draft, workdir / "mismatched-draft")
        mismatched = replace(
            config, draft=str(draft), policies=("auto", "target-only"), streams=config.mismatched_streams, rates=()
        )
        progress(f"a stack with a mismatched draft ({draft}): auto against target-only ...")
        runs = _sweep(mismatched, start_stacks(mismatched, workdir / "mismatched"), progress)
        result["mismatched_draft"] = {"runs": runs, "points": points(runs)}
    return result


def _sweep(config: SweepConfig, stacks: dict[str, Stack], progress: Callable[[str], None]) -> list[dict]:
    """Every point of `config` on `stacks` (stopped at the end): one row per policy and repeat."""
    prompts = defaults.heldout_prompts()[: config.prompts]
    runs: list[dict] = []
    try:
        for temperature in config.temperatures:
            references = _references(stacks["goodput"], prompts, temperature, config.max_new_tokens)

            def request_for(policy: str) -> Callable[[int], tuple]:
                def make(i: int) -> tuple:
                    index = i % len(prompts)
                    return _request(prompts[index], index, policy, temperature, config.max_new_tokens), index

                return make

            def measure(loop: str, level: float, run: Callable[[str, Callable], tuple[Point, float]]) -> None:
                for repeat in range(config.repeats):
                    order = config.policies if repeat % 2 == 0 else config.policies[::-1]
                    for policy in order:
                        point, wall = run(stacks[POLICIES[policy][0]].config.gateway_address, request_for(policy))
                        row = {
                            "loop": loop,
                            "level": level,
                            "temperature": temperature,
                            "policy": policy,
                            "repeat": repeat,
                        }
                        runs.append({**row, **summarise(point, wall, references, config)})
                        progress(f"T={temperature} {loop} {level:g}: {policy} {runs[-1]['tokens_per_s']} tokens/s")

            for streams in config.streams:
                measure("closed", streams, lambda gw, req, n=streams: closed_loop(gw, n, req, config.seconds))
            saturation = statistics.median(
                r["requests_per_s"] for r in runs
                if r["loop"] == "closed" and r["temperature"] == temperature and r["level"] == max(config.streams)
                and r["policy"] == "target-only"
            ) if "target-only" in config.policies else 0.0  # fmt: skip
            for fraction in config.rates if saturation else ():
                rate = fraction * saturation
                measure("open", fraction, lambda gw, req, r=rate: open_loop(gw, r, req, config.seconds, config.seed))
    finally:
        for stack in stacks.values():
            stack.stop()
    return runs


def _references(stack: Stack, prompts: list[str], temperature: float, max_new_tokens: int) -> dict[int, list[int]]:
    """Each prompt's target-only tokens (seeded as the measured requests are)."""
    point = Point()
    channel, stub = connect(stack.config.gateway_address)
    with channel:
        for i, prompt in enumerate(prompts):
            _one(stub, _request(prompt, i, "target-only", temperature, max_new_tokens), i, point)
    if point.errors:
        raise RuntimeError(f"target-only reference requests failed: {point.errors}")
    return dict(point.outputs)


def points(runs: list[dict]) -> list[dict]:
    """Per (loop, level, temperature): each policy's median tokens/s and latencies over the
    repeats, and AUTO's median paired ratio to the best fixed schedule and to the table."""
    keyed: dict[tuple, dict[str, list[dict]]] = {}
    for r in runs:
        keyed.setdefault((r["loop"], r["level"], r["temperature"]), {}).setdefault(r["policy"], []).append(r)
    out = []
    for (loop, level, temperature), by_policy in keyed.items():
        row = {"loop": loop, "level": level, "temperature": temperature, "policies": {}}
        for policy, rs in by_policy.items():
            row["policies"][policy] = {
                "tokens_per_s": statistics.median(r["tokens_per_s"] for r in rs),
                "itl_p99_ms": statistics.median(r["itl_ms"]["p99"] for r in rs),
                "request_itl_p99_ms": statistics.median(r["request_itl_ms"]["p99"] for r in rs),
                "ttft_p99_ms": statistics.median(r["ttft_ms"]["p99"] for r in rs),
                "slo_met": statistics.median(r["slo_met"] for r in rs),
                "differ_from_target_only": sum(r["differ_from_target_only"] for r in rs),
            }
            if policy == "auto":  # AUTO's rounds by choice over the repeats, the runs weighing alike
                choices = Counter()
                for r in rs:
                    choices.update(r.get("auto_choices", {}))
                row["policies"][policy]["auto_choices"] = {k: round(v / len(rs), 3) for k, v in choices.most_common()}
        if "auto" in by_policy:
            fixed = [p for p in FIXED if p in by_policy]
            auto = by_policy["auto"]
            if fixed:
                row["auto_over_best_fixed"] = round(statistics.median(
                    a["tokens_per_s"] / max(by_policy[p][i]["tokens_per_s"] for p in fixed) for i, a in enumerate(auto)
                ), 3)  # fmt: skip
            if "target-only" in by_policy:
                row["auto_over_target_only"] = round(statistics.median(
                    a["tokens_per_s"] / by_policy["target-only"][i]["tokens_per_s"] for i, a in enumerate(auto)
                ), 3)  # fmt: skip
            if "table" in by_policy:
                row["auto_over_table"] = round(statistics.median(
                    a["tokens_per_s"] / by_policy["table"][i]["tokens_per_s"] for i, a in enumerate(auto)
                ), 3)  # fmt: skip
        out.append(row)
    return out


REQUEST_ITL_TITLE = "inter-token latency p99 over requests (each request's mean gap, as AIPerf counts it), ms"


def markdown(result: dict) -> str:
    policies = list(result["config"]["policies"])
    config = result["config"]
    objective = f"TTFT at most {config['slo_ttft_ms']:g} ms and inter-token p99 at most {config['slo_itl_ms']:g} ms"
    tables = (
        ("closed", "streams", "tokens/s", "tokens_per_s", "{:.0f}"),
        ("closed", "streams", "inter-token latency p99 over every token's gap, ms", "itl_p99_ms", "{:.1f}"),
        ("closed", "streams", REQUEST_ITL_TITLE, "request_itl_p99_ms", "{:.1f}"),
        ("open", "× saturation", "tokens/s", "tokens_per_s", "{:.0f}"),
        ("open", "× saturation", f"share of requests meeting the objective ({objective})", "slo_met", "{:.2f}"),
    )
    lines = ["# Speculation under load", ""]
    for loop, level_name, title, key, form in tables:
        rows = [p for p in result["points"] if p["loop"] == loop]
        if not rows:
            continue
        ratios = key == "tokens_per_s"
        header = (
            f"| T | {level_name} | "
            + " | ".join(policies)
            + (" | auto / best fixed | auto / table |" if ratios else " |")
        )
        lines += [f"## {loop} loop: {title}", "", header, "|" + "---|" * (len(policies) + 2 + 2 * ratios)]
        for p in rows:
            cells = [form.format(p["policies"][q][key]) if q in p["policies"] else "" for q in policies]
            tail = f" | {p.get('auto_over_best_fixed', '')} | {p.get('auto_over_table', '')} |" if ratios else " |"
            lines.append(f"| {p['temperature']:g} | {p['level']:g} | " + " | ".join(cells) + tail)
        lines.append("")
    chosen = [
        p for p in result["points"] if p["loop"] == "closed" and p["policies"].get("auto", {}).get("auto_choices")
    ]  # fmt: skip
    if chosen:
        lines += ["## closed loop: AUTO's rounds by how it chose their k (shares)", ""]
        lines += ["| T | streams | rounds |", "|---|---|---|"]
        for p in chosen:
            shares = ", ".join(f"{name} {share:.2f}" for name, share in p["policies"]["auto"]["auto_choices"].items())
            lines.append(f"| {p['temperature']:g} | {p['level']:g} | {shares} |")
        lines.append("")
    mismatched = result.get("mismatched_draft", {}).get("points", [])
    if mismatched:
        lines += [
            "## Mismatched draft (the draft's architecture, untrained weights): closed loop, tokens/s", "",
            "| T | streams | auto | target-only | auto / target-only |", "|---|---|---|---|---|",
        ]  # fmt: skip
        for p in mismatched:
            auto, alone = (p["policies"][q]["tokens_per_s"] for q in ("auto", "target-only"))
            lines.append(
                f"| {p['temperature']:g} | {p['level']:g} | {auto:.0f} | {alone:.0f} | {p['auto_over_target_only']} |"
            )
        lines.append("")
    differ = differing(result)
    lines.append(
        "All completions equal target-only's." if not differ else f"**{differ} completions differ from target-only's.**"
    )
    return "\n".join(lines) + "\n"


def differing(result: dict) -> int:
    """Completions, over every point of both drafts, whose tokens differ from target-only's."""
    rows = result["points"] + result.get("mismatched_draft", {}).get("points", [])
    return sum(q["differ_from_target_only"] for p in rows for q in p["policies"].values())


def plot(result: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    temperatures = result["config"]["temperatures"]
    fig, axes = plt.subplots(1, len(temperatures), figsize=(6 * len(temperatures), 4), squeeze=False)
    for ax, temperature in zip(axes[0], temperatures):
        rows = [p for p in result["points"] if p["loop"] == "closed" and p["temperature"] == temperature]
        for policy in result["config"]["policies"]:
            xs = [p["level"] for p in rows if policy in p["policies"]]
            ax.plot(
                xs,
                [p["policies"][policy]["tokens_per_s"] for p in rows if policy in p["policies"]],
                marker="o",
                label=policy,
            )
        ax.set_xscale("log", base=2)
        ax.set_xlabel("streams in flight")
        ax.set_ylabel("tokens/s")
        ax.set_title(f"T = {temperature:g}")
        ax.legend()
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="specdec bench --load", description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="2 s a point, 1 and 4 streams, one rate, greedy only")
    parser.add_argument("--target", help="target model")
    parser.add_argument("--draft", help="draft model")
    parser.add_argument("--streams", type=int, nargs="+", help="streams in flight of the closed loop")
    parser.add_argument("--rates", type=float, nargs="+", help="open-loop rates, in multiples of the saturation rate")
    parser.add_argument("--temperatures", type=float, nargs="+")
    parser.add_argument("--seconds", type=float, help="how long each point starts requests")
    parser.add_argument("--repeats", type=int)
    parser.add_argument(
        "--mismatched-streams", type=int, nargs="*", help="closed-loop points with a mismatched draft (none: skip it)"
    )
    parser.add_argument("--out", help="folder for load.json, load.md and load.png")
    args = parser.parse_args(argv)
    config = config_from_args(SweepConfig, args, QUICK, ("streams", "rates", "temperatures", "mismatched_streams"))
    result = run_sweep(config)
    write(result, config.out)
    print(markdown(result))
    return 1 if differing(result) else 0


def write(result: dict, out: Path) -> None:
    out.mkdir(parents=True, exist_ok=True)
    (out / "load.json").write_text(json.dumps(result, indent=1) + "\n")
    (out / "load.md").write_text(markdown(result))
    plot(result, out / "load.png")
