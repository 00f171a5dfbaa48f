"""The recipe of the embedded default pair: `python -m models.recipe` (add --toy for a
seconds-long run at tiny sizes, as the test suite does).

1. Corpus: the running interpreter's standard-library sources (found through sysconfig),
   without tests, site-packages and the generated data tables (pydoc_data, encodings);
   one file in `heldout_every` is held out, chosen by a hash of its path.
2. Tokenizer: byte-level BPE trained with `tokenizers`, saved for AutoTokenizer.
3. Target: a GPT-2 trained from scratch on the training files (next-token loss); where
   unlikelihood_steps is set, then fine-tuned with sequence-level unlikelihood so that its
   greedy continuations loop less (models/unlikelihood.py; the committed presets: none).
4. Draft: a much smaller GPT-2 distilled from the saved target: trained to match the
   target's next-token distributions (KL divergence), not the corpus tokens, on a mix of
   real training windows and the target's own greedy continuations of training-file
   prefixes, the text it will be asked to predict when it drafts (on-policy data, as in
   DistillSpec, Zhou et al. 2023). Where coadaptation.target_steps is set, rounds follow
   in which the target is tuned toward its draft and the draft re-distilled from it
   (models/coadapt.py; `--coadapt-only` runs them on a pair already trained).
5. Evaluation of the saved pair, loaded like any checkpoint: held-out losses beside a
   unigram baseline, greedy acceptance at k=4 on the held-out prompts, distinct 4-grams
   of 256-token greedy continuations beside those of the held-out files' own next 256
   tokens, forward costs; into report.json and model cards.

Fixed seeds and fixed step counts: a rerun on the same CPU gives the same pair; on a GPU
the same up to its nondeterministic kernels (two H200 runs of one target recipe ended at
held-out losses 3.349 and 3.346).
Steps 1-4 can run on a GPU (`--preset h200 --train-only`) and step 5 later on the CPU the
pair is sized for (`--evaluate DIR`), since the forward costs are the CPU's;
`python -m models.sizing` measures those costs for any shapes before training them.
"""

from __future__ import annotations

import argparse
import dataclasses
import hashlib
import json
import math
import re
import statistics
import subprocess
import sys
import sysconfig
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
from transformers import GPT2Config, GPT2LMHeadModel, PreTrainedTokenizerFast
from transformers.utils import logging as transformers_logging

from models.muon import Muon

if TYPE_CHECKING:
    from specdec.runtime import CausalLM

EOS = "<|endoftext|>"
EXCLUDED_PARTS = {"test", "tests", "idle_test", "site-packages", "__pycache__", "pydoc_data", "encodings"}
MODELS_DIR = Path(__file__).resolve().parent
PROMPTS_FILE = "heldout_prompts.json"
PRECISIONS = ("auto", "bfloat16", "float32")  # auto: bfloat16 on a GPU or where the CPU computes it natively
DEVICES = ("cpu", "cuda")
OPTIMIZERS = ("adamw", "muon")  # the target's; the draft always trains with AdamW


@dataclass(frozen=True)
class Shape:
    n_layer: int
    n_embd: int
    n_head: int


@dataclass(frozen=True)
class Coadaptation:
    """Rounds after distillation in which target and draft move toward each other
    (models/coadapt.py): each tunes the target toward its draft, then re-distils the draft
    from that target, warm-started."""

    target_steps: tuple[int, ...] = ()  # one entry per round: steps tuning the target; (): no rounds
    unlikelihood: float = 2.0  # weight of the unlikelihood term while the target is tuned ...
    agreement: float = 3.0  # ... and of the agreement term toward the draft's greedy choices
    draft_steps: int = 1200  # re-distillation steps per round
    draft_lr: float = 3e-4  # their peak learning rate
    top1: float = 1.0  # weight of a cross-entropy toward the target's greedy token beside the KL
    rows: int = 1024  # the tuned target's greedy continuations each re-distillation trains on
    batch_tokens: int = 4096  # tokens per re-distillation step


@dataclass(frozen=True)
class Recipe:
    seed: int = 0
    vocab_size: int = 4096
    context: int = 2048  # positions of both models
    heldout_every: int = 30  # one file in this many is held out
    max_files: int = 0  # 0: every file of the corpus
    target: Shape = Shape(n_layer=6, n_embd=384, n_head=6)
    draft: Shape = Shape(n_layer=2, n_embd=96, n_head=2)
    target_steps: int = 1650
    unlikelihood_steps: int = 0  # of sequence-level unlikelihood fine-tuning of the target before distillation; 0: none
    unlikelihood_rows: int = 16  # greedy continuations (and real windows) per unlikelihood step ...
    unlikelihood_new_tokens: int = 128  # ... of this many tokens, each from onpolicy_prefix training tokens
    unlikelihood_lr: float = 1e-4
    onpolicy_rows: int = 256  # target greedy continuations made for distillation ...
    onpolicy_prefix: int = 48  # ... each from this many training tokens ...
    onpolicy_new_tokens: int = 256  # ... continued by this many
    draft_steps: int = 900
    batch_tokens: int = 4096  # tokens per optimiser step
    short_seq: int = 512  # most steps train on windows this long ...
    long_every: int = 8  # ... and every this-many-th step on full-context windows
    target_lr: float = 1e-3
    target_optimizer: str = "adamw"  # one of OPTIMIZERS
    muon_lr: float = 0.02  # peak learning rate of the target's Muon-trained weight matrices
    draft_lr: float = 3e-3
    prompts: int = 24  # held-out prompts written and evaluated
    prompt_lines: int = 12  # a prompt is the first lines of a held-out file ...
    prompt_max_tokens: int = 96  # ... cut to at most this many tokens
    eval_tokens: int = 65536  # held-out tokens for the validation losses
    acceptance_tokens: int = 128  # new tokens per prompt when measuring acceptance
    distinct_tokens: int = 256  # new tokens per prompt for the distinct-4-gram share
    k: int = 4  # draft tokens per round when measuring acceptance
    cost_processes: int = 5  # fresh processes that each measure the forward costs; the report takes medians
    threads: int = 2
    device: str = "cpu"  # one of DEVICES: where steps 1-4 train (the evaluation runs on the CPU)
    dropout: float = 0.0  # the target's, while it trains (many epochs over the corpus call for some)
    onpolicy_batch: int = 32  # continuations generated at once
    compile: bool = True  # torch.compile the training forwards (1.45x in bfloat16, 1.22x in float32, where measured)
    precision: str = "auto"  # one of PRECISIONS: the training forwards' arithmetic
    coadaptation: Coadaptation = Coadaptation()  # rounds after distillation (the cpu preset: none)


