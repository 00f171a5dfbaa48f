"""Sequence-level unlikelihood fine-tuning of a target (Welleck et al. 2019, "Neural Text
Generation with Unlikelihood Training"), and what it does to the pair:
`python -m models.unlikelihood --steps 100 --evals 4 --save /tmp/ul-target`.

A small model trained on code to a low loss still loops under greedy decoding: once it has
copied a few tokens, copying on is its likeliest continuation. Each step here lets the
target continue training prefixes greedily, pushes down every token of its continuation
that lies inside a repeated 4-gram by -log(1 - p(token)), and keeps it on the corpus with
the next-token loss on real training windows. At evenly spaced steps it prints the three
figures issue 4 asks of the pair: held-out loss, the distinct-4-gram share of 256-token
greedy continuations, and the draft's greedy acceptance at k=4 (the draft unchanged).

With `--agreement W` the target also learns to agree with its draft where it writes new
text: on each fresh token of its continuation it takes W times the cross-entropy toward
the draft's greedy choice there (the draft frozen), unless that choice would itself close a
repeated 4-gram. Unlikelihood alone leaves the target's free choices where a small draft
predicts them poorly; this term moves them toward the draft's.

Terms: a *continuation* is what the model wrote after `start` real tokens; one of its
tokens is *repeated* when it lies in a 4-gram that already occurred earlier in the same
sequence (prefix included). A token is *fresh* when it is not repeated.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
from collections.abc import Callable
from pathlib import Path

import torch
import torch.nn.functional as F
from transformers import GPT2LMHeadModel, PreTrainedTokenizerFast
from transformers.utils import logging as transformers_logging

from models import recipe as R
from models.learning_curve import evaluate
from specdec.defaults import heldout_prompts
from specdec.runtime import CausalLM, ModelSpec

NGRAM = 4  # the n of the repeated n-grams: the n of the distinct-n-gram share it raises


def repeated_tokens(tokens: list[int], start: int, n: int = NGRAM) -> torch.Tensor:
    """[len(tokens)] bool: the positions at or after `start` inside an n-gram that already
    occurred earlier in `tokens`."""
    mask = torch.zeros(len(tokens), dtype=torch.bool)
    seen: set[tuple[int, ...]] = set()
    for i in range(len(tokens) - n + 1):
        gram = tuple(tokens[i : i + n])
        if gram in seen and i + n > start:
            mask[max(i, start) : i + n] = True
        seen.add(gram)
    return mask


def closes_repeat(tokens: list[int], start: int, choices: list[int], n: int = NGRAM) -> torch.Tensor:
    """[len(choices)] bool: whether writing choices[j] at position start+j, after
    tokens[:start+j], would complete an n-gram that already lies wholly in tokens[:start+j]."""
    first: dict[tuple[int, ...], int] = {}  # each n-gram's first start in tokens
    for i in range(len(tokens) - n + 1):
        first.setdefault(tuple(tokens[i : i + n]), i)
    mask = torch.zeros(len(choices), dtype=torch.bool)
    for j, choice in enumerate(choices):
        p = start + j
        if p >= n - 1:
            mask[j] = first.get(tuple(tokens[p - n + 1 : p]) + (choice,), p) + n <= p
    return mask


def agreement_loss(logits: torch.Tensor, choices: torch.Tensor, counted: torch.Tensor) -> torch.Tensor:
    """Cross-entropy toward the draft's choices, summed over the counted positions, divided
    by all positions.

    logits:  [rows, length, vocab] the target's next-token logits at each position
    choices: [rows, length]        the draft's greedy token at each position
    counted: [rows, length] bool   where to pull the target toward it
    """
    ce = F.cross_entropy(logits.float().flatten(0, 1), choices.flatten(), reduction="none").view_as(choices)
    return (ce * counted).sum() / counted.numel()


def unlikelihood_loss(logits: torch.Tensor, tokens: torch.Tensor, repeated: torch.Tensor) -> torch.Tensor:
    """-log(1 - p(token)) summed over the repeated positions, divided by all positions.

    logits:   [rows, length, vocab] next-token logits at each position
    tokens:   [rows, length]        the token that came next at each position
    repeated: [rows, length] bool   which of those tokens to push down
    """
    p = F.softmax(logits.float(), dim=-1).gather(-1, tokens.unsqueeze(-1)).squeeze(-1)
    penalty = -torch.log(torch.clamp(1 - p, min=1e-5))  # finite where p rounds to 1
    return (penalty * repeated).sum() / repeated.numel()


@dataclasses.dataclass(frozen=True)
class Tune:
    steps: int = 100
    evals: int = 4  # evaluations, evenly spaced, the last after the last step (plus one before the first)
    lr: float = 1e-4  # AdamW's, after a 10-step warm-up
    weight: float = 1.0  # of the unlikelihood loss beside the next-token loss
    agreement: float = 0.0  # of the draft-agreement loss on fresh tokens; 0: none
    rows: int = 16  # continuations (and real windows) per step
    prefix: int = 48  # training tokens each continuation starts from
    new_tokens: int = 128  # tokens of each continuation
    seed: int = 0
    eval_tokens: int = 16384  # held-out tokens for the loss
    distinct_tokens: int = 256  # per prompt, for the distinct-4-gram share
    acceptance_tokens: int = 128  # per prompt, for the draft's acceptance at k=4
    max_files: int = 0  # training files; 0: all


def step_loss(
    model: GPT2LMHeadModel, train_ids: torch.Tensor, tune: Tune, data: torch.Generator, dtype: torch.dtype = torch.float32,
    draft: GPT2LMHeadModel | None = None,
) -> tuple[torch.Tensor, int]:  # fmt: skip
    """One step's loss: the next-token loss on real windows plus weight times the
    unlikelihood of the repeated tokens of the model's own greedy continuations, plus, with a
    draft, agreement times the agreement loss on their fresh tokens."""
    device = next(model.parameters()).device
    prefixes = R.windows(train_ids, tune.rows, tune.prefix, data).to(device)
    with torch.no_grad(), R.autocast(dtype, device):
        rows = model.generate(
            prefixes, attention_mask=torch.ones_like(prefixes), max_new_tokens=tune.new_tokens, do_sample=False,
            pad_token_id=0, eos_token_id=None,
        )  # fmt: skip
    sequences = rows.tolist()
    repeated = torch.stack([repeated_tokens(row, tune.prefix) for row in sequences])[:, tune.prefix :].to(device)
    with R.autocast(dtype, device):
        logits = model(input_ids=rows[:, :-1]).logits[:, tune.prefix - 1 :]  # the positions predicting the continuation
    penalty = tune.weight * unlikelihood_loss(logits, rows[:, tune.prefix :], repeated)
    if tune.agreement:
        with torch.no_grad(), R.autocast(dtype, device):
            choices = draft(input_ids=rows[:, :-1]).logits[:, tune.prefix - 1 :].argmax(-1)
        looping = [closes_repeat(row, tune.prefix, guess) for row, guess in zip(sequences, choices.tolist())]
        counted = ~repeated & ~torch.stack(looping).to(device)
        penalty = penalty + tune.agreement * agreement_loss(logits, choices, counted)
    real = R.windows(train_ids, tune.rows, tune.prefix + tune.new_tokens + 1, data).to(device)
    return R.next_token_loss(model, real, dtype) + penalty, real[:, 1:].numel() + rows.numel()


def tunable(path: Path) -> GPT2LMHeadModel:
    """The saved target in float32 with dropout off: the probabilities the penalty pushes down
    are the ones greedy decoding sees."""
    return GPT2LMHeadModel.from_pretrained(path, dtype=torch.float32, resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0)


def fine_tune(
    model: GPT2LMHeadModel, train_ids: torch.Tensor, tune: Tune, data: torch.Generator,
    dtype: torch.dtype = torch.float32, after_step: Callable[[int, int], None] | None = None,
    draft: GPT2LMHeadModel | None = None,
) -> dict:  # fmt: skip
    """tune.steps steps of AdamW on step_loss (tune.lr after a 10-step warm-up), with the
    recipe's progress lines, on a model from `tunable`. The recipe runs this between
    pretraining and distillation when its unlikelihood_steps is set (with no draft yet)."""
    if tune.agreement and draft is None:
        raise ValueError("the agreement loss needs a draft")
    opt = torch.optim.AdamW([{"params": list(model.parameters()), "scale": 1.0}], lr=tune.lr, betas=(0.9, 0.95), weight_decay=0.0)
    return R.train(
        model, "unlikelihood", tune.steps, lambda step: tune.lr * min(1.0, (step + 1) / 10),
        lambda _step: step_loss(model, train_ids, tune, data, dtype, draft), [opt], after_step,
    )  # fmt: skip


def run(tune: Tune, target: Path, draft: Path, save: Path | None) -> list[dict]:
    """Fine-tunes the target at `target` and returns the figures at each evaluation."""
    transformers_logging.disable_progress_bar()
    torch.manual_seed(tune.seed)
    tokenizer = PreTrainedTokenizerFast.from_pretrained(target)
    sources = R.stdlib_sources(0)
    report = target.parent / "report.json"  # where the recipe made the pair, it names the corpus
    if report.exists():
        R.require_corpus(json.loads(report.read_text()), sources)
    train_files, heldout_files = R.split_by_file(sources, R.Recipe.heldout_every)
    train_ids = R.encode_files(tokenizer, train_files[: tune.max_files or None])
    eval_ids = R.encode_files(tokenizer, heldout_files)[: tune.eval_tokens]
    prompts = heldout_prompts()
    model = tunable(target)
    drafter = CausalLM.load(ModelSpec(str(draft)))
    data = torch.Generator().manual_seed(tune.seed)
    at = {round(tune.steps * (i + 1) / tune.evals) for i in range(tune.evals)}
    points: list[dict] = []

    def measure(done: int, tokens: int) -> None:
        if done == 0 or done in at:
            points.append({"step": done, "tokens": tokens})
            points[-1].update(
                evaluate(model, tokenizer, eval_ids, prompts, tune.distinct_tokens, drafter, tune.acceptance_tokens)
            )
            p = points[-1]
            R.log(
                f"[unlikelihood] step {done}: held-out loss {p['heldout_loss']:.3f}, distinct 4-grams mean "
                f"{p['distinct_mean']:.3f} (min {p['distinct_min']:.2f}), acceptance {p['acceptance']:.3f} at k=4"
            )

    measure(0, 0)
    fine_tune(model, train_ids, tune, data, after_step=measure, draft=drafter.model)
    if save:
        R.save(model, tokenizer, save)
    return points


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m models.unlikelihood", description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=Tune.steps)
    parser.add_argument("--evals", type=int, default=Tune.evals)
    parser.add_argument("--lr", type=float, default=Tune.lr)
    parser.add_argument("--weight", type=float, default=Tune.weight, help="of the unlikelihood loss")
    parser.add_argument("--agreement", type=float, default=Tune.agreement, help="of the draft-agreement loss")
    parser.add_argument("--seed", type=int, default=Tune.seed)
    parser.add_argument("--target", type=Path, default=R.MODELS_DIR / "target", help="the target to fine-tune")
    parser.add_argument("--draft", type=Path, default=R.MODELS_DIR / "draft", help="the draft whose acceptance is measured")
    parser.add_argument("--save", type=Path, help="save the fine-tuned target here")
    args = parser.parse_args(argv)
    tune = Tune(
        steps=args.steps, evals=args.evals, lr=args.lr, weight=args.weight, agreement=args.agreement, seed=args.seed
    )
    torch.set_num_threads(2)
    run(tune, args.target, args.draft, args.save)
    return 0


if __name__ == "__main__":
    sys.exit(main())
