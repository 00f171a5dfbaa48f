"""What the batched runtime's attention loop over sessions costs in a 16-session forward.

Runs the committed target over 16 sessions of 200 cached tokens and 5 new positions each,
three ways: the runtime's forward; the same forward with each session's attention replaced
by a no-op of the right shape (what attention costs as a whole); and one padded batched
attention per layer over uniform-stride slots, all sessions in one call (what a layout built for batched
attention would pay instead of the loop). Prints medians and the loop's share of the forward.

    python -m bench.attention_loop [--repeats 30]
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Callable

import torch

from specdec import batched_forward
from specdec.defaults import DEFAULT_TARGET
from specdec.runtime import CausalLM, ModelSpec

SESSIONS, CACHED, NEW = 16, 200, 5


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


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=60)
    parser.add_argument("--threads", type=int, default=1)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    model = CausalLM.load(ModelSpec(DEFAULT_TARGET))
    caches = [model.new_cache(CACHED + NEW) for _ in range(SESSIONS)]
    model.forward_batch(caches, [[(i * 7 + s) % model.vocab_size for i in range(CACHED)] for s in range(SESSIONS)])
    ids = [[1] * NEW for _ in range(SESSIONS)]

    def forward() -> None:
        model.forward_batch(caches, ids)
        for cache in caches:
            cache.rollback(CACHED)

    d = model._batched.d
    layers = len(d.layers)
    # padded batched attention: every session's keys in one [S * KV, CACHED + NEW, D] batch
    q = torch.randn(SESSIONS * d.kv_heads, d.heads // d.kv_heads * NEW, d.head_dim)
    kv = torch.randn(2, SESSIONS * d.kv_heads, CACHED + NEW, d.head_dim)
    mask = batched_forward.attention_bias(NEW, CACHED + NEW, None, torch.float32, torch.device("cpu"))

    def padded_attention() -> None:  # the runtime's own attention (bmm-softmax-bmm here), once for all
        for _ in range(layers):
            batched_forward.attend(q, kv[0], kv[1], mask)

    runtime = model._batched

    def without_attention() -> None:
        # an instance attribute hides the method: each session's attention is an empty output
        runtime._attend_session = lambda q, kv, session: q.new_empty(d.heads, session.rows, d.head_dim)
        try:
            forward()
        finally:
            del runtime._attend_session

    runs = {"full": forward, "without": without_attention, "padded": padded_attention}
    medians = interleaved_medians_ms(runs, args.repeats)
    full, without, padded = medians["full"], medians["without"], medians["padded"]
    loop = full - without
    print(f"{SESSIONS} sessions x {NEW} new positions, {CACHED} cached, {layers} layers, "
          f"{d.heads} heads x {d.head_dim}")
    print(f"forward {full:.2f} ms; without attention {without:.2f} ms; attention loop {loop:.2f} ms "
          f"({loop / layers:.3f} ms a layer) = {100 * loop / full:.1f}% of the forward")
    print(f"one padded batched attention instead: {padded:.2f} ms ({padded / layers:.3f} ms a layer); the loop costs "
          f"{loop - padded:+.2f} ms = {100 * (loop - padded) / full:+.1f}% of the forward against it")


if __name__ == "__main__":
    main()
