"""The forward costs a pair of given shapes will have on this CPU, before training it:
`python -m models.sizing [--preset P] [--target-shape L,W,H] [--draft-shape L,W,H]`.

The cost of a dense float32 forward does not depend on the weights' values (the committed
pair and an untrained pair of its shapes measured c 0.106 and 0.107, v(8) 1.34 and 1.34,
alternating in one process), so untrained models of the shapes, with the recipe's
vocabulary and context, measured as the recipe's evaluation measures the trained pair
(`measured_costs`: `python -m specdec.costs` in fresh processes, medians), give the c and
v(8) to check against the sizing before a GPU is spent on a shape.
"""

from __future__ import annotations

import argparse
import dataclasses
import tempfile
from pathlib import Path

import torch
from transformers import GPT2LMHeadModel

from models.recipe import PRESETS, Recipe, add_shape_flags, gpt2_config, log, measured_costs, with_shapes

MAX_C = 0.1  # the sizing's bound on one draft step / one target step ...
MAX_V8 = 1.5  # ... and on one verify of 8 draft tokens (9 positions) / one target step


def untrained_pair(recipe: Recipe, out: Path) -> dict[str, int]:
    """Saves randomly initialised target and draft of the recipe's shapes to out/target and
    out/draft (float32, weights tied as the recipe ties them); returns their parameter counts."""
    torch.manual_seed(recipe.seed)
    counts = {}
    for name, shape in (("target", recipe.target), ("draft", recipe.draft)):
        model = GPT2LMHeadModel(gpt2_config(shape, recipe.vocab_size, 0, recipe.context))
        model.save_pretrained(out / name)
        counts[name] = sum(p.numel() for p in model.parameters())
    return counts


def size_pair(recipe: Recipe) -> tuple[dict[str, int], dict]:
    """(parameter counts, measured_costs) of untrained models of the recipe's shapes."""
    with tempfile.TemporaryDirectory(prefix="specdec-sizing-") as scratch:
        counts = untrained_pair(recipe, Path(scratch))
        return counts, measured_costs(Path(scratch) / "target", Path(scratch) / "draft", recipe)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m models.sizing", description=__doc__.split("\n\n")[0])
    parser.add_argument("--preset", choices=sorted(PRESETS), default="h200", help="the recipe whose shapes, vocabulary and context to size (default: h200, the committed pair's)")
    add_shape_flags(parser)
    parser.add_argument("--processes", type=int, help="fresh processes that each measure the costs (default: the preset's cost_processes)")
    args = parser.parse_args(argv)
    recipe = with_shapes(PRESETS[args.preset], args)
    if args.processes is not None:
        recipe = dataclasses.replace(recipe, cost_processes=args.processes)
    if recipe.cost_processes < 1:
        parser.error(f"--processes must be at least 1, got {recipe.cost_processes}")
    count, costs = size_pair(recipe)
    verdict = {True: "yes", False: "no"}
    log(
        f"[sizing] target {recipe.target.n_layer}x{recipe.target.n_embd} ({count['target']:,} parameters), "
        f"draft {recipe.draft.n_layer}x{recipe.draft.n_embd} ({count['draft']:,}) on {costs['machine']}, {costs['threads']} threads, "
        f"{costs['context']} cached tokens: target step {costs['target_step_ms']:.2f} ms, draft step {costs['draft_step_ms']:.3f} ms, "
        f"c {costs['c']:.3f} (by process {', '.join(f'{c:.3f}' for c in costs['c_per_process'])}), v(4) {costs['v4']:.2f}, v(8) {costs['v8']:.2f}; "
        f"c <= {MAX_C}: {verdict[costs['c'] <= MAX_C]}, v(8) <= {MAX_V8}: {verdict[costs['v8'] <= MAX_V8]}"
    )  # fmt: skip
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