TOY = Recipe(
    vocab_size=320, context=128, heldout_every=5, max_files=24,
    target=Shape(1, 32, 2), draft=Shape(1, 16, 2), target_steps=8, draft_steps=8,
    unlikelihood_steps=2, unlikelihood_rows=2, unlikelihood_new_tokens=8,
    onpolicy_rows=4, onpolicy_prefix=8, onpolicy_new_tokens=8,
    batch_tokens=256, short_seq=32, prompts=3, prompt_lines=4, prompt_max_tokens=16,
    eval_tokens=512, acceptance_tokens=12, distinct_tokens=16, compile=False, cost_processes=1,
    coadaptation=Coadaptation(target_steps=(2,), draft_steps=3, rows=4, batch_tokens=256),
)  # fmt: skip

# The same recipe on one H200: 16x the batch and 12x the tokens (30 passes over the corpus
# where the CPU preset makes 2.6), hence dropout. Chosen among four target runs there
# (4-16 passes; dropout 0, 0.1, 0.2; Muon or AdamW): Muon with dropout 0.2 and the most
# passes reached the lowest held-out loss and the least repetitive greedy continuations.
# Then three co-adaptation rounds, sized for a CPU (the committed pair ran them on this
# project's 2-core one with `--coadapt-only --device cpu`: 65.9 min in one command).
H200 = Recipe(
    target_steps=1200, onpolicy_rows=8192, onpolicy_batch=1024, draft_steps=3000, batch_tokens=65536,
    target_lr=2e-3, target_optimizer="muon", threads=8, device="cuda", dropout=0.2, compile=False,
    coadaptation=Coadaptation(target_steps=(240, 120, 120)),
)  # fmt: skip
PRESETS = {"cpu": Recipe(), "h200": H200, "toy": TOY}


def log(message: str) -> None:
    print(message, flush=True)


# 1. corpus ----------------------------------------------------------------------------


@dataclass(frozen=True)
class Source:
    path: str  # relative to the standard library's root
    text: str


def stdlib_sources(max_files: int, root: Path | None = None) -> list[Source]:
    """The standard library's sources: this interpreter's, or those under root (a copy)."""
    root = root or Path(sysconfig.get_paths()["stdlib"])
    paths = sorted(
        p for p in root.rglob("*.py")
        if not any(part in EXCLUDED_PARTS or part.startswith("test_") for part in p.relative_to(root).parts)
    )  # fmt: skip
    if max_files:
        paths = paths[:max_files]
    return [Source(str(p.relative_to(root)), p.read_text(encoding="utf-8", errors="replace")) for p in paths]


def is_heldout(path: str, every: int) -> bool:
    return int(hashlib.sha256(path.encode()).hexdigest(), 16) % every == 0


def corpus_digest(sources: list[Source]) -> str:
    """sha256 of every file's path and text: the evaluation checks it sees the training corpus."""
    digest = hashlib.sha256()
    for source in sources:
        digest.update(f"{source.path}\0{len(source.text)}\0{source.text}".encode())
    return digest.hexdigest()


def require_corpus(report: dict, sources: list[Source]) -> None:
    """Raises unless `sources` are the corpus that report.json says the pair was trained on."""
    if corpus_digest(sources) != report["corpus"]["digest"]:
        raise ValueError("this standard library is not the corpus the pair was trained on (digests differ)")


def split_by_file(sources: list[Source], every: int) -> tuple[list[Source], list[Source]]:
    """(training files, held-out files)."""
    return [s for s in sources if not is_heldout(s.path, every)], [s for s in sources if is_heldout(s.path, every)]


def trained_corpus(report: dict, recipe: Recipe, stdlib: Path | None = None) -> tuple[list[Source], list[Source]]:
    """(training files, held-out files) of the pair that report.json describes, read from this
    interpreter's standard library (or the copy in stdlib) once it is checked to be that corpus."""
    sources = stdlib_sources(recipe.max_files, stdlib)
    require_corpus(report, sources)
    return split_by_file(sources, recipe.heldout_every)


# 2. tokenizer -------------------------------------------------------------------------


def train_tokenizer(texts: list[str], vocab_size: int) -> PreTrainedTokenizerFast:
    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size, special_tokens=[EOS], initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )  # fmt: skip
    tokenizer.train_from_iterator(texts, trainer)
    return PreTrainedTokenizerFast(
        tokenizer_object=tokenizer, eos_token=EOS, bos_token=EOS, unk_token=EOS, clean_up_tokenization_spaces=False
    )


def encode_files(tokenizer: PreTrainedTokenizerFast, sources: list[Source]) -> torch.Tensor:
    """All files' tokens, each file followed by EOS, as one 1-D tensor."""
    ids: list[int] = []
    for source in sources:
        ids += tokenizer.encode(source.text) + [tokenizer.eos_token_id]
    return torch.tensor(ids, dtype=torch.long)


def heldout_prompts(tokenizer: PreTrainedTokenizerFast, heldout: list[Source], recipe: Recipe) -> list[dict]:
    prompts = []
    for source in heldout:
        lines = source.text.splitlines(keepends=True)[: recipe.prompt_lines]
        ids = tokenizer.encode("".join(lines))[: recipe.prompt_max_tokens]
        if len(lines) >= 3 and len(ids) >= 8:
            prompts.append({"file": source.path, "prompt": tokenizer.decode(ids)})
        if len(prompts) == recipe.prompts:
            break
    return prompts


# 3-4. training ------------------------------------------------------------------------


