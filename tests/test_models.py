"""The embedded default pair: the recipe runs end to end (toy scale), the committed pair
loads like any checkpoint, shares its tokenizer, reproduces its reported figures when
measured here (the quality goals it misses are strict expected failures), and serves
through `specdec serve` / `specdec generate`."""

from __future__ import annotations

import argparse
import dataclasses
import json
import signal
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from transformers import AutoTokenizer

from models import coadapt, learning_curve, recipe, sizing
from models.muon import Muon, orthogonalise
from specdec.defaults import DEFAULT_DRAFT, DEFAULT_TARGET, MODELS_DIR
from specdec.offline import speculate
from specdec.runtime import CausalLM, ModelSpec
from specdec.launcher import free_port
from tests.test_cli import SPECDEC, Lines

PROMPTS = json.loads((MODELS_DIR / recipe.PROMPTS_FILE).read_text())
REPORT = json.loads((MODELS_DIR / "report.json").read_text())


def test_recipe_runs_end_to_end_at_toy_scale_and_repeats(tmp_path):
    first = recipe.run(recipe.TOY, tmp_path / "a", "toy")
    for name in ("target", "draft"):
        model = CausalLM.load(ModelSpec(str(tmp_path / "a" / name)))
        assert model.max_positions == recipe.TOY.context
        assert (tmp_path / "a" / name / "README.md").read_text().startswith(f"# specdec default {name}")
    prompts = json.loads((tmp_path / "a" / recipe.PROMPTS_FILE).read_text())
    assert prompts and all(p["file"].endswith(".py") and p["prompt"] for p in prompts)
    assert set(first["evaluation"]) >= {"heldout_loss", "acceptance_rate", "distinct_4gram_mean", "distinct_4gram_real_mean", "costs"}
    assert first["evaluation"]["greedy_divergences"] == []  # speculation stayed lossless
    costs = first["evaluation"]["costs"]  # measured by `python -m specdec.costs` in a process of its own
    assert costs["c_per_process"] == [costs["c"]] and costs["target_step_ms"] > 0 and costs["runtime"] == "batched"
    assert first["machine"].endswith(f"training in {str(recipe.training_dtype('auto')).removeprefix('torch.')}")
    assert first["training"]["unlikelihood"]["steps"] == recipe.TOY.unlikelihood_steps > 0
    assert "steps of sequence-level unlikelihood" in (tmp_path / "a" / "target" / "README.md").read_text()
    assert [r["round"] for r in first["training"]["coadaptation"]] == [1] == [len(recipe.TOY.coadaptation.target_steps)]
    assert "re-distilled in 1 co-adaptation round(s)" in (tmp_path / "a" / "draft" / "README.md").read_text()
    assert "is_local" not in json.loads((tmp_path / "a" / "draft" / "tokenizer_config.json").read_text())  # saved by a round
    second = recipe.run(recipe.TOY, tmp_path / "b", "toy")  # same seed: same pair, same figures
    assert (tmp_path / "a" / "target" / "model.safetensors").read_bytes() == (tmp_path / "b" / "target" / "model.safetensors").read_bytes()
    assert second["evaluation"]["acceptance_rate"] == first["evaluation"]["acceptance_rate"]


def test_the_unlikelihood_stage_changes_the_target_and_a_changed_recipe_says_so(tmp_path):
    """The stage between pretraining and distillation is what makes the toy target differ
    from one pretrained alone; a pair made with flags beyond its preset names them on its cards."""
    tuned = recipe.train_pair(recipe.TOY, tmp_path / "tuned", "toy")
    plain = recipe.train_pair(dataclasses.replace(recipe.TOY, unlikelihood_steps=0), tmp_path / "plain", "toy")
    assert "unlikelihood" in tuned["training"] and "unlikelihood" not in plain["training"]
    weights = [(tmp_path / name / "target" / "model.safetensors").read_bytes() for name in ("tuned", "plain")]
    assert weights[0] != weights[1]
    report = {**plain, "evaluation": json.loads(json.dumps(REPORT["evaluation"]))}  # a card needs figures
    assert "--preset toy` with unlikelihood_steps=0 (seed 0)" in recipe.model_card("target", recipe.TOY.target, report)
    assert "--preset toy` (seed 0)" in recipe.model_card("target", recipe.TOY.target, {**report, "recipe": tuned["recipe"]})


