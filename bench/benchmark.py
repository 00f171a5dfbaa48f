"""`specdec bench`: speculation through our services against target-only decoding through
them, and against transformers' assisted generation on the same pair, measured side by
side in one run.

Columns (all on the same prompts, lengths and temperatures, interleaved job by job so
that machine noise hits them alike):
  target-only      our services, speculation off
  auto             our services, AUTO mode (k chosen per round, target-only when it does not pay)
  k=2, k=4, ...    our services, speculation on with that many draft tokens per round
  generate         transformers' plain generate on the target (the peer's baseline)
  assisted-default transformers' assisted generation, its default schedule
  assisted-constant  the same with a constant num_assistant_tokens = our best k

Greedy speculative completions must equal the target-only ones; a divergence that is not
an fp32 near-tie (docs/design.md) fails the benchmark, naming the position and the gap.

A second stack pairs the target with a deliberately mismatched draft (the draft's
architecture and tokenizer with untrained, seeded random weights) and compares AUTO with
target-only on it: AUTO must notice where the draft keeps missing.
"""

from __future__ import annotations

import itertools
import os
import platform
import resource
import sys
import tempfile
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TextIO

import torch
from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

from bench import report
from bench.batching import through_services
from bench.flags import config_from_args
from bench.report import AUTO, TARGET_ONLY
from bench.report import AUTO_SHORT as SHORT
from bench.runs import PEER_CONSTANT, PEER_DEFAULT, PEER_PLAIN, Job, Peer, Run, ours_run, peer_run
from specdec import defaults, host
from specdec.costs import measure_costs
from specdec.launcher import Stack, StackConfig, free_port
from specdec.lossless import first_divergence
from specdec.runtime import CausalLM, ModelSpec

PROMPT_MAX_TOKENS = 96  # held-out prompts are cut to this many tokens
MID = 256  # outputs of at most this many tokens run mid_repeats times


@dataclass(frozen=True)
class BenchConfig:
    target: str = defaults.DEFAULT_TARGET
    draft: str = defaults.DEFAULT_DRAFT
    prompts: int = 6  # held-out prompts used (the first ones of models/heldout_prompts.json)
    lengths: tuple[int, ...] = (32, 256, 1024)
    temperatures: tuple[float, ...] = (0.0, 0.8)
    ks: tuple[int, ...] = (2, 4, 6, 8)
    repeats: int = 1
    short_repeats: int = 3  # repeats of the jobs of at most SHORT tokens: a fraction of a second each, noisy
    mid_repeats: int = 3  # repeats of the other jobs of at most MID tokens: their gains are within run-to-run noise
    mismatched_repeats: int = 4  # single pairs of runs spread ±6% around a ratio a few percent under 1: 24 pairs, not 12
    verify_threads: int = 2  # torch threads of the verify service
    draft_threads: int = 1  # torch threads of the draft service (its default)
    peer_threads: int = 2  # torch threads of transformers' generate in this process
    in_flight: tuple[int, ...] = (1, 16)  # streams in flight of the load section (greedy, every column of ours)
    load_tokens: int = 128  # output length of the load section's requests
    calibration_length: int = 256  # output length of the runs that choose our best k
    mismatched_length: int = 256  # output length of the runs with the mismatched draft
    out: Path = Path("bench/results/cpu")

    def repeats_of(self, length: int) -> int:
        if length <= SHORT:
            return self.repeats * max(1, self.short_repeats)
        return self.repeats * max(1, self.mid_repeats) if length <= MID else self.repeats

    @property
    def columns(self) -> list[str]:
        return [TARGET_ONLY, AUTO, *(f"k={k}" for k in self.ks), PEER_PLAIN, PEER_DEFAULT, PEER_CONSTANT]


QUICK = dict(
    prompts=2, lengths=(32, 256), ks=(2, 4), calibration_length=128, mismatched_length=128, short_repeats=1, mid_repeats=1,
    mismatched_repeats=1, in_flight=(1, 4),
)  # fmt: skip


