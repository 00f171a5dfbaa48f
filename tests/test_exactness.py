"""Speculative sampling is exact: the joint distribution of the first two emitted tokens
equals the target's own (warped) distribution, for drafts near and far from the target
and for a draft whose top-K support leaves out tokens the target can emit.

Vocabulary 16, so the target's exact joint distribution over 16x16 pairs is computed by
enumeration. The speculative samples come from the functions the services run at each
position (`propose_token` in the draft, `verify_round` in the verifier) on the real models'
logits; forwards are memoised per token sequence so that 8,000 samples take seconds.
A negative control (resampling from p instead of norm(max(0, p - q)) after a rejection)
must fail the same test.

Seeded requests are sampled by coupling instead: their distribution is over seeds, each
seed's output a deterministic function of it. The same test over N seeds checks that it
is the target's, with a negative control of its own: noise drawn from the seed alone
instead of (seed, position).
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from scipy.stats import chisquare
from transformers import GPT2Config, GPT2LMHeadModel

from draft_service.drafter import Close, Drafter, Open, Propose, ProposeBatch
from specdec import sampling
from specdec.runtime import CausalLM, ModelSpec
from specdec.sampling import SamplingParams, gumbel_noise, propose_token, verify_round, warp
from specdec.toy_models import perturbed_copy
from verify_service.verifier import DraftProposal, Prefill, Release, Verifier, Verify

VOCAB = 16
PROMPT = (3, 9, 1)
N = 8_000  # the negative control's p is below 1e-300 at 6,000; more only slows the suite
K_DRAFT = 2  # draft tokens per round
P_MIN = 0.001
BATCH = 200  # sessions sharing each forward when the samples are drawn through batched steps


def save_tiny(path: Path, seed: int) -> Path:
    torch.manual_seed(seed)
    config = GPT2Config(
        vocab_size=VOCAB, n_positions=32, n_embd=16, n_layer=1, n_head=2, initializer_range=0.3,
        bos_token_id=None, eos_token_id=None,
    )
    GPT2LMHeadModel(config).save_pretrained(path)
    return path


class Memo:
    """Logits of a model at every position of a token sequence, computed once."""

    def __init__(self, model: CausalLM) -> None:
        self.model = model
        self.seen: dict[tuple[int, ...], torch.Tensor] = {}

    def __call__(self, ids: tuple[int, ...]) -> torch.Tensor:
        if ids not in self.seen:
            self.seen[ids] = self.model.forward(self.model.new_cache(), ids)
        return self.seen[ids]


@pytest.fixture(scope="module")
def models(tmp_path_factory) -> dict[str, Memo]:
    root = tmp_path_factory.mktemp("vocab16")
    target = save_tiny(root / "target", seed=0)
    close = perturbed_copy(target, root / "close", noise=0.3, seed=1)
    far = save_tiny(root / "far", seed=2)
    return {name: Memo(CausalLM.load(ModelSpec(str(path)))) for name, path in [("target", target), ("close", close), ("far", far)]}


def exact_joint(target: Memo, params: SamplingParams) -> torch.Tensor:
    """P(first token = a, second token = b) under the target alone, [V, V]."""
    first = warp(target(PROMPT)[-1], params).double()
    second = torch.stack([warp(target((*PROMPT, a))[-1], params).double() for a in range(VOCAB)])
    return first[:, None] * second


def speculative_joint_counts(target: Memo, draft: Memo, params: SamplingParams, support: int, seed: int) -> torch.Tensor:
    """Counts of (first, second) emitted token over N speculative runs, [V, V]."""
    draft_gen = torch.Generator().manual_seed(seed)
    verify_gen = torch.Generator().manual_seed(seed + 1)
    counts = torch.zeros(VOCAB, VOCAB, dtype=torch.long)
    for _ in range(N):
        emitted: list[int] = []
        while len(emitted) < 2:  # rounds, as verify_service.decoder runs them
            prefix = (*PROMPT, *emitted)
            choices = []
            for _ in range(K_DRAFT):
                proposed = tuple(c.id for c in choices)
                choices.append(propose_token(draft((*prefix, *proposed))[-1], params, support, draft_gen))
            ids = [c.id for c in choices]
            logits = target((*prefix, *ids))[-(K_DRAFT + 1) :]
            outcome = verify_round(
                logits, params, ids, [c.support_ids for c in choices], [c.support_probs for c in choices], verify_gen
            )
            emitted += ids[: outcome.accepted] + [outcome.token]
        counts[emitted[0], emitted[1]] += 1
    return counts


def chi_square_p(counts: torch.Tensor, joint: torch.Tensor) -> float:
    expected = joint.flatten() * N
    observed = counts.flatten().double()
    assert observed[expected == 0].sum() == 0, "a token pair the target cannot emit was emitted"
    big = expected >= 5  # pool sparse cells so the chi-square approximation holds
    obs = torch.cat([observed[big], observed[~big].sum().reshape(1)])
    exp = torch.cat([expected[big], expected[~big].sum().reshape(1)])
    if exp[-1] == 0:
        obs, exp = obs[:-1], exp[:-1]
    return float(chisquare(obs.numpy(), exp.numpy() * obs.sum().item() / exp.sum().item()).pvalue)


CASES = {
    # draft, sampling params, draft support size K
    "close-draft": ("close", SamplingParams(temperature=0.8, top_k=10, top_p=0.9), 32),
    "far-draft": ("far", SamplingParams(temperature=0.8, top_k=10, top_p=0.9), 32),
    "support-leaves-out-tokens": ("close", SamplingParams(temperature=1.2, top_k=12, top_p=0.95), 3),
}


@pytest.mark.parametrize("case", list(CASES))
def test_first_two_tokens_follow_the_target(models, case):
    draft, params, support = CASES[case]
    joint = exact_joint(models["target"], params)
    if case == "support-leaves-out-tokens":
        first_support = warp(models["target"](PROMPT)[-1], params) > 0
        assert int(first_support.sum()) > support  # the target can emit tokens the draft never sends
    counts = speculative_joint_counts(models["target"], models[draft], params, support, seed=len(case))
    assert chi_square_p(counts, joint) >= P_MIN


def test_negative_control_resampling_from_p_fails(models, monkeypatch):
    """The classic bug: after a rejection, sampling from p instead of the residual."""
    monkeypatch.setattr(sampling, "residual", lambda p, q: p)
    draft, params, support = CASES["far-draft"]
    joint = exact_joint(models["target"], params)
    counts = speculative_joint_counts(models["target"], models[draft], params, support, seed=3)
    assert chi_square_p(counts, joint) < P_MIN


def coupled_joint_counts(target: Memo, draft: Memo, params: SamplingParams, first_seed: int) -> torch.Tensor:
    """Counts of (first, second) emitted token over N seeded requests decoded with
    coupled rounds, one seed each, [V, V]."""
    unused = torch.Generator()  # coupled rounds draw nothing but the seed's noise
    counts = torch.zeros(VOCAB, VOCAB, dtype=torch.long)
    for seed in range(first_seed, first_seed + N):
        noise = gumbel_noise(seed, 0, K_DRAFT + 2, VOCAB)  # every output position a request can reach here
        emitted: list[int] = []
        while len(emitted) < 2:
            prefix = (*PROMPT, *emitted)
            at = len(emitted)  # the output position of the round's first token
            ids: list[int] = []
            for j in range(K_DRAFT):
                ids.append(propose_token(draft((*prefix, *ids))[-1], params, 0, unused, noise[at + j]).id)
            logits = target((*prefix, *ids))[-(K_DRAFT + 1) :]
            outcome = verify_round(
                logits, params, ids, [[]] * K_DRAFT, [[]] * K_DRAFT, unused, noise[at : at + K_DRAFT + 1]
            )
            emitted += ids[: outcome.accepted] + [outcome.token]
        counts[emitted[0], emitted[1]] += 1
    return counts


@pytest.mark.parametrize("draft", ["close", "far"])
def test_coupled_first_two_tokens_follow_the_target_over_seeds(models, draft):
    params = SamplingParams(temperature=0.8, top_k=10, top_p=0.9)
    counts = coupled_joint_counts(models["target"], models[draft], params, first_seed=10_000 * len(draft))
    assert chi_square_p(counts, exact_joint(models["target"], params)) >= P_MIN


def test_negative_control_noise_of_the_seed_alone_fails(models, monkeypatch):
    """The bug coupling must not have: one noise vector for every position of a request."""
    monkeypatch.setattr(sampling, "noise_seed", lambda seed, position: seed)
    params = SamplingParams(temperature=0.8, top_k=10, top_p=0.9)
    counts = coupled_joint_counts(models["target"], models["close"], params, first_seed=0)
    assert chi_square_p(counts, exact_joint(models["target"], params)) < P_MIN


def batched_joint_counts(
    target: CausalLM, draft: CausalLM, params: SamplingParams, support: int, seed: int
) -> torch.Tensor:
    """Counts of (first, second) emitted token over N speculative runs drawn through the
    services' batched steps: BATCH sessions at a time share every draft and target forward
    (Drafter.propose_batch, Verifier.forward), each with generators of its own."""
    counts = torch.zeros(VOCAB, VOCAB, dtype=torch.long)
    verifier, drafter = Verifier(target), Drafter(draft, support, max_sessions=BATCH)
    for batch in range(N // BATCH):
        sids = [f"{batch}-{i}" for i in range(BATCH)]
        for i, sid in enumerate(sids):
            own = seed * 10**6 + batch * BATCH + i
            verifier.open(Prefill(sid, list(PROMPT), params, seed=2 * own, capacity=16))
            drafter.open(Open(sid, list(PROMPT), params, seed=2 * own + 1, capacity=16))
        verifier.forward([], {sid: len(PROMPT) - 1 for sid in sids})  # the prompts, in one forward
        emitted: dict[str, list[int]] = {sid: [] for sid in sids}
        kept: dict[str, tuple[int, list[int]]] = {sid: (0, []) for sid in sids}
        while active := [sid for sid in sids if len(emitted[sid]) < 2]:
            steps = [Propose(sid, *kept[sid], K_DRAFT) for sid in active]
            proposals = drafter.propose_batch(ProposeBatch(steps)).tokens
            rounds = [
                Verify(sid, DraftProposal([t.id for t in ts], [list(t.support_ids) for t in ts], [list(t.support_probs) for t in ts]))
                for sid, ts in zip(active, proposals)
            ]
            forwarded = verifier.forward(rounds, {})
            assert forwarded.sessions == len(active)
            for sid, verified in zip(active, forwarded.verified):
                emitted[sid] += verified.tokens
                kept[sid] = (verified.accepted, [verified.tokens[-1]])
        for sid in sids:
            counts[emitted[sid][0], emitted[sid][1]] += 1
            verifier.release(Release(sid))
            drafter.close(Close(sid))
    return counts


@pytest.mark.parametrize("case", ["far-draft", "support-leaves-out-tokens"])
def test_first_two_tokens_follow_the_target_through_batched_forwards(models, case):
    draft, params, support = CASES[case]
    joint = exact_joint(models["target"], params)
    # models of their own, whose KV pools hold a batch of sessions
    target, draft_model = (CausalLM(models[name].model.model, name, pool_tokens=BATCH * 16) for name in ("target", draft))
    counts = batched_joint_counts(target, draft_model, params, support, seed=len(case))
    assert chi_square_p(counts, joint) >= P_MIN