def test_coadaptation_rounds_run_one_command_at_a_time_make_the_pair_they_make_at_once(tmp_path):
    """`--coadapt-only` continues a trained pair round by round; each round draws from its own
    seed, so the pair is the one the whole recipe makes with the same rounds, to the byte."""
    rounds = dataclasses.replace(recipe.TOY.coadaptation, target_steps=(2, 1))
    at_once = recipe.train_pair(dataclasses.replace(recipe.TOY, coadaptation=rounds), tmp_path / "once", "toy")
    plain = dataclasses.replace(recipe.TOY, coadaptation=dataclasses.replace(rounds, target_steps=()))
    recipe.train_pair(plain, tmp_path / "steps", "toy")
    weights = lambda pair: [(tmp_path / pair / name / "model.safetensors").read_bytes() for name in ("target", "draft")]  # noqa: E731
    before = weights("steps")
    coadapt.coadapt_pair(tmp_path / "steps", (2,))
    assert all(a != b for a, b in zip(weights("steps"), before))  # the round moved both models
    with pytest.raises(ValueError, match="must start with them"):
        coadapt.coadapt_pair(tmp_path / "steps", (3, 1))
    report = coadapt.coadapt_pair(tmp_path / "steps", (2, 1))
    assert weights("steps") == weights("once")
    assert report["recipe"] == at_once["recipe"] and report["training"]["coadaptation"][1]["round"] == 2
    with pytest.raises(ValueError, match="names no further one"):
        coadapt.coadapt_pair(tmp_path / "steps", (2, 1))
    report = recipe.evaluate_pair(tmp_path / "steps")
    assert report["evaluation"]["greedy_divergences"] == []
    card = (tmp_path / "steps" / "target" / "README.md").read_text()
    assert "coadaptation.target_steps=2,1" in card and "2 co-adaptation round(s)" in card and "(2+1 steps" in card


def test_the_top1_term_adds_the_cross_entropy_toward_the_teachers_likeliest_token():
    torch.manual_seed(0)
    teacher, student = torch.randn(2, 8, 50), torch.randn(2, 8, 50)
    kl = recipe.distillation_loss(teacher, student)
    p, q = teacher.softmax(-1), student.softmax(-1)
    assert kl.item() == pytest.approx((p * (p.log() - q.log())).sum(-1).mean().item(), rel=1e-5)
    ce = torch.nn.functional.cross_entropy(student.flatten(0, 1), teacher.argmax(-1).flatten())
    both = recipe.distillation_loss(teacher, student, top1=2.0)
    assert both.item() == pytest.approx(kl.item() + 2 * ce.item(), rel=1e-5) and ce.item() > 0.1


def test_distillation_reads_the_continuations_teacher_logits_from_those_computed_once():
    torch.manual_seed(0)
    tokenizer = AutoTokenizer.from_pretrained(DEFAULT_TARGET)
    teacher = recipe.new_gpt2(recipe.TOY.draft, tokenizer, 64).eval()
    generator = torch.Generator().manual_seed(0)
    ids = torch.randint(len(tokenizer), (500,), generator=generator)
    continuations = torch.randint(len(tokenizer), (10, 17), generator=generator)
    toy = dataclasses.replace(recipe.TOY, batch_tokens=4 * 17, long_every=3)
    known = recipe.continuation_logits(teacher, continuations, 3, torch.float32)
    assert known.shape == (10, 16, len(tokenizer))
    batch, picked = recipe.distillation_batch(ids, continuations, toy, 0, generator)
    assert len(picked) == recipe.continuations_per_batch(toy, 17) == 2 and batch.shape == (4, 17)
    assert torch.equal(batch[:2], continuations[picked])
    alone = recipe.teacher_logits(teacher, batch[:2, :-1], torch.float32)
    assert torch.allclose(known[picked], alone, atol=1e-5)
    batch, picked = recipe.distillation_batch(ids, continuations, toy, 2, generator)  # a full-context step
    assert len(picked) == 0 and batch.shape[1] == toy.context + 1