def gpt2_config(shape: Shape, vocab_size: int, eos_token_id: int, context: int, dropout: float = 0.0) -> GPT2Config:
    return GPT2Config(
        vocab_size=vocab_size, n_positions=context, n_embd=shape.n_embd, n_layer=shape.n_layer,
        n_head=shape.n_head, bos_token_id=eos_token_id, eos_token_id=eos_token_id,
        resid_pdrop=dropout, embd_pdrop=dropout, attn_pdrop=dropout,
    )  # fmt: skip


def new_gpt2(shape: Shape, tokenizer: PreTrainedTokenizerFast, context: int, dropout: float = 0.0) -> GPT2LMHeadModel:
    return GPT2LMHeadModel(gpt2_config(shape, len(tokenizer), tokenizer.eos_token_id, context, dropout))


def windows(ids: torch.Tensor, rows: int, length: int, generator: torch.Generator) -> torch.Tensor:
    """rows random windows of `length` consecutive training tokens, [rows, length]."""
    starts = torch.randint(0, len(ids) - length, (rows,), generator=generator)
    return torch.stack([ids[s : s + length] for s in starts.tolist()])


def pretraining_batch(ids: torch.Tensor, recipe: Recipe, step: int, generator: torch.Generator) -> torch.Tensor:
    """Windows of seq+1 tokens; every long_every-th step uses full-context windows."""
    seq = recipe.context if step % recipe.long_every == recipe.long_every - 1 else recipe.short_seq
    return windows(ids, max(1, recipe.batch_tokens // seq), seq + 1, generator)


def optimizers(model: torch.nn.Module, lr: float, kind: str = "adamw", muon_lr: float = 0.02) -> list[torch.optim.Optimizer]:
    """AdamW for every parameter; or Muon for the transformer blocks' weight matrices and
    AdamW for the rest (embeddings, norms, biases). A group's "scale" is its peak learning
    rate over lr, which the schedule multiplies."""
    if kind not in OPTIMIZERS:
        raise ValueError(f"optimizer must be one of {OPTIMIZERS}, got {kind!r}")
    hidden = [p for name, p in model.named_parameters() if kind == "muon" and p.dim() == 2 and ".h." in name]
    in_muon = {id(p) for p in hidden}
    decay = [p for p in model.parameters() if p.dim() >= 2 and id(p) not in in_muon]
    rest = [p for p in model.parameters() if p.dim() < 2]
    groups = [{"params": decay, "weight_decay": 0.1, "scale": 1.0}, {"params": rest, "weight_decay": 0.0, "scale": 1.0}]
    chosen: list[torch.optim.Optimizer] = [torch.optim.AdamW(groups, lr=lr, betas=(0.9, 0.95))]
    if hidden:
        chosen.append(Muon([{"params": hidden, "scale": muon_lr / lr}], lr=muon_lr))
    return chosen


def cosine(peak: float, steps: int) -> Callable[[int], float]:
    """Linear warm-up over 5% of the steps, then cosine decay to a tenth of the peak."""
    warmup = max(1, steps // 20)

    def lr_at(step: int) -> float:
        if step < warmup:
            return peak * (step + 1) / warmup
        progress = (step - warmup) / max(1, steps - warmup)
        return peak * (0.1 + 0.45 * (1 + math.cos(math.pi * progress)))

    return lr_at


def train(
    model: GPT2LMHeadModel, name: str, steps: int, lr_at: Callable[[int], float], step_loss,
    opts: list[torch.optim.Optimizer], after_step: Callable[[int, int], None] | None = None,
) -> dict:  # fmt: skip
    """Runs `steps` optimiser steps of step_loss(step) -> (loss, tokens), with progress
    lines; after_step(steps done, tokens so far) runs after each (and may evaluate)."""
    model.train()
    start, tokens, every = time.perf_counter(), 0, max(1, steps // 40)
    recent: list[float] = []
    for step in range(steps):
        for opt in opts:
            for group in opt.param_groups:
                group["lr"] = lr_at(step) * group["scale"]
        loss, step_tokens = step_loss(step)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        for opt in opts:
            opt.step()
            opt.zero_grad(set_to_none=True)
        tokens += step_tokens
        if after_step is not None:
            after_step(step + 1, tokens)
        recent = (recent + [loss.item()])[-every:]
        if (step + 1) % every == 0 or step + 1 == steps:
            elapsed = time.perf_counter() - start
            eta = elapsed / (step + 1) * (steps - step - 1)
            log(
                f"[{name}] step {step + 1}/{steps}  loss {sum(recent) / len(recent):.3f}  "
                f"{tokens / elapsed:.0f} tokens/s  elapsed {elapsed / 60:.1f} min  eta {eta / 60:.1f} min"
            )
    model.eval()
    return {"steps": steps, "tokens": tokens, "seconds": round(time.perf_counter() - start, 1)}


def native_bf16() -> bool:
    """Whether this CPU has bfloat16 instructions (AVX-512 BF16 or AMX)."""
    return torch.cpu._is_avx512_bf16_supported() or torch.cpu._is_amx_tile_supported()


def training_dtype(precision: str, device: str = "cpu") -> torch.dtype:
    """bfloat16 autocast on a GPU, and on a CPU only where it computes bfloat16 natively.
    Elsewhere torch emulates it: on an AVX2-only EPYC, 11 eager training steps of the 13M
    target in bfloat16 did not finish in 10 minutes, where float32 ran 918 tokens/s eager
    and 1,117 compiled."""
    if precision not in PRECISIONS:
        raise ValueError(f"precision must be one of {PRECISIONS}, got {precision!r}")
    if precision == "auto":
        return torch.bfloat16 if device == "cuda" or native_bf16() else torch.float32
    return getattr(torch, precision)


def autocast(dtype: torch.dtype, device: torch.device | str = "cpu") -> torch.autocast:
    return torch.autocast(torch.device(device).type, dtype=torch.bfloat16, enabled=dtype == torch.bfloat16)


def next_token_loss(model: torch.nn.Module, batch: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    with autocast(dtype, batch.device):
        logits = model(input_ids=batch[:, :-1]).logits
    return F.cross_entropy(logits.float().flatten(0, 1), batch[:, 1:].flatten())


@torch.no_grad()
def greedy_continuations(
    model: GPT2LMHeadModel, ids: torch.Tensor, recipe: Recipe, generator: torch.Generator, dtype: torch.dtype
) -> torch.Tensor:  # fmt: skip
    """[onpolicy_rows, prefix + new] token ids: training-file prefixes and the model's greedy
    continuations of them, generated in batches with progress lines."""
    rows, batch, start = [], recipe.onpolicy_batch, time.perf_counter()
    device = next(model.parameters()).device
    for first in range(0, recipe.onpolicy_rows, batch):
        prefixes = windows(ids, min(batch, recipe.onpolicy_rows - first), recipe.onpolicy_prefix, generator).to(device)
        with autocast(dtype, device):
            rows.append(
                model.generate(
                    prefixes, attention_mask=torch.ones_like(prefixes), max_new_tokens=recipe.onpolicy_new_tokens,
                    do_sample=False, pad_token_id=0, eos_token_id=None,
                ).cpu()
            )  # fmt: skip
        done = first + len(prefixes)
        log(f"[continuations] {done}/{recipe.onpolicy_rows} rows  elapsed {(time.perf_counter() - start) / 60:.1f} min")
    return torch.cat(rows)


def distillation_batch(
    ids: torch.Tensor, continuations: torch.Tensor, recipe: Recipe, step: int, generator: torch.Generator
) -> tuple[torch.Tensor, torch.Tensor]:  # fmt: skip
    """(batch, picked): full-context real windows every long_every-th step (the draft must
    learn every position); otherwise half the rows are target continuations, half real
    windows. picked: which continuations head the batch (none on full-context steps)."""
    if step % recipe.long_every == recipe.long_every - 1:
        return pretraining_batch(ids, recipe, step, generator), torch.zeros(0, dtype=torch.long)
    half = continuations_per_batch(recipe, continuations.shape[1])
    picked = torch.randint(len(continuations), (half,), generator=generator)
    return torch.cat([continuations[picked], windows(ids, half, continuations.shape[1], generator)]), picked


def continuations_per_batch(recipe: Recipe, length: int) -> int:
    return max(1, recipe.batch_tokens // (2 * length))


@torch.no_grad()
def teacher_logits(teacher: torch.nn.Module, inputs: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """[rows, length, vocab] the teacher's next-token logits (bfloat16 under autocast)."""
    with autocast(dtype, inputs.device):
        return teacher(input_ids=inputs).logits


def continuation_logits(teacher: torch.nn.Module, continuations: torch.Tensor, rows: int, dtype: torch.dtype) -> torch.Tensor:
    """[continuations, length - 1, vocab] the teacher's logits on every continuation, computed
    once, `rows` at a time, on the teacher's device: distillation draws each continuation
    many times (about 8 times in a CPU round), and a row's logits do not depend on the rows
    beside it (checked to the bit on a CPU). A CPU round's 1,024 take 2.5 GB in bfloat16;
    the h200 preset's 8,192, 20 GB of the GPU's memory."""
    device = next(teacher.parameters()).device
    known = None
    for start in range(0, len(continuations), rows):
        logits = teacher_logits(teacher, continuations[start : start + rows, :-1].to(device), dtype)
        if known is None:
            known = logits.new_empty((len(continuations), *logits.shape[1:]))
        known[start : start + len(logits)] = logits
    return known


def distillation_loss(target_logits: torch.Tensor, draft_logits: torch.Tensor, top1: float = 0.0) -> torch.Tensor:
    """KL(target || draft) of the next-token distributions at every position, plus top1
    times the cross-entropy toward the target's likeliest token: the one token greedy
    verification checks. Both logits [rows, length, vocab]."""
    target_logp = F.log_softmax(target_logits.float(), dim=-1).flatten(0, 1)
    draft_logp = F.log_softmax(draft_logits.float(), dim=-1).flatten(0, 1)
    loss = F.kl_div(draft_logp, target_logp, log_target=True, reduction="batchmean")
    return loss + top1 * F.nll_loss(draft_logp, target_logp.argmax(-1)) if top1 else loss


def distil(
    draft: GPT2LMHeadModel, out: Path, tokenizer: PreTrainedTokenizerFast, train_ids: torch.Tensor, recipe: Recipe,
    data: torch.Generator, dtype: torch.dtype, name: str, steps: int, lr: float, top1: float = 0.0,
) -> dict:  # fmt: skip
    """Distils `draft` from the target saved in out (exactly as the services will run it) for
    `steps` steps on real windows and recipe.onpolicy_rows of that target's greedy
    continuations, saves it to out/draft and returns its training figures."""
    device = next(draft.parameters()).device
    saved_target = GPT2LMHeadModel.from_pretrained(out / "target", dtype=torch.float32).to(device).eval()
    continuations = greedy_continuations(saved_target, train_ids, recipe, data, dtype)
    teacher, fast_draft = compiled(saved_target, recipe), compiled(draft, recipe)
    loss_of = torch.compile(distillation_loss, dynamic=False) if recipe.compile else distillation_loss
    started = time.perf_counter()
    known = continuation_logits(teacher, continuations, continuations_per_batch(recipe, continuations.shape[1]), dtype)
    log(f"[{name}] the target's logits on the {len(continuations)} continuations in {(time.perf_counter() - started) / 60:.1f} min")

    def distillation_step(step: int):
        batch, picked = distillation_batch(train_ids, continuations, recipe, step, data)
        batch = batch.to(device)
        fresh = teacher_logits(teacher, batch[len(picked) :, :-1], dtype)
        target = torch.cat([known[picked.to(device)], fresh]) if len(picked) else fresh
        with autocast(dtype, device):
            draft_logits = fast_draft(input_ids=batch[:, :-1]).logits
        return loss_of(target, draft_logits, top1), batch[:, 1:].numel()

    stats = train(draft, name, steps, cosine(lr, steps), distillation_step, optimizers(draft, lr))
    save(draft, tokenizer, out / "draft")
    return stats


def compiled(model: torch.nn.Module, recipe: Recipe) -> torch.nn.Module:
    """The model's forward compiled for training speed (same parameters, same results)."""
    return torch.compile(model, dynamic=False) if recipe.compile else model


def save(model: GPT2LMHeadModel, tokenizer: PreTrainedTokenizerFast, path: Path) -> None:
    """fp16 weights (half the bytes); the services load them as float32."""
    path.mkdir(parents=True, exist_ok=True)
    model.generation_config.eos_token_id = tokenizer.eos_token_id
    model.generation_config.bos_token_id = tokenizer.eos_token_id
    model.to(torch.float16).save_pretrained(path)
    model.to(torch.float32)
    tokenizer.save_pretrained(path)
    # transformers records where a loaded tokenizer came from; that is not part of the pair
    config = path / "tokenizer_config.json"
    fields = json.loads(config.read_text())
    config.write_text(json.dumps({k: v for k, v in fields.items() if k not in ("is_local", "local_files_only")}, indent=2) + "\n")


# 5. evaluation ------------------------------------------------------------------------


@torch.inference_mode()
def heldout_loss(model: CausalLM, ids: torch.Tensor, window: int) -> float:
    """Mean next-token cross-entropy (nats) over non-overlapping windows."""
    total, count = 0.0, 0
    for start in range(0, len(ids) - 1, window):
        chunk = ids[start : start + window + 1]
        if len(chunk) < 2:
            break
        logits = model.forward(model.new_cache(len(chunk)), chunk[:-1].tolist())
        total += F.cross_entropy(logits, chunk[1:], reduction="sum").item()
        count += len(chunk) - 1
    return total / count


def unigram_loss(train_ids: torch.Tensor, eval_ids: torch.Tensor, vocab: int) -> float:
    """Cross-entropy of add-one-smoothed training-token frequencies on eval_ids."""
    counts = torch.bincount(train_ids, minlength=vocab).double() + 1
    logp = (counts / counts.sum()).log()
    return float(-logp[eval_ids[1:]].mean())


def distinct_4gram_share(tokens: list[int]) -> float:
    grams = [tuple(tokens[i : i + 4]) for i in range(len(tokens) - 3)]
    return len(set(grams)) / len(grams) if grams else 0.0


def real_continuation(tokenizer: PreTrainedTokenizerFast, source: Source, prompt: str, length: int) -> list[int]:
    """The first `length` tokens of what follows `prompt` in its held-out file: what the
    file itself says next, the reference for the target's greedy continuations."""
    if not source.text.startswith(prompt):
        raise ValueError(f"the prompt is not the start of {source.path}")
    return tokenizer.encode(source.text[len(prompt) :])[:length]


def measured_costs(target_dir: Path, draft_dir: Path, recipe: Recipe) -> dict:
    """The pair's forward costs (docs/design.md's c and v(k)): `python -m specdec.costs` in
    recipe.cost_processes fresh processes, one after another, each figure the median over
    them and c's value in each beside it. The figures vary from process to process: c of
    the committed pair ranged 0.076-0.101 over twelve."""
    from specdec.host import cpu_model

    context = min(512, recipe.context // 2)
    command = [sys.executable, "-m", "specdec.costs", str(target_dir), str(draft_dir), "--context", str(context), "--threads", str(COST_THREADS)]
    runs = []
    for process in range(1, recipe.cost_processes + 1):
        done = subprocess.run(command, capture_output=True, text=True)
        if done.returncode:
            raise RuntimeError(f"{' '.join(command)} exited with {done.returncode}:\n{done.stderr[-2000:]}")
        runs.append(json.loads(done.stdout.splitlines()[-1]))
        log(f"[eval] forward costs, process {process}/{recipe.cost_processes}: c {runs[-1]['c']:.3f}, v(8) {runs[-1]['v8']:.2f}")
    figures = {key: statistics.median(run[key] for run in runs) for key in ("target_step_ms", "draft_step_ms", "c", "v4", "v8")}
    return {
        **figures, "c_per_process": [run["c"] for run in runs], "context": context, "threads": COST_THREADS,
        "machine": cpu_model() or "an unnamed CPU", "runtime": runs[0]["runtime"],
    }  # fmt: skip


def evaluate(
    target_dir: Path, draft_dir: Path, prompts: list[dict], heldout: list[Source], train_ids, eval_ids, recipe: Recipe
) -> dict:  # fmt: skip
    # Imported here so that steps 1-4 also run where the services' dependencies are not installed.
    from specdec.lossless import first_divergence
    from specdec.offline import speculate
    from specdec.runtime import CausalLM, ModelSpec

    target = CausalLM.load(ModelSpec(str(target_dir)))
    draft = CausalLM.load(ModelSpec(str(draft_dir)))
    tokenizer = PreTrainedTokenizerFast.from_pretrained(target_dir)
    window = min(512, recipe.context - 1)
    log("[eval] held-out losses ...")
    losses = {
        "target": heldout_loss(target, eval_ids, window),
        "draft": heldout_loss(draft, eval_ids, window),
        "unigram": unigram_loss(train_ids, eval_ids, len(tokenizer)),
    }
    log(f"[eval] held-out loss (nats/token): target {losses['target']:.3f}, draft {losses['draft']:.3f}, unigram {losses['unigram']:.3f}")
    per_prompt, proposed, accepted, shares, real_shares, divergences = [], 0, 0, [], [], []
    files = {source.path: source for source in heldout}
    for i, item in enumerate(prompts):
        ids = tokenizer.encode(item["prompt"])
        spec = speculate(target, draft, ids, recipe.acceptance_tokens, recipe.k)
        alone = speculate(target, None, ids, recipe.distinct_tokens, 0)
        divergence = first_divergence(target, ids, alone.tokens[: recipe.acceptance_tokens], spec.tokens)
        if divergence is not None:
            divergences.append({"file": item["file"], **dataclasses.asdict(divergence)})
        proposed += spec.proposed
        accepted += spec.accepted
        shares.append(distinct_4gram_share(alone.tokens))
        real = real_continuation(tokenizer, files[item["file"]], item["prompt"], recipe.distinct_tokens)
        real_shares.append(distinct_4gram_share(real))
        per_prompt.append({
            "file": item["file"], "acceptance": spec.accepted / spec.proposed, "distinct_4gram": shares[-1],
            "distinct_4gram_real": real_shares[-1],
        })  # fmt: skip
        log(
            f"[eval] prompt {i + 1}/{len(prompts)} {item['file']}: acceptance {per_prompt[-1]['acceptance']:.2f}, "
            f"distinct 4-grams {shares[-1]:.2f} (the file's own text: {real_shares[-1]:.2f})"
        )
    costs = measured_costs(target_dir, draft_dir, recipe)
    return {
        "heldout_loss": losses,
        "acceptance_rate": accepted / proposed,
        "acceptance_k": recipe.k,
        "acceptance_tokens_per_prompt": recipe.acceptance_tokens,
        "distinct_4gram_mean": sum(shares) / len(shares),
        "distinct_4gram_min": min(shares),
        "distinct_4gram_real_mean": sum(real_shares) / len(real_shares),  # of the held-out files' own text
        "greedy_divergences": divergences,
        "per_prompt": per_prompt,
        "costs": costs,
        "parameters": {"target": target.parameters, "draft": draft.parameters},
    }


# model cards ---------------------------------------------------------------------------


def changed_settings(fields: dict, preset: dict) -> list[str]:
    """'field=value' for each recipe field that differs from the preset's: a Shape as
    --draft-shape takes it, the co-adaptation's fields one by one."""
    changed = []
    for field, value in fields.items():
        if field == "coadaptation":
            changed += [
                f"coadaptation.{name}={','.join(map(str, part)) if isinstance(part, list) else part}"
                for name, part in value.items() if preset[field].get(name) != part
            ]  # fmt: skip
        elif preset.get(field) != value:
            changed.append(f"{field}={','.join(map(str, value.values())) if isinstance(value, dict) else value}")
    return changed


def spread(values: list[float]) -> str:
    """' (median of 5 processes, 0.076-0.101)' for a figure measured in several processes."""
    return f" (median of {len(values)} processes, {min(values):.3f}-{max(values):.3f})" if len(values) > 1 else ""


def model_card(name: str, shape: Shape, report: dict) -> str:
    e, t = report["evaluation"], report["training"][name]
    costs = e["costs"]
    changed = ", ".join(changed_settings(report["recipe"], recipe_fields(PRESETS[report["preset"]])))
    lines = [
        f"# specdec default {name}",
        "",
        f"Made by `python -m models.recipe --preset {report['preset']}`{f' with {changed}' if changed else ''} "
        f"(seed {report['recipe']['seed']}); "
        f"trained on {report['machine']}"
        + (f", co-adapted on {report['coadaptation_machine']}" if "coadaptation_machine" in report else "")
        + f", evaluated on {costs['threads']} threads of {costs['machine']}.",
        "Python standard-library sources "
        f"({report['corpus']['python']}), tests and generated tables excluded; "
        f"{report['corpus']['train_files']} training files ({report['corpus']['train_tokens']} tokens), "
        f"{report['corpus']['heldout_files']} held-out files.",
        "",
        "| | |",
        "| --- | --- |",
        f"| architecture | GPT-2, {shape.n_layer} layers, width {shape.n_embd}, {shape.n_head} heads, "
        f"{report['recipe']['context']} positions |",
        f"| parameters | {e['parameters'][name]:,} (stored as float16, served as float32) |",
        f"| tokenizer | byte-level BPE, {report['recipe']['vocab_size']} tokens, shared by target and draft |",
        f"| training | {t['steps']} steps, {t['tokens']:,} tokens, {t['seconds'] / 60:.1f} min |",
        f"| held-out loss | {e['heldout_loss'][name]:.3f} nats/token (unigram baseline {e['heldout_loss']['unigram']:.3f}) |",
        f"| one forward step | {costs[name + '_step_ms']:.2f} ms (batch 1, cache of {costs['context']} tokens, "
        f"{costs['runtime']} runtime, {costs['threads']} CPU threads) |",
    ]
    rounds = report["training"].get("coadaptation", [])
    settings = report["recipe"].get("coadaptation", {})
    if name == "draft":
        lines += [
            "| objective | KL divergence to the target's next-token distributions (distillation), on real "
            f"windows and {report['recipe']['onpolicy_rows']} greedy continuations by the target"
            + (f"; then re-distilled in {len(rounds)} co-adaptation round(s) from the target tuned toward it "
               f"(KL plus {settings['top1']} x cross-entropy toward its greedy token, {settings['rows']} fresh "
               f"continuations each; {sum(r['draft']['tokens'] for r in rounds):,} tokens, "
               f"{sum(r['draft']['seconds'] for r in rounds) / 60:.1f} min)" if rounds else "")
            + " |",
            f"| greedy acceptance vs the target | {e['acceptance_rate']:.3f} at k={e['acceptance_k']} "
            f"on {len(e['per_prompt'])} held-out prompts ({e['acceptance_tokens_per_prompt']} new tokens each) |",
            f"| cost ratio c (draft step / target step) | {costs['c']:.3f}{spread(costs['c_per_process'])} |",
        ]
    else:
        tuned = report["training"].get("unlikelihood")
        lines += [
            "| objective | next-token cross-entropy"
            + (f"; then {tuned['steps']} steps of sequence-level unlikelihood on its own greedy continuations "
               f"({tuned['tokens']:,} tokens, {tuned['seconds'] / 60:.1f} min)" if tuned else "")
            + (f"; then {len(rounds)} co-adaptation round(s), each tuning it toward its draft "
               f"({'+'.join(str(r['target']['steps']) for r in rounds)} steps of unlikelihood, weight "
               f"{settings['unlikelihood']}, and agreement with the draft's greedy choices, weight {settings['agreement']}; "
               f"{sum(r['target']['tokens'] for r in rounds):,} tokens, {sum(r['target']['seconds'] for r in rounds) / 60:.1f} min)"
               if rounds else "")
            + " |",
            f"| verify cost v(4), v(8) | {costs['v4']:.2f}, {costs['v8']:.2f} (k+1 positions / one step) |",
            f"| distinct 4-grams, {report['recipe']['distinct_tokens']}-token greedy continuations | "
            f"mean {e['distinct_4gram_mean']:.2f}, "
            f"min {e['distinct_4gram_min']:.2f} (the held-out files' own next tokens: mean "
            f"{e['distinct_4gram_real_mean']:.2f}) |",
        ]
    return "\n".join(lines) + "\n"


# the recipe ----------------------------------------------------------------------------

COST_THREADS = 2  # the sizing's: forward costs are measured on 2 CPU threads, batch 1


def recipe_fields(recipe: Recipe) -> dict:
    """The recipe as report.json holds it (tuples as lists)."""
    return json.loads(json.dumps(dataclasses.asdict(recipe)))


def recipe_from_report(fields: dict) -> Recipe:
    rounds = fields.get("coadaptation", {})
    return Recipe(**{
        **fields, "target": Shape(**fields["target"]), "draft": Shape(**fields["draft"]),
        "coadaptation": Coadaptation(**{**rounds, "target_steps": tuple(rounds.get("target_steps", ()))}),
    })  # fmt: skip


def training_machine(recipe: Recipe, dtype: torch.dtype) -> str:
    where = torch.cuda.get_device_name() if recipe.device == "cuda" else f"{torch.get_num_threads()} CPU threads"
    return f"{where}, torch {torch.__version__}, training in {str(dtype).removeprefix('torch.')}"


def train_pair(recipe: Recipe, out: Path, preset: str, stdlib: Path | None = None) -> dict:
    """Steps 1-4: writes the pair, the held-out prompts and report.json (without evaluation)."""
    if recipe.device not in DEVICES:
        raise ValueError(f"device must be one of {DEVICES}, got {recipe.device!r}")
    if recipe.device == "cuda" and not torch.cuda.is_available():
        raise RuntimeError("this preset trains on a GPU, and torch sees none here")
    transformers_logging.disable_progress_bar()  # the recipe prints its own progress
    torch.manual_seed(recipe.seed)
    torch.set_num_threads(recipe.threads)
    device = torch.device(recipe.device)
    dtype = training_dtype(recipe.precision, recipe.device)
    started = time.perf_counter()
    sources = stdlib_sources(recipe.max_files, stdlib)
    train_files, heldout_files = split_by_file(sources, recipe.heldout_every)
    log(f"[corpus] {len(train_files)} training files, {len(heldout_files)} held-out files; training in {dtype} on {device}")

    tokenizer = train_tokenizer([s.text for s in train_files], recipe.vocab_size)
    train_ids = encode_files(tokenizer, train_files)
    prompts = heldout_prompts(tokenizer, heldout_files, recipe)
    out.mkdir(parents=True, exist_ok=True)
    (out / PROMPTS_FILE).write_text(json.dumps(prompts, indent=1, ensure_ascii=False) + "\n")
    log(f"[tokenizer] {len(tokenizer)} tokens; corpus {len(train_ids):,} training tokens; {len(prompts)} held-out prompts")

    target = new_gpt2(recipe.target, tokenizer, recipe.context, recipe.dropout).to(device)
    fast_target = compiled(target, recipe)
    data = torch.Generator().manual_seed(recipe.seed)

    def pretraining_loss(step: int):
        batch = pretraining_batch(train_ids, recipe, step, data).to(device)
        return next_token_loss(fast_target, batch, dtype), batch[:, 1:].numel()

    target_opts = optimizers(target, recipe.target_lr, recipe.target_optimizer, recipe.muon_lr)
    target_stats = train(target, "target", recipe.target_steps, cosine(recipe.target_lr, recipe.target_steps), pretraining_loss, target_opts)
    save(target, tokenizer, out / "target")
    stats = {"target": target_stats}
    if recipe.unlikelihood_steps:
        from models.unlikelihood import Tune, fine_tune, tunable  # that module builds on this one's helpers

        tune = Tune(
            steps=recipe.unlikelihood_steps, lr=recipe.unlikelihood_lr, rows=recipe.unlikelihood_rows,
            prefix=recipe.onpolicy_prefix, new_tokens=recipe.unlikelihood_new_tokens,
        )  # fmt: skip
        tuned = tunable(out / "target").to(device)
        stats["unlikelihood"] = fine_tune(tuned, train_ids, tune, data, dtype)
        save(tuned, tokenizer, out / "target")
    draft = new_gpt2(recipe.draft, tokenizer, recipe.context).to(device)
    draft_stats = distil(draft, out, tokenizer, train_ids, recipe, data, dtype, "draft", recipe.draft_steps, recipe.draft_lr)
    if recipe.coadaptation.target_steps:
        from models.coadapt import run_rounds  # that module builds on this one's helpers

        stats["coadaptation"] = run_rounds(out, recipe, train_ids, dtype)
    report = {
        "preset": preset,
        "recipe": recipe_fields(recipe),
        "machine": training_machine(recipe, dtype),
        "corpus": {
            "python": sys.version.split()[0] if stdlib is None else f"the copy in {stdlib.name}",
            "digest": corpus_digest(sources),
            "train_files": len(train_files),
            "heldout_files": len(heldout_files),
            "train_tokens": len(train_ids),
        },
        "training": {**stats, "draft": draft_stats},
        "training_minutes": round((time.perf_counter() - started) / 60, 1),
    }
    (out / "report.json").write_text(json.dumps(report, indent=1) + "\n")
    log(f"[trained] {report['training_minutes']} min; pair in {out}")
    return report


def evaluate_pair(out: Path, stdlib: Path | None = None) -> dict:
    """Step 5 on this machine: the saved pair's losses, acceptance, repetition and costs,
    added to out/report.json, and the model cards. The corpus must be the training one."""
    report = json.loads((out / "report.json").read_text())
    recipe = recipe_from_report(report["recipe"])
    torch.set_num_threads(COST_THREADS)
    started = time.perf_counter()
    train_files, heldout_files = trained_corpus(report, recipe, stdlib)
    if stdlib is None:
        report["corpus"]["python"] = sys.version.split()[0]
    tokenizer = PreTrainedTokenizerFast.from_pretrained(out / "target")
    train_ids = encode_files(tokenizer, train_files)
    eval_ids = encode_files(tokenizer, heldout_files)[: recipe.eval_tokens]
    report["corpus"]["eval_tokens"] = len(eval_ids)
    prompts = json.loads((out / PROMPTS_FILE).read_text())
    report["recipe"] = recipe_fields(recipe)  # with any evaluation setting an older report lacks
    report["evaluation"] = evaluate(out / "target", out / "draft", prompts, heldout_files, train_ids, eval_ids, recipe)
    report["evaluation_minutes"] = round((time.perf_counter() - started) / 60, 1)
    report["total_minutes"] = round(report["training_minutes"] + report["evaluation_minutes"], 1)
    (out / "report.json").write_text(json.dumps(report, indent=1) + "\n")
    (out / "target" / "README.md").write_text(model_card("target", recipe.target, report))
    (out / "draft" / "README.md").write_text(model_card("draft", recipe.draft, report))
    evaluation = report["evaluation"]
    log(
        f"[done] {report['total_minutes']} min: acceptance {evaluation['acceptance_rate']:.3f} at k={recipe.k}, "
        f"c {evaluation['costs']['c']:.3f}, v(8) {evaluation['costs']['v8']:.2f}, "
        f"distinct 4-grams {evaluation['distinct_4gram_mean']:.2f}; pair in {out}"
    )
    return report


def run(recipe: Recipe, out: Path, preset: str = "cpu", stdlib: Path | None = None) -> dict:
    """The whole recipe on this machine: steps 1-4, then the evaluation."""
    train_pair(recipe, out, preset, stdlib)
    return evaluate_pair(out, stdlib)


def shape_arg(text: str) -> Shape:
    """'2,192,4' (or '2/192/4') -> Shape(n_layer=2, n_embd=192, n_head=4)."""
    try:
        layers, width, heads = (int(part) for part in re.split("[,/]", text))
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected LAYERS,WIDTH,HEADS (three integers), got {text!r}") from None
    if min(layers, width, heads) < 1 or width % heads:
        raise argparse.ArgumentTypeError(f"need positive numbers and a width divisible by the heads, got {text!r}")
    return Shape(layers, width, heads)


def steps_arg(text: str) -> tuple[int, ...]:
    """'240,120' -> (240, 120); '' -> () (no rounds)."""
    try:
        steps = tuple(int(part) for part in text.split(",") if part.strip())
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected step counts separated by commas, got {text!r}") from None
    if any(n < 1 for n in steps):
        raise argparse.ArgumentTypeError(f"each round needs at least one step, got {text!r}")
    return steps


def add_shape_flags(parser: argparse.ArgumentParser) -> None:
    """--target-shape and --draft-shape, for with_shapes."""
    for model in ("target", "draft"):
        parser.add_argument(f"--{model}-shape", type=shape_arg, metavar="LAYERS,WIDTH,HEADS", help=f"the {model}'s shape (default: the preset's)")


def with_shapes(recipe: Recipe, args: argparse.Namespace) -> Recipe:
    """The recipe with the shapes that add_shape_flags' flags give, where given."""
    return dataclasses.replace(recipe, target=args.target_shape or recipe.target, draft=args.draft_shape or recipe.draft)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m models.recipe", description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=Path, default=MODELS_DIR, help="where the pair, prompts and report go")
    parser.add_argument(
        "--preset", choices=sorted(PRESETS), default="cpu",
        help="cpu: the 2-core CPU sizing (about 70 min); h200: one H200 GPU; toy: tiny sizes, seconds, as the tests run it",
    )  # fmt: skip
    parser.add_argument("--toy", action="store_true", help="the same as --preset toy")
    parser.add_argument(
        "--precision", choices=PRECISIONS, default="auto",
        help="arithmetic of the training forwards; auto: bfloat16 on a GPU or where the CPU has bfloat16 instructions, else float32",
    )  # fmt: skip
    parser.add_argument("--target-optimizer", choices=OPTIMIZERS, help="the target's optimiser (default: the preset's; the draft's is AdamW)")
    parser.add_argument(
        "--unlikelihood-steps", type=int, metavar="N",
        help="fine-tune the target with N steps of sequence-level unlikelihood before distilling the draft (default: the preset's)",
    )  # fmt: skip
    add_shape_flags(parser)
    parser.add_argument(
        "--coadapt", type=steps_arg, metavar="N[,N...]",
        help="after distillation, one co-adaptation round per N: N steps tuning the target toward its draft, then the draft re-distilled from it (default: the preset's)",
    )  # fmt: skip
    parser.add_argument("--device", choices=DEVICES, help="where training runs (default: the preset's)")
    parser.add_argument("--stdlib", type=Path, help="read the corpus from this copy of a standard library instead of this interpreter's")
    step = parser.add_mutually_exclusive_group()
    step.add_argument("--train-only", action="store_true", help="steps 1-4 only (on a GPU, say); evaluate later with --evaluate")
    step.add_argument("--evaluate", action="store_true", help="step 5 only, on the pair already trained in --out")
    step.add_argument(
        "--coadapt-only", action="store_true",
        help="the --coadapt rounds not yet run, on the pair already trained in --out; evaluate it again afterwards",
    )  # fmt: skip
    args = parser.parse_args(argv)
    preset = "toy" if args.toy else args.preset
    recipe = dataclasses.replace(PRESETS[preset], precision=args.precision)
    if args.target_optimizer:
        recipe = dataclasses.replace(recipe, target_optimizer=args.target_optimizer)
    if args.unlikelihood_steps is not None:
        if args.unlikelihood_steps < 0:
            parser.error(f"--unlikelihood-steps must be 0 or more, got {args.unlikelihood_steps}")
        recipe = dataclasses.replace(recipe, unlikelihood_steps=args.unlikelihood_steps)
    recipe = with_shapes(recipe, args)
    if args.coadapt is not None:
        recipe = dataclasses.replace(recipe, coadaptation=dataclasses.replace(recipe.coadaptation, target_steps=args.coadapt))
    if args.device:
        recipe = dataclasses.replace(recipe, device=args.device)
    if args.coadapt_only:
        if not args.coadapt:
            parser.error("--coadapt-only needs --coadapt")
        from models.coadapt import coadapt_pair

        coadapt_pair(args.out, args.coadapt, args.device, args.stdlib)
    elif args.evaluate:
        evaluate_pair(args.out, args.stdlib)
    elif args.train_only:
        train_pair(recipe, args.out, preset, args.stdlib)
    else:
        run(recipe, args.out, preset, args.stdlib)
    return 0


if __name__ == "__main__":
    sys.exit(main())
