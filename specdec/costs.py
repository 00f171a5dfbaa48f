"""Forward costs of a target/draft pair, the inputs of docs/design.md's performance model.

  c     = one draft step / one target step (single-token forwards with a warm cache)
  v(k)  = one target forward over k+1 positions / one target step

Each repetition runs what one round runs: a target step, then `draft_steps` draft steps
in a row (a proposal), then the multi-position verifies; a draft step is the mean over
its proposal, so its first step pays for the caches the target's weights just evicted,
as it does in service. Timings on a shared machine are noisy, so ratios are taken per
repetition and the reported figures are medians.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from specdec.runtime import CausalLM, ModelSpec


@dataclass(frozen=True)
class Costs:
    target_step_s: float  # median single-token target forward
    draft_step_s: float  # median single-token draft forward
    c: float  # median of per-repetition draft/target ratios
    v: dict[int, float]  # k -> median of per-repetition verify(k+1 positions)/step ratios
    context: int  # cached tokens behind each measured forward


def _prefix(model: CausalLM, length: int) -> list[int]:
    """Stand-in context: spread token ids, the same for every measurement."""
    return [(i * 7919) % model.vocab_size for i in range(length)]


def _timed(model: CausalLM, cache, ids: list[int]) -> float:
    length = cache.length
    start = time.perf_counter()
    model.forward(cache, ids)
    elapsed = time.perf_counter() - start
    cache.rollback(length)
    return elapsed


def _proposal(model: CausalLM, cache, steps: int) -> float:
    length = cache.length
    start = time.perf_counter()
    for _ in range(steps):
        model.forward(cache, [1])
    elapsed = time.perf_counter() - start
    cache.rollback(length)
    return elapsed


def measure_costs(
    target: CausalLM,
    draft: CausalLM,
    context: int = 512,
    ks: Sequence[int] = (4, 8),
    repeats: int = 60,
    draft_steps: int = 4,
    threads: tuple[int, int] | None = None,
) -> Costs:
    """threads: (target, draft) torch threads, as the two services run them; None keeps
    this process's setting for both."""
    target_threads, draft_threads = threads or (torch.get_num_threads(),) * 2
    target_cache, draft_cache = target.new_cache(), draft.new_cache()
    target.forward(target_cache, _prefix(target, context))
    draft.forward(draft_cache, _prefix(target, context))
    steps, drafts, ratios_c = [], [], []
    ratios_v: dict[int, list[float]] = {k: [] for k in ks}
    for _ in range(repeats):
        torch.set_num_threads(target_threads)
        step = _timed(target, target_cache, [1])
        torch.set_num_threads(draft_threads)
        d = _proposal(draft, draft_cache, draft_steps) / draft_steps
        torch.set_num_threads(target_threads)
        steps.append(step)
        drafts.append(d)
        ratios_c.append(d / step)
        for k in ks:
            ratios_v[k].append(_timed(target, target_cache, [1] * (k + 1)) / step)
    return Costs(
        target_step_s=statistics.median(steps),
        draft_step_s=statistics.median(drafts),
        c=statistics.median(ratios_c),
        v={k: statistics.median(r) for k, r in ratios_v.items()},
        context=context,
    )


def forward_seconds(
    model: CausalLM, positions: Sequence[int], context: int = 128, repeats: int = 7
) -> dict[int, float]:
    """Seconds of one forward over n new positions behind `context` cached tokens, for each
    n in positions: what the verify service starts its AUTO costs from. The curve is not
    monotonic on CPUs (gemm blocking: 5 positions can cost less than 4), so its shape
    matters, and the other services may be loading beside it: each repetition times a
    single-position forward and then every n, and a forward's cost is the fastest
    single-position forward times the median of its per-repetition ratios, so contention
    that slows a whole repetition leaves the shape alone."""
    forwards = model.forwards
    context = max(1, min(context, model.max_positions - max(positions)))
    cache = model.new_cache(context + max(positions))
    model.forward(cache, _prefix(model, context))
    _timed(model, cache, [1])  # the first forward after a prefill pays for its allocations
    ones: list[float] = []
    ratios: dict[int, list[float]] = {n: [] for n in positions}
    for _ in range(repeats):
        one = _timed(model, cache, [1])
        ones.append(one)
        for n in positions:
            ratios[n].append(_timed(model, cache, [1] * n) / one)
    model.forwards = forwards  # calibration is not service work
    return {n: min(ones) * statistics.median(r) for n, r in ratios.items()}


CALIBRATION_CONTEXT = 128  # cached tokens behind each session of a batched forward's calibration


def calibration_context(model: CausalLM, context: int, per_session: Sequence[int]) -> int:
    """The context a calibration can use: `context`, less what the model's positions leave."""
    return max(1, min(context, model.max_positions - max(per_session)))


def _fill(model: CausalLM, count: int, context: int, capacity: int) -> list:
    """Up to `count` caches of `capacity` positions, each holding `context` tokens: as many
    as the pool holds. The caller releases them."""
    caches = []
    while len(caches) < count and model.fits(capacity):
        caches.append(model.new_cache(capacity))
        model.forward(caches[-1], _prefix(model, context))
    return caches