def test_the_draft_shape_flag_takes_layers_width_heads_and_steps_are_not_negative():
    assert recipe.shape_arg("2,192,4") == recipe.Shape(n_layer=2, n_embd=192, n_head=4)
    for bad in ("2,192", "2,190,4", "0,96,2", "two,96,2"):
        with pytest.raises(argparse.ArgumentTypeError):
            recipe.shape_arg(bad)
    result = subprocess.run(
        [sys.executable, "-m", "models.recipe", "--toy", "--unlikelihood-steps", "-1"], capture_output=True, text=True, timeout=60
    )  # fmt: skip
    assert result.returncode == 2 and "--unlikelihood-steps must be 0 or more" in result.stderr
    assert recipe.steps_arg("240,120") == (240, 120) and recipe.steps_arg("") == ()
    with pytest.raises(argparse.ArgumentTypeError):
        recipe.steps_arg("120,0")
    result = subprocess.run([sys.executable, "-m", "models.recipe", "--coadapt-only"], capture_output=True, text=True, timeout=60)
    assert result.returncode == 2 and "--coadapt-only needs --coadapt" in result.stderr


def test_a_pair_trained_elsewhere_is_evaluated_here_on_the_same_corpus_only(tmp_path):
    """The GPU half (train_pair, --stdlib) and the CPU half (evaluate_pair) meet through
    report.json: the evaluation recomputes the corpus and refuses one that differs."""
    copy = tmp_path / "stdlib"
    for source in recipe.stdlib_sources(recipe.TOY.max_files):
        (copy / source.path).parent.mkdir(parents=True, exist_ok=True)
        (copy / source.path).write_text(source.text, encoding="utf-8")
    trained = recipe.train_pair(recipe.TOY, tmp_path / "pair", "toy", stdlib=copy)
    assert "evaluation" not in trained and trained["corpus"]["python"] == "the copy in stdlib"
    report = recipe.evaluate_pair(tmp_path / "pair")  # this interpreter's stdlib: the same files
    assert report["corpus"]["python"] == sys.version.split()[0] and report["evaluation"]["greedy_divergences"] == []
    assert (tmp_path / "pair" / "draft" / "README.md").read_text().startswith("# specdec default draft")
    first = copy / recipe.stdlib_sources(recipe.TOY.max_files)[0].path
    first.write_text(first.read_text() + "\n# changed\n")
    with pytest.raises(ValueError, match="not the corpus the pair was trained on"):
        recipe.evaluate_pair(tmp_path / "pair", stdlib=copy)


def test_the_committed_pair_is_what_its_preset_makes():
    """report.json records the recipe that ran; it is the committed preset of that name,
    whose co-adaptation rounds ran on a CPU."""
    assert REPORT["preset"] == "h200" and REPORT["machine"].startswith("NVIDIA H200")
    assert REPORT["coadaptation_machine"].startswith("2 CPU threads") and len(REPORT["training"]["coadaptation"]) == 3
    preset = recipe.PRESETS[REPORT["preset"]]
    assert recipe.recipe_from_report(REPORT["recipe"]) == preset
    assert recipe.Recipe().device == "cpu" and recipe.training_dtype("auto", "cuda") == torch.bfloat16


def test_training_runs_in_bfloat16_only_on_a_cpu_with_bfloat16_instructions():
    flags = next(line for line in Path("/proc/cpuinfo").read_text().splitlines() if line.startswith("flags")).split()
    assert recipe.native_bf16() == bool({"avx512_bf16", "amx_tile"} & set(flags))
    assert recipe.training_dtype("auto") == (torch.bfloat16 if recipe.native_bf16() else torch.float32)
    assert recipe.training_dtype("float32") == torch.float32
    with pytest.raises(ValueError, match="precision must be one of"):
        recipe.training_dtype("float16")


