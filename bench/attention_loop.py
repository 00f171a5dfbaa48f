"""What attention costs in a 16-session forward, on the runtime's two paths.

Runs the committed target over 16 sessions of 200 cached tokens and 5 new positions each
(a verify step at k = 4), and of 1 new position (a target-only step):
  loop     a pool of runs as long as asked: attention loops over the sessions, each on a
           view of its own run
  padded   a pool of slots, every session in one: attention is one padded, masked
           computation over [slots, heads, new positions, longest cache] (the services' pools)
  without  the loop forward with each session's attention replaced by an empty output of the
           right shape: what the rest of the forward costs
Prints interleaved medians, each path's attention share of its forward, and what the loop
costs against the padded computation.

    python -m bench.attention_loop [--repeats 60] [--threads 1]
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Callable

import torch

from specdec.defaults import DEFAULT_TARGET
from specdec.host import cpu_model
from specdec.runtime import CausalLM, ModelSpec

SESSIONS, CACHED = 16, 200


def interleaved_medians_ms(runs: dict[str, Callable[[], None]], repeats: int) -> dict[str, float]:
    """Median time of each run, the runs taking turns so that a busy host slows all alike."""
    times: dict[str, list[float]] = {name: [] for name in runs}
    for repeat in range(repeats + 1):
        for name, run in runs.items():
            start = time.perf_counter()
            run()
            if repeat:  # the first round warms up
                times[name].append(time.perf_counter() - start)
    return {name: statistics.median(spent) * 1e3 for name, spent in times.items()}


def step(model: CausalLM, new: int) -> tuple[Callable[[], None], list]:
    """One forward of `new` positions for each of SESSIONS sessions of CACHED tokens, and
    the sessions' caches (to release)."""
    caches = [model.new_cache(CACHED + new) for _ in range(SESSIONS)]
    model.forward_batch(caches, [[(i * 7 + s) % model.vocab_size for i in range(CACHED)] for s in range(SESSIONS)])
    ids = [[1] * new for _ in range(SESSIONS)]

    def forward() -> None:
        model.forward_batch(caches, ids)
        for cache in caches:
            cache.rollback(CACHED)

    return forward, caches


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=60)
    parser.add_argument("--threads", type=int, default=1)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    loop_model = CausalLM.load(ModelSpec(DEFAULT_TARGET))
    context = loop_model.max_positions
    padded_model = CausalLM(loop_model.model, "padded", pool_tokens=SESSIONS * context, pool_slots=True)
    runtime, d = loop_model._batched, loop_model._batched.d
    print(
        f"{cpu_model()}, {args.threads} thread(s); {SESSIONS} sessions, {CACHED} cached, {len(d.layers)} layers, "
        f"{d.heads} heads x {d.head_dim}"
    )
    for new in (5, 1):
        (loop, loop_caches), (padded, padded_caches) = step(loop_model, new), step(padded_model, new)

        def without(loop: Callable[[], None] = loop) -> None:
            # an instance attribute hides the method: each session's attention is an empty output
            runtime._attend_session = lambda q, kv, session: q.new_empty(d.heads, session.rows, d.head_dim)
            try:
                loop()
            finally:
                del runtime._attend_session

        m = interleaved_medians_ms({"loop": loop, "padded": padded, "without": without}, args.repeats)
        loop_attn, padded_attn = m["loop"] - m["without"], m["padded"] - m["without"]
        print(
            f"{new} new position(s): forward with the loop {m['loop']:.2f} ms (attention {loop_attn:.2f} ms, "
            f"{100 * loop_attn / m['loop']:.1f}%), padded {m['padded']:.2f} ms (attention {padded_attn:.2f} ms, "
            f"{100 * padded_attn / m['padded']:.1f}%); the loop costs {m['loop'] - m['padded']:+.2f} ms = "
            f"{100 * (m['loop'] - m['padded']) / m['padded']:+.1f}% of the padded forward"
        )
        for cache in loop_caches + padded_caches:
            cache.release()


if __name__ == "__main__":
    main()
