"""Co-adaptation rounds: after distillation, the target and its draft move toward each other
in turns. Each round:

1. tunes the target toward its draft (models/unlikelihood.py): the next-token loss on real
   windows, unlikelihood on the repeated tokens of its own greedy continuations, and
   agreement with the frozen draft's greedy choice on their fresh tokens;
2. re-distils the draft from that target, warm-started: KL to the target's distributions
   plus a cross-entropy toward its greedy token, on real windows and fresh greedy
   continuations by the tuned target.

Unlikelihood alone stops the target's loops but leaves its new text where a small draft
predicts it poorly; re-distilling alone cannot follow it there. Each half makes the other's
job easier. A round's random draws come from its own seed (the recipe's seed and the
round's number), so rounds run at once or one command at a time make the same pair.
"""

from __future__ import annotations

import dataclasses
import json
import os
import time
from pathlib import Path

import torch
from transformers import GPT2LMHeadModel, PreTrainedTokenizerFast
from transformers.utils import logging as transformers_logging

from models import recipe as R
from models.unlikelihood import Tune, fine_tune, tunable

CPU_GENERATE_ROWS = 64  # continuations generated at once on a CPU, where a larger batch only grows the cache


def run_rounds(out: Path, recipe: R.Recipe, train_ids: torch.Tensor, dtype: torch.dtype, first: int = 1) -> list[dict]:
    """The co-adaptation rounds of `recipe` numbered from `first`, on the pair saved in
    `out` (replaced after each half-round); the training figures of each."""
    rounds = recipe.coadaptation
    device = torch.device(recipe.device)
    tokenizer = PreTrainedTokenizerFast.from_pretrained(out / "target")
    rows_at_once = recipe.onpolicy_batch if device.type == "cuda" else min(recipe.onpolicy_batch, CPU_GENERATE_ROWS)
    sizing = dataclasses.replace(recipe, onpolicy_rows=rounds.rows, onpolicy_batch=rows_at_once, batch_tokens=rounds.batch_tokens)
    stats = []
    for number, target_steps in enumerate(rounds.target_steps[first - 1 :], first):
        started, seed = time.perf_counter(), recipe.seed * 1000 + number
        torch.manual_seed(seed)
        data = torch.Generator().manual_seed(seed)
        R.log(f"[round {number}] tuning the target toward its draft ({target_steps} steps)")
        draft = GPT2LMHeadModel.from_pretrained(out / "draft", dtype=torch.float32).to(device).eval()
        target = tunable(out / "target").to(device)
        tune = Tune(
            steps=target_steps, lr=recipe.unlikelihood_lr, weight=rounds.unlikelihood, agreement=rounds.agreement,
            rows=recipe.unlikelihood_rows, prefix=recipe.onpolicy_prefix, new_tokens=recipe.unlikelihood_new_tokens,
        )  # fmt: skip
        target_stats = fine_tune(target, train_ids, tune, data, dtype, draft=draft)
        R.save(target, tokenizer, out / "target")
        R.log(f"[round {number}] re-distilling the draft from it ({rounds.draft_steps} steps)")
        draft_stats = R.distil(
            draft, out, tokenizer, train_ids, sizing, data, dtype, f"draft, round {number}", rounds.draft_steps,
            rounds.draft_lr, rounds.top1,
        )  # fmt: skip
        stats.append({"round": number, "target": target_stats, "draft": draft_stats})
        R.log(f"[round {number}] done in {(time.perf_counter() - started) / 60:.1f} min")
    return stats


def coadapt_pair(out: Path, target_steps: tuple[int, ...], device: str | None = None, stdlib: Path | None = None) -> dict:
    """`--coadapt-only`: runs the rounds of `target_steps` not yet run on the pair trained in
    `out` (on `device`, default the recipe's), records them in out/report.json, and drops
    its evaluation, which was of the pair before them."""
    transformers_logging.disable_progress_bar()
    report = json.loads((out / "report.json").read_text())
    recipe = R.recipe_from_report(report["recipe"])
    done = report["training"].get("coadaptation", [])
    if tuple(target_steps[: len(done)]) != recipe.coadaptation.target_steps[: len(done)]:
        raise ValueError(
            f"this pair already ran co-adaptation rounds of {list(recipe.coadaptation.target_steps)} target steps; "
            f"--coadapt must start with them, got {list(target_steps)}"
        )
    if len(target_steps) <= len(done):
        raise ValueError(f"this pair already ran {len(done)} co-adaptation round(s); --coadapt names no further one")
    recipe = dataclasses.replace(
        recipe, device=device or recipe.device, threads=min(recipe.threads, os.cpu_count() or 1),
        coadaptation=dataclasses.replace(recipe.coadaptation, target_steps=tuple(target_steps)),
    )  # fmt: skip
    if recipe.device == "cuda" and not torch.cuda.is_available():
        raise RuntimeError("co-adaptation on cuda was asked for, and torch sees no GPU here")
    torch.set_num_threads(recipe.threads)
    dtype = R.training_dtype(recipe.precision, recipe.device)
    train_files, _ = R.trained_corpus(report, recipe, stdlib)
    tokenizer = PreTrainedTokenizerFast.from_pretrained(out / "target")
    started = time.perf_counter()
    rounds = run_rounds(out, recipe, R.encode_files(tokenizer, train_files), dtype, first=len(done) + 1)
    report["recipe"] = R.recipe_fields(dataclasses.replace(recipe, device=report["recipe"]["device"], threads=report["recipe"]["threads"]))
    report["training"]["coadaptation"] = done + rounds
    report["coadaptation_machine"] = R.training_machine(recipe, dtype)
    report["training_minutes"] = round(report["training_minutes"] + (time.perf_counter() - started) / 60, 1)
    for stale in ("evaluation", "evaluation_minutes", "total_minutes"):
        report.pop(stale, None)
    (out / "report.json").write_text(json.dumps(report, indent=1) + "\n")
    R.log(f"[coadapted] {len(done) + len(rounds)} round(s) in all; evaluate with --evaluate --out {out}")
    return report