def test_the_real_continuation_is_what_the_held_out_file_says_after_the_prompt():
    tokenizer = AutoTokenizer.from_pretrained(DEFAULT_TARGET)
    files = {s.path: s for s in recipe.stdlib_sources(0)}
    for item in PROMPTS:
        source = files[item["file"]]
        real = recipe.real_continuation(tokenizer, source, item["prompt"], 256)
        assert 0 < len(real) <= 256  # a short file ends sooner
        assert source.text.startswith(item["prompt"] + tokenizer.decode(real))
    with pytest.raises(ValueError, match="not the start of"):
        recipe.real_continuation(tokenizer, source, "# not this file's first line\n", 8)


def test_heldout_split_is_by_file():
    train = {s.path for s in recipe.stdlib_sources(0) if not recipe.is_heldout(s.path, recipe.Recipe.heldout_every)}
    assert train and not train & {p["file"] for p in PROMPTS}
    test_dirs = {"test", "tests", "idle_test"}  # the stdlib's test suites; `unittest` itself is library code
    assert not any(part in test_dirs or part.startswith("test_") for path in train for part in Path(path).parts)


@pytest.fixture(scope="module")
def pair() -> tuple[CausalLM, CausalLM]:
    return CausalLM.load(ModelSpec(DEFAULT_TARGET)), CausalLM.load(ModelSpec(DEFAULT_DRAFT))


def test_committed_pair_loads_like_any_checkpoint_and_shares_the_tokenizer(pair):
    target, draft = pair
    assert target.max_positions >= 2048 and draft.max_positions >= 2048
    assert target.vocab_size == draft.vocab_size
    assert draft.parameters * 5 < target.parameters
    a, b = AutoTokenizer.from_pretrained(DEFAULT_TARGET), AutoTokenizer.from_pretrained(DEFAULT_DRAFT)
    assert a.backend_tokenizer.to_str() == b.backend_tokenizer.to_str()  # vocabulary, merges, special tokens
    assert a.eos_token_id == b.eos_token_id == target.model.generation_config.eos_token_id


def test_committed_pair_fits_in_30_mb():
    files = [p for d in (DEFAULT_TARGET, DEFAULT_DRAFT) for p in Path(d).iterdir()]
    assert sum(p.stat().st_size for p in files) <= 30 * 2**20


SAMPLED = PROMPTS[::6]  # the prompts re-measured live; greedy figures are deterministic per prompt


def test_committed_figures_are_what_is_measured_here(pair):
    """The report's per-prompt acceptance and distinct-4-gram figures reproduce live on a
    sample of the prompts (so its means can be trusted without re-running all of them);
    the losses are far below the unigram baseline's."""
    target, draft = pair
    tokenizer = AutoTokenizer.from_pretrained(DEFAULT_TARGET)
    reported = {item["file"]: item for item in REPORT["evaluation"]["per_prompt"]}
    assert len(reported) == len(PROMPTS)
    for item in SAMPLED:
        ids = tokenizer.encode(item["prompt"])
        spec = speculate(target, draft, ids, 128, k=4)
        alone = speculate(target, None, ids, 256, k=0)
        assert spec.accepted / spec.proposed == pytest.approx(reported[item["file"]]["acceptance"], abs=0.02)
        distinct = recipe.distinct_4gram_share(alone.tokens)
        assert distinct == pytest.approx(reported[item["file"]]["distinct_4gram"], abs=0.02)
    losses = REPORT["evaluation"]["heldout_loss"]
    assert losses["target"] <= losses["unigram"] - 2.0  # perplexity at least e^2 (7.4x) below the unigram's
    assert losses["target"] < losses["draft"]
    assert REPORT["evaluation"]["distinct_4gram_real_mean"] > 0.8  # real code rarely repeats a 4-gram within 256 tokens


def test_recipe_time_goal():
    """The issue's 75 minutes: training on the H200 took 4.1, the three co-adaptation rounds
    65.9 on 2 CPU threads (no GPU was lent for them) and the evaluation here 0.8. The rounds
    took 96 min before distillation kept the target's logits on its continuations and
    compiled its loss; they made the same pair to the byte."""
    assert REPORT["total_minutes"] <= 75


def test_costs_are_measured_on_a_named_cpu():
    costs = REPORT["evaluation"]["costs"]
    assert "AVX" in costs["machine"] and "family" in costs["machine"] and costs["threads"] == 2 and costs["context"] >= 512
    assert len(costs["c_per_process"]) >= 5 and min(costs["c_per_process"]) <= costs["c"] <= max(costs["c_per_process"])
    assert costs["runtime"] == "static-gpt2"  # the committed report predates the batched runtime