def _time_batch(model: CausalLM, caches: list, p: int, context: int) -> float:
    """Seconds of one forward over p new positions of each cache, rolled back to `context` after."""
    start = time.perf_counter()
    model.forward_batch(caches, [[1] * p] * len(caches))
    elapsed = time.perf_counter() - start
    for cache in caches:
        cache.rollback(context)
    return elapsed


def batch_forward_seconds(
    model: CausalLM,
    sessions: Sequence[int],
    per_session: Sequence[int],
    context: int = CALIBRATION_CONTEXT,
    repeats: int = 5,
) -> dict[tuple[int, int], float]:
    """Seconds of one forward over p new positions of each of s sessions (each behind
    `context` cached tokens), by (s, p) for s in sessions and p in per_session: what AUTO's
    batch costs start from. Session counts the pool cannot hold at once are left out. As
    forward_seconds: each value is the fastest one-session, one-position forward times the
    median of its per-repetition ratios to it."""
    forwards = model.forwards
    context = calibration_context(model, context, per_session)
    caches = _fill(model, max(sessions), context, context + max(per_session))
    try:
        if not caches:  # the pool holds no session of this context
            return {}
        _time_batch(model, caches[:1], 1, context)  # the first forward after a prefill pays for its allocations
        ones: list[float] = []
        ratios: dict[tuple[int, int], list[float]] = {
            (s, p): [] for s in sessions if s <= len(caches) for p in per_session
        }
        for _ in range(repeats):
            one = _time_batch(model, caches[:1], 1, context)
            ones.append(one)
            for (s, p), samples in ratios.items():
                samples.append(_time_batch(model, caches[:s], p, context) / one)
    finally:
        for cache in caches:
            cache.release()
        model.forwards = forwards  # calibration is not service work
    return {key: min(ones) * statistics.median(r) for key, r in ratios.items()}


def context_ratios(
    model: CausalLM, most: int, per_session: Sequence[int], short: int, longer: int, repeats: int = 5
) -> dict[tuple[int, int], float]:
    """How many times slower a forward over p new positions of each of s sessions runs
    behind `longer` cached tokens than behind `short`, by (s, p), for one session and for
    the most sessions (up to `most`) that the pool holds at both contexts at once: the
    median over repetitions of the two timed back to back, so that contention slowing a
    repetition slows both (two calibrations minutes apart differ by more than what the
    context adds)."""
    forwards = model.forwards
    room = max(per_session)
    caches: dict[int, list] = {short: [], longer: []}
    try:
        while len(caches[longer]) < most:  # in pairs, the pool's slots or tokens shared
            pair = [_fill(model, 1, context, context + room) for context in (short, longer)]
            if not all(pair):
                for cache in sum(pair, []):
                    cache.release()
                break
            for context, filled in zip((short, longer), pair):
                caches[context] += filled
        held = len(caches[longer])
        if not held:
            return {}
        for context, filled in caches.items():
            _time_batch(model, filled[:1], 1, context)  # the first forward after a prefill pays for its allocations
        ratios: dict[tuple[int, int], list[float]] = {(s, p): [] for s in sorted({1, held}) for p in per_session}
        for _ in range(repeats):
            for (s, p), samples in ratios.items():
                at_short = _time_batch(model, caches[short][:s], p, short)
                samples.append(_time_batch(model, caches[longer][:s], p, longer) / at_short)
    finally:
        for filled in caches.values():
            for cache in filled:
                cache.release()
        model.forwards = forwards  # calibration is not service work
    return {key: statistics.median(r) for key, r in ratios.items()}


def main(argv: list[str] | None = None) -> int:
    """`python -m specdec.costs TARGET DRAFT`: one measure_costs of a pair on this host, as
    one JSON line. The figure varies from process to process (c of the committed pair
    0.072-0.102 on this project's CPU), so one worth reporting is the median over several
    processes: models/recipe.py's evaluation runs this in five."""
    parser = argparse.ArgumentParser(
        prog="python -m specdec.costs", description="Measure a pair's forward costs c and v(k) on this host."
    )
    parser.add_argument("target", help="the target: a local path or hub id")
    parser.add_argument("draft", help="the draft: a local path or hub id")
    parser.add_argument("--context", type=int, default=512, help="cached tokens behind each measured forward")
    parser.add_argument("--ks", default="4,8", help="the k of each v(k), comma-separated")
    parser.add_argument("--threads", type=int, default=2, help="torch CPU threads of both models")
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    target, draft = CausalLM.load(ModelSpec(args.target)), CausalLM.load(ModelSpec(args.draft))
    costs = measure_costs(target, draft, context=args.context, ks=[int(k) for k in args.ks.split(",")])
    print(json.dumps({
        "target_step_ms": costs.target_step_s * 1e3, "draft_step_ms": costs.draft_step_s * 1e3, "c": costs.c,
        **{f"v{k}": v for k, v in costs.v.items()}, "context": costs.context, "threads": torch.get_num_threads(),
        "runtime": target.backend,
    }))  # fmt: skip
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