@dataclass
class Record:
    """One run of one column on one job."""

    column: str
    temperature: float
    length: int
    prompt: int
    repeat: int
    run: Run
    k: int = 0


@dataclass
class Progress:
    total: int
    out: TextIO
    done: int = 0
    started: float = field(default_factory=time.monotonic)
    last_print: float = 0.0

    def tick(self, record: Record) -> None:
        self.done += 1
        now = time.monotonic()
        if now - self.last_print >= 10 or self.done == self.total:
            self.last_print = now
            left = (now - self.started) / self.done * (self.total - self.done)
            print(
                f"  [{self.done}/{self.total}] {record.length} tokens, T={record.temperature}, {record.column}: "
                f"{record.run.tokens_per_s:.1f} tokens/s (about {left / 60:.1f} min left)",
                file=self.out,
                flush=True,
            )


def held_out_prompts(config: BenchConfig) -> list[list[int]]:
    tokenizer = AutoTokenizer.from_pretrained(config.target)
    return [tokenizer.encode(text)[:PROMPT_MAX_TOKENS] for text in defaults.heldout_prompts()[: config.prompts]]


def machine() -> dict:
    return {
        "cpu": host.cpu_model(),
        "cpus": os.cpu_count(),
        "device": "cpu",
        "python": platform.python_version(),
        "torch": torch.__version__,
    }


def peak_rss_mib(pid: int) -> float:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) / 1024
    return 0.0