@pytest.mark.xfail(strict=True, reason="issue 4 open: c = 0.121 on the report's CPU (family 26); 0.1003 and 0.097 on the previous one (family 25)")
def test_cost_sizing_goal():
    """c <= 0.1 and v(8) <= 1.5 where the report was evaluated, a CPU it names with its family
    and vector instructions: medians over the evaluation's processes, one measurement each,
    since c varies from process to process (0.116-0.137 in the report's five; on a family-25
    CPU of the same name 0.099-0.108 and, in the evaluation before, 0.072-0.102).
    On family 25, the runtime's single-position step path took the median from 0.108 to
    0.093 (twelve processes each). Measured inside the evaluating process, as before, c was 0.121 with the
    previous runtime and 0.102 and 0.101 with this one."""
    costs = REPORT["evaluation"]["costs"]
    assert costs["c"] <= sizing.MAX_C and costs["v8"] <= sizing.MAX_V8


def test_the_target_shape_flag_sets_the_shape_the_recipe_trains(tmp_path):
    assert recipe.main(["--toy", "--target-shape", "1,24,2", "--train-only", "--out", str(tmp_path)]) == 0
    assert CausalLM.load(ModelSpec(str(tmp_path / "target"))).model.config.n_embd == 24 != recipe.TOY.target.n_embd
    assert json.loads((tmp_path / "report.json").read_text())["recipe"]["target"] == {"n_layer": 1, "n_embd": 24, "n_head": 2}


