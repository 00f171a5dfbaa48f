"""How a target's held-out loss and greedy repetition move with training:
`python -m models.learning_curve --shape 6/256/4 --optimizer muon --steps 800`.

Trains a target as the recipe does (its corpus, batches and schedule) with the committed
tokenizer, and at evenly spaced steps prints the held-out loss and the distinct-4-gram
share of 256-token greedy continuations of the committed held-out prompts: the two
figures issue 4's target must reach, measured along the way instead of only at the end.
"""

from __future__ import annotations

import argparse
import copy
import dataclasses
import sys
import time
from pathlib import Path

import torch
from transformers import GPT2LMHeadModel, PreTrainedTokenizerFast
from transformers.utils import logging as transformers_logging

from models import recipe as R
from specdec.defaults import heldout_prompts
from specdec.offline import speculate
from specdec.runtime import CausalLM


@dataclasses.dataclass(frozen=True)
class Curve:
    shape: R.Shape
    optimizer: str = "adamw"  # one of R.OPTIMIZERS
    steps: int = 800
    evals: int = 6  # evaluations, evenly spaced, the last after the last step
    lr: float = 1e-3  # peak learning rate of AdamW ...
    muon_lr: float = 0.02  # ... and of Muon, where it is used
    short_seq: int = 256  # most steps' window length (the recipe's long windows come every 8th step)
    seed: int = 0  # of the initial weights and of the batches
    eval_tokens: int = 16384  # held-out tokens for the loss
    new_tokens: int = 256  # per prompt, for the distinct-4-gram share
    init: Path | None = None  # start from these weights instead of random ones
    max_files: int = 0  # training files; 0: all (every held-out file is evaluated on)
    compile: bool = True  # torch.compile the training forward, as the recipe does


def evaluate(
    model: GPT2LMHeadModel, tokenizer, eval_ids: torch.Tensor, prompts: list[str], new_tokens: int,
    draft: CausalLM | None = None, acceptance_tokens: int = 128,
) -> dict:  # fmt: skip
    """Held-out loss and distinct-4-gram shares of greedy continuations; with a draft, also
    its greedy acceptance at k=4 (accepted / proposed over acceptance_tokens per prompt)."""
    lm = CausalLM(copy.deepcopy(model).eval(), "target")
    shares = sorted(
        R.distinct_4gram_share(speculate(lm, None, tokenizer.encode(prompt), new_tokens, 0).tokens) for prompt in prompts
    )  # fmt: skip
    figures = {
        "heldout_loss": R.heldout_loss(lm, eval_ids, 512),
        "distinct_mean": sum(shares) / len(shares),
        "distinct_median": shares[len(shares) // 2],
        "distinct_min": shares[0],
        "distinct_max": shares[-1],
    }
    if draft is not None:
        rounds = [speculate(lm, draft, tokenizer.encode(prompt), acceptance_tokens, 4) for prompt in prompts]
        figures["acceptance"] = sum(r.accepted for r in rounds) / sum(r.proposed for r in rounds)
    return figures


def run(curve: Curve, tokenizer_dir: Path, save: Path | None) -> list[dict]:
    transformers_logging.disable_progress_bar()
    torch.manual_seed(curve.seed)
    recipe = dataclasses.replace(
        R.Recipe(), target=curve.shape, short_seq=curve.short_seq, seed=curve.seed, compile=curve.compile
    )
    tokenizer = PreTrainedTokenizerFast.from_pretrained(tokenizer_dir)
    train_files, heldout_files = R.split_by_file(R.stdlib_sources(0), recipe.heldout_every)
    train_ids = R.encode_files(tokenizer, train_files[: curve.max_files or None])
    eval_ids = R.encode_files(tokenizer, heldout_files)[: curve.eval_tokens]
    prompts = heldout_prompts()
    model = (
        GPT2LMHeadModel.from_pretrained(curve.init, dtype=torch.float32) if curve.init
        else R.new_gpt2(curve.shape, tokenizer, recipe.context)
    )  # fmt: skip
    R.log(f"[curve] {sum(p.numel() for p in model.parameters()):,} parameters, {curve.optimizer}, {curve.steps} steps")
    fast = R.compiled(model, recipe)
    data = torch.Generator().manual_seed(curve.seed)
    dtype = R.training_dtype("auto")
    points: list[dict] = []
    at = {round(curve.steps * (i + 1) / curve.evals) for i in range(curve.evals)}
    started = time.perf_counter()

    def step_loss(step: int):
        batch = R.pretraining_batch(train_ids, recipe, step, data)
        return R.next_token_loss(fast, batch, dtype), batch[:, 1:].numel()

    def after_step(done: int, tokens: int) -> None:
        if done in at:
            point = {"step": done, "tokens": tokens, "minutes": (time.perf_counter() - started) / 60}
            point.update(evaluate(model, tokenizer, eval_ids, prompts, curve.new_tokens))
            points.append(point)
            R.log(
                f"[curve] step {done}, {tokens / 1e6:.2f}M tokens: held-out loss {point['heldout_loss']:.3f}, "
                f"distinct 4-grams mean {point['distinct_mean']:.3f} median {point['distinct_median']:.3f} "
                f"max {point['distinct_max']:.2f}"
            )

    opts = R.optimizers(model, curve.lr, curve.optimizer, curve.muon_lr)
    R.train(model, "target", curve.steps, R.cosine(curve.lr, curve.steps), step_loss, opts, after_step)
    if save:
        R.save(model, tokenizer, save)
    return points


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m models.learning_curve", description=__doc__.split("\n\n")[0])
    parser.add_argument("--shape", type=R.shape_arg, default="6/256/4", help="layers/width/heads")
    parser.add_argument("--optimizer", choices=R.OPTIMIZERS, default="adamw")
    parser.add_argument("--steps", type=int, default=800)
    parser.add_argument("--evals", type=int, default=6)
    parser.add_argument("--lr", type=float, default=1e-3, help="peak learning rate of AdamW")
    parser.add_argument("--muon-lr", type=float, default=0.02, help="peak learning rate of Muon")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--init", type=Path, help="start from this checkpoint")
    parser.add_argument("--tokenizer", type=Path, default=R.MODELS_DIR / "target")
    parser.add_argument("--save", type=Path, help="save the trained target here")
    args = parser.parse_args(argv)
    curve = Curve(
        shape=args.shape, optimizer=args.optimizer, steps=args.steps, evals=args.evals,
        lr=args.lr, muon_lr=args.muon_lr, seed=args.seed, init=args.init,
    )  # fmt: skip
    torch.set_num_threads(2)
    run(curve, args.tokenizer, args.save)
    return 0


if __name__ == "__main__":
    sys.exit(main())