def run_bench(config: BenchConfig, programs: dict[str, list[str]] | None = None, log: TextIO = sys.stderr) -> dict:
    """Runs every column on every job and returns the report (also written to config.out).
    `programs` replaces a service's program (tests run a deliberately broken verifier)."""
    torch.set_num_threads(config.peer_threads)
    prompts = held_out_prompts(config)
    workdir = Path(tempfile.mkdtemp(prefix="specdec-bench-"))
    stack_config = StackConfig(
        target=config.target,
        draft=config.draft,
        workdir=workdir,
        gateway_address=f"127.0.0.1:{free_port()}",
        extra_args={"verify": ["--threads", str(config.verify_threads)], "draft": ["--threads", str(config.draft_threads)]},
        programs=programs or {},
    )
    print(f"specdec bench: starting the services (logs in {workdir}) and loading the peer ...", file=log, flush=True)
    with Stack(stack_config) as stack:
        gateway = stack_config.gateway_address
        peer = Peer.load(config.target, config.draft)
        target = CausalLM.load(ModelSpec(config.target))
        context = min(512, target.max_positions // 2)  # cached tokens behind each timed forward
        draft = CausalLM.load(ModelSpec(config.draft))
        threads = (config.verify_threads, config.draft_threads)
        costs = measure_costs(target, draft, context=context, ks=config.ks, threads=threads)
        torch.set_num_threads(config.peer_threads)
        print(f"  costs: target step {costs.target_step_s * 1e3:.2f} ms, c = {costs.c:.3f}, v = {costs.v}", file=log, flush=True)

        warm = Job(0, prompts[0], 8, 0.0, 0)
        for column in config.columns:
            _run_column(column, warm, gateway, peer, _column_k(column, config.ks[0]))  # one-off costs stay out of the figures
        best_k = _calibrate(config, prompts[0], gateway, log)

        jobs = [
            (repeat, Job(p, ids, length, temperature, seed=1000 * repeat + p))
            for repeat in range(max(map(config.repeats_of, config.lengths)))
            for p, ids in enumerate(prompts)
            for temperature in config.temperatures
            for length in config.lengths
            if repeat < config.repeats_of(length)
        ]
        progress = Progress(len(jobs) * len(config.columns), log)
        records: list[Record] = []
        failures: list[dict] = []
        for index, (repeat, job) in enumerate(jobs):
            # Each job starts at another column, so that whatever the position in the
            # sequence costs (a cold cache after a peer's run, say) falls on every column alike.
            shift = index % len(config.columns)
            job_records: dict[str, Record] = {}
            for column in config.columns[shift:] + config.columns[:shift]:
                k = _column_k(column, best_k[job.temperature])
                run = _run_column(column, job, gateway, peer, k)
                job_records[column] = Record(column, job.temperature, job.length, job.prompt_index, repeat, run, k)
                records.append(job_records[column])
                progress.tick(job_records[column])
            for column, record in job_records.items():
                if job.temperature == 0.0 and (column.startswith("k=") or column == AUTO):
                    failure = _check_greedy(target, job, job_records[TARGET_ONLY].run, record)
                    if failure:
                        failures.append(failure)
                        print(f"  GREEDY MISMATCH: {failure}", file=log, flush=True)
        load = in_flight_load(config, prompts, gateway, log)
        memory = {s: round(peak_rss_mib(p.pid), 1) for s, p in stack.processes.items()}
    memory["bench (peer)"] = round(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024, 1)
    mismatched = _mismatched_runs(config, stack_config, prompts, target, failures, log)

    result = report.build(config, records, costs, best_k, memory, failures, machine(), mismatched)
    result["in_flight"] = load
    report.write(result, config.out)
    return result


def in_flight_load(config: BenchConfig, prompts: list[list[int]], gateway: str, log: TextIO) -> list[dict]:
    """Aggregate tokens/s by streams in flight: every prompt, repeated to twice the most
    streams, load_tokens greedy tokens each, target-only, ON at k = 4 and AUTO."""
    work = [prompts[i % len(prompts)] for i in range(2 * max(config.in_flight, default=0))]
    rows = []
    for in_flight in config.in_flight:
        for mode in ("target-only", "on-k4", "auto"):
            result = through_services(gateway, work, in_flight, mode, config.load_tokens)
            rows.append({"in_flight": in_flight, "mode": mode, **{k: v for k, v in result.items() if k != "wall_s"}})
            print(f"  load: {in_flight} in flight, {mode}: {result['tokens_per_s']:.1f} tokens/s", file=log, flush=True)
    return rows


def _column_k(column: str, best_k: int) -> int:
    """Draft tokens per round of a column: N for "k=N", our best k for the constant-k
    peer, 0 for the others."""
    if column.startswith("k="):
        return int(column[2:])
    return best_k if column == PEER_CONSTANT else 0


def _run_column(column: str, job: Job, gateway: str, peer: Peer, k: int) -> Run:
    if column == TARGET_ONLY or column.startswith("k="):
        return ours_run(gateway, job, k)
    if column == AUTO:
        return ours_run(gateway, job, 0, auto=True)
    return peer_run(peer, job, column, k)


def mismatched_draft(draft: str, out: Path, seed: int = 0) -> Path:
    """The draft's architecture and tokenizer with untrained weights: same-origin by every
    check the pairing makes, yet it mostly repeats its input, so it agrees with the target
    only where the target's own output loops."""
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(draft))
    model.save_pretrained(out)
    AutoTokenizer.from_pretrained(draft).save_pretrained(out)
    return out