def test_sizing_measures_untrained_models_of_the_shapes_asked_for(tmp_path):
    """`python -m models.sizing` builds the shapes it is given, as the recipe would train
    them, and measures them the way the evaluation measures a trained pair."""
    shape = recipe.Shape(2, 48, 2)
    counts = sizing.untrained_pair(dataclasses.replace(recipe.TOY, target=shape), tmp_path)
    width, vocab, positions = 48, recipe.TOY.vocab_size, recipe.TOY.context
    # GPT-2 with tied embeddings: token and position embeddings, per block 12 C^2 + 13 C, final norm
    assert counts["target"] == (vocab + positions) * width + 2 * (12 * width**2 + 13 * width) + 2 * width
    assert CausalLM.load(ModelSpec(str(tmp_path / "draft"))).model.config.n_embd == recipe.TOY.draft.n_embd
    done = subprocess.run(
        [sys.executable, "-m", "models.sizing", "--preset", "toy", "--target-shape", "2,48,2", "--processes", "2"],
        capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr[-2000:]
    summary = done.stdout.strip().splitlines()[-1]
    assert summary.startswith(f"[sizing] target 2x48 ({counts['target']:,} parameters), draft 1x16")
    assert "c <= 0.1: " in summary and "v(8) <= 1.5: " in summary
    assert done.stdout.count("forward costs, process") == 2


def test_acceptance_goal():
    assert REPORT["evaluation"]["acceptance_rate"] >= 0.6


def test_target_is_not_a_repetition_machine():
    assert REPORT["evaluation"]["distinct_4gram_mean"] >= 0.5


def test_generate_through_the_default_pair(tmp_path):
    """`specdec serve` with no model flags serves the committed pair; a held-out prompt
    streams its continuation, and speculation changes nothing (greedy)."""
    port = free_port()
    serve = subprocess.Popen(
        [*SPECDEC, "serve", "--port", str(port), "--workdir", str(tmp_path)],
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
    )  # fmt: skip
    lines = Lines(serve)
    try:
        ready = lines.wait_for("specdec ready", timeout=180)
        assert f"target {DEFAULT_TARGET}" in ready and f"draft {DEFAULT_DRAFT}" in ready
        outputs = {}
        for mode in ("on", "off"):
            result = subprocess.run(
                [*SPECDEC, "generate", "-", "--gateway", f"127.0.0.1:{port}", "--json", "--max-new-tokens", "96",
                 "--speculation", mode],
                input=PROMPTS[0]["prompt"], capture_output=True, text=True, timeout=120,
            )  # fmt: skip
            assert result.returncode == 0, result.stderr
            outputs[mode] = json.loads(result.stdout.splitlines()[-1])
        assert outputs["on"]["token_ids"] == outputs["off"]["token_ids"]
        assert len(outputs["on"]["token_ids"]) == 96 and outputs["on"]["text"].strip()
        assert outputs["on"]["acceptance_rate"] > 0  # the draft is used, not bypassed
        assert outputs["on"]["usage"]["rounds"] < outputs["off"]["usage"]["rounds"]
        serve.send_signal(signal.SIGTERM)
        assert serve.wait(timeout=60) == 0
    finally:
        if serve.poll() is None:
            serve.kill()
            serve.wait()


def test_recipe_has_help():
    result = subprocess.run([sys.executable, "-m", "models.recipe", "--help"], capture_output=True, text=True, timeout=60)
    flags = ("--toy", "--preset", "--train-only", "--evaluate", "--unlikelihood-steps", "--target-shape", "--draft-shape", "--coadapt", "--coadapt-only")
    assert result.returncode == 0 and all(flag in result.stdout for flag in flags)


def test_orthogonalise_keeps_the_directions_and_flattens_the_singular_values():
    generator = torch.Generator().manual_seed(0)
    u, _ = torch.linalg.qr(torch.randn(64, 32, generator=generator))
    v, _ = torch.linalg.qr(torch.randn(32, 32, generator=generator))
    update = u @ torch.diag(torch.logspace(-1, 1, 32)) @ v.T  # singular values 0.1 .. 10
    rotated = u.T @ orthogonalise(update) @ v  # diagonal if the singular vectors are kept
    assert torch.allclose(rotated, torch.diag(torch.diagonal(rotated)), atol=1e-4)
    assert torch.diagonal(rotated).min() > 0.5 and torch.diagonal(rotated).max() < 1.5


def test_a_first_muon_step_is_the_orthogonalised_gradient_scaled_by_the_shape():
    weight = torch.nn.Parameter(torch.randn(8, 4, generator=torch.Generator().manual_seed(1)))
    before = weight.detach().clone()
    (weight**3).sum().backward()
    gradient = weight.grad.clone()
    Muon([weight], lr=0.1).step()
    assert torch.allclose(weight.detach(), before - 0.1 * 2**0.5 * orthogonalise(gradient), atol=1e-6)


def test_muon_trains_the_block_matrices_and_adamw_the_rest():
    model = recipe.new_gpt2(recipe.TOY.target, AutoTokenizer.from_pretrained(DEFAULT_TARGET), 64)
    adamw, muon = recipe.optimizers(model, 1e-3, "muon", 0.02)
    in_muon = {id(p) for group in muon.param_groups for p in group["params"]}
    in_adamw = {id(p) for group in adamw.param_groups for p in group["params"]}
    blocks = {id(p) for name, p in model.named_parameters() if name.startswith("transformer.h.") and p.dim() == 2}
    assert in_muon == blocks and not in_muon & in_adamw
    assert in_muon | in_adamw == {id(p) for p in model.parameters()}
    assert muon.param_groups[0]["scale"] == 20 and [g["scale"] for g in adamw.param_groups] == [1.0, 1.0]
    assert len(recipe.optimizers(model, 1e-3)) == 1


def test_learning_curve_reports_loss_and_repetition_as_it_trains(tmp_path):
    curve = learning_curve.Curve(
        shape=recipe.TOY.target, optimizer="muon", steps=4, evals=2, new_tokens=8, eval_tokens=512, max_files=6,
        compile=False,  # compiling a toy model costs more than its four steps
    )  # fmt: skip
    points = learning_curve.run(curve, Path(DEFAULT_TARGET), tmp_path / "target")
    assert [p["step"] for p in points] == [2, 4] and 0 < points[0]["tokens"] < points[1]["tokens"]
    assert all(0 < p["heldout_loss"] < 10 and 0 <= p["distinct_mean"] <= p["distinct_max"] <= 1 for p in points)
    assert CausalLM.load(ModelSpec(str(tmp_path / "target"))).parameters > 0