def _mismatched_runs(
    config: BenchConfig, stack_config: StackConfig, prompts: list[list[int]], target: CausalLM, failures: list[dict], log: TextIO
) -> list[Record]:
    """Target-only against AUTO on a stack whose draft is mismatched, interleaved (none
    with mismatched_repeats 0)."""
    if config.mismatched_repeats < 1:
        return []
    workdir = stack_config.workdir / "mismatched"
    draft = mismatched_draft(config.draft, workdir / "draft")
    mismatched = StackConfig(
        target=config.target,
        draft=str(draft),
        workdir=workdir,
        gateway_address=f"127.0.0.1:{free_port()}",
        extra_args=stack_config.extra_args,
        programs=stack_config.programs,
    )
    print(f"specdec bench: a stack with a mismatched draft ({draft}): target-only against auto ...", file=log, flush=True)
    records: list[Record] = []
    with Stack(mismatched):
        gateway = mismatched.gateway_address
        ours_run(gateway, Job(0, prompts[0], 8, 0.0, 0), 0)  # one-off costs stay out of the figures
        for repeat, (p, ids), temperature in itertools.product(range(config.mismatched_repeats), enumerate(prompts), config.temperatures):
            job = Job(p, ids, config.mismatched_length, temperature, seed=1000 * repeat + p)
            order = (TARGET_ONLY, AUTO) if (p + repeat) % 2 == 0 else (AUTO, TARGET_ONLY)
            runs = {column: ours_run(gateway, job, 0, auto=column == AUTO) for column in order}
            for column in (TARGET_ONLY, AUTO):
                records.append(Record(column, temperature, job.length, p, repeat, runs[column]))
            print(
                f"  mismatched draft, prompt {p}, T={temperature}: target-only {runs[TARGET_ONLY].tokens_per_s:.1f}, "
                f"auto {runs[AUTO].tokens_per_s:.1f} tokens/s",
                file=log,
                flush=True,
            )
            if temperature == 0.0:
                failure = _check_greedy(target, job, runs[TARGET_ONLY], records[-1])
                if failure:
                    failures.append({**failure, "column": "mismatched auto"})
    return records


def _calibrate(config: BenchConfig, prompt: list[int], gateway: str, log: TextIO) -> dict[float, int]:
    """Our best k per temperature, from one run per k on the first prompt; the constant-k
    peer column uses it."""
    best: dict[float, int] = {}
    for temperature in config.temperatures:
        job = Job(0, prompt, config.calibration_length, temperature, seed=0)
        speeds = {k: ours_run(gateway, job, k).tokens_per_s for k in config.ks}
        best[temperature] = max(speeds, key=speeds.get)
        print(f"  calibration at T={temperature}: tokens/s by k {speeds}, best k = {best[temperature]}", file=log, flush=True)
    return best


def _check_greedy(target: CausalLM, job: Job, reference: Run, record: Record) -> dict | None:
    divergence = first_divergence(target, job.prompt_ids, reference.token_ids, record.run.token_ids)
    if divergence is None or divergence.near_tie:
        return None
    return {
        "column": record.column,
        "prompt": job.prompt_index,
        "length": job.length,
        "position": divergence.position,
        "expected": divergence.expected,
        "got": divergence.got,
        "top2_logit_gap": divergence.top2_gap,
    }


def main(argv: Sequence[str] | None = None) -> int:
    import argparse

    parser = argparse.ArgumentParser(prog="specdec bench", description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="2 prompts, lengths 32 and 256, k in {2, 4} (a few minutes)")
    parser.add_argument("--target", default=defaults.DEFAULT_TARGET)
    parser.add_argument("--draft", default=defaults.DEFAULT_DRAFT)
    parser.add_argument("--prompts", type=int, help="held-out prompts to use")
    parser.add_argument("--lengths", type=int, nargs="+", help="output lengths")
    parser.add_argument("--ks", type=int, nargs="+", help="draft tokens per round")
    parser.add_argument("--repeats", type=int)
    parser.add_argument("--verify-threads", type=int, help="torch threads of the verify service (2)")
    parser.add_argument("--draft-threads", type=int, help="torch threads of the draft service (1)")
    parser.add_argument("--peer-threads", type=int, help="torch threads of transformers' generate (2)")
    parser.add_argument("--out", help="folder for bench.json, bench.md and speedup.png")
    args = parser.parse_args(argv)
    config = config_from_args(BenchConfig, args, QUICK, ("lengths", "ks"))
    result = run_bench(config)
    print(report.markdown(result))
    if result["greedy_failures"]:
        print(f"specdec bench: FAILED: {len(result['greedy_failures'])} greedy completions differ from target-only", file=sys.stderr)
        return 1
    return 0

