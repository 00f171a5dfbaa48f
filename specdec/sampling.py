"""Sampling math: warping, the draft's truncated distribution, and exact verification.

Terms, for one round of one request:
  V  vocabulary size.
  k  draft tokens proposed this round.
  d  the draft token ids, shape [k].
  q  the distribution each draft token was drawn from: the draft's warped distribution
     truncated to its top-K support and renormalised, [k, V] and zero off the support;
     sent and used sparse, as each position's support ids and their probabilities.
  p  the target's warped distribution at the k+1 verified positions, shape [k+1, V];
     p[i] is the target's distribution for the token at draft position i, p[k] the bonus.

Speculative sampling (Leviathan et al. 2023; Chen et al. 2023) accepts d[i] with
probability min(1, p[i](d[i]) / q[i](d[i])), in order; at the first rejection it draws
the correction from norm(max(0, p[i] - q[i])); when all k are accepted it draws a bonus
token from p[k]. Every emitted token is then distributed exactly as p, for any q that the
verifier knows. Greedy decoding accepts while d[i] equals the target's argmax and emits
the target's argmax at the first mismatch (or at position k).

A seeded request is sampled by coupling instead (docs/design.md): output position i has a
Gumbel vector g_i drawn from (seed, i) alone; the target's token at i is the argmax of its
warped log-probabilities plus g_i (the Gumbel-max trick: an exact draw from p), the draft
proposes the argmax of its own plus the same g_i, and verification is the greedy rule on
those perturbed scores. The output is then a function of the seed and the request alone,
identical to target-only decoding whatever k, mode or batch did.
"""

from __future__ import annotations

import hashlib
import math
from collections.abc import Sequence
from dataclasses import dataclass

import torch

# Temperatures below this decode greedily (vLLM's convention). Dividing float32 logits by
# a temperature under about 2e-38 overflows to inf (and softmax to nan), and any
# temperature this small already puts all the mass on the argmax but for exact ties.
GREEDY_BELOW = 1e-5


@dataclass(frozen=True)
class SamplingParams:
    """How a request samples; identical on the target-only path and in verification."""

    temperature: float = 0.0  # below GREEDY_BELOW (0 included) means greedy
    top_k: int = 0  # 0 disables
    top_p: float = 1.0  # 1 disables

    @property
    def greedy(self) -> bool:
        return self.temperature < GREEDY_BELOW


@dataclass(frozen=True)
class RoundOutcome:
    """What verification decided: accepted draft tokens, then one closing token."""

    accepted: int  # draft tokens accepted, 0..k
    token: int  # the correction (accepted < k) or the bonus token (accepted == k)


def _warped_scores(logits: torch.Tensor, params: SamplingParams) -> torch.Tensor:
    """Scores [..., V] whose softmax is the warped distribution: logits over the
    temperature, -inf outside top-k, then -inf outside top-p. Not for greedy params."""
    scores = logits.float() / params.temperature
    vocab = scores.shape[-1]
    if 0 < params.top_k < vocab:
        kth = torch.topk(scores, params.top_k, dim=-1).values[..., -1:]
        scores = scores.masked_fill(scores < kth, float("-inf"))
    if params.top_p < 1.0:
        sorted_probs, order = torch.softmax(scores, dim=-1).sort(dim=-1, descending=True)
        # A token is dropped when the tokens more likely than it already reach top_p;
        # the most likely token is therefore always kept.
        mass_before = sorted_probs.cumsum(dim=-1) - sorted_probs
        drop_sorted = mass_before >= params.top_p
        drop = torch.zeros_like(drop_sorted).scatter(-1, order, drop_sorted)
        scores = scores.masked_fill(drop, float("-inf"))
    return scores


def warp(logits: torch.Tensor, params: SamplingParams) -> torch.Tensor:
    """Probabilities [..., V] from logits [..., V]: temperature, then top-k, then top-p."""
    return torch.softmax(_warped_scores(logits, params), dim=-1)


def log_warp(logits: torch.Tensor, params: SamplingParams) -> torch.Tensor:
    """log(warp(logits, params)) [..., V], computed as log-softmax (-inf outside the support)."""
    return torch.log_softmax(_warped_scores(logits, params), dim=-1)


def noise_seed(seed: int, position: int) -> int:
    """The seed of output position `position`'s Gumbel vector in a request seeded `seed`:
    a hash of the pair, so that every position's noise is its own independent stream."""
    digest = hashlib.sha256(f"specdec-gumbel:{seed}:{position}".encode()).digest()
    return int.from_bytes(digest[:8], "little")


def gumbel_noise(seed: int, first_position: int, count: int, vocab_size: int) -> torch.Tensor:
    """Gumbel(0, 1) vectors [count, V] (float64, on the CPU) of output positions
    first_position .. first_position + count - 1. Drawn on the CPU whatever the models'
    devices: a CUDA generator gives other numbers from the same seed, and the draft and
    the target must see the same noise."""
    noise = torch.empty(count, vocab_size, dtype=torch.float64)
    for row, position in enumerate(range(first_position, first_position + count)):
        torch.rand(vocab_size, generator=torch.Generator().manual_seed(noise_seed(seed, position)), out=noise[row])
    # -log(-log(u)), in place; a uniform draw of 0 gives -inf: never the argmax.
    return noise.log_().neg_().log_().neg_()


def coupling_noise(
    coupled_seed: int | None, params: SamplingParams, first_position: int, count: int, vocab_size: int
) -> torch.Tensor | None:
    """A session's noise for `count` output positions from first_position: the seed's
    Gumbel vectors for a seeded sampled request, None when it decodes greedily or is
    unseeded (rejection sampling)."""
    if coupled_seed is None or params.greedy:
        return None
    return gumbel_noise(coupled_seed, first_position, count, vocab_size)


def coupled_choice(logits: torch.Tensor, params: SamplingParams, noise: torch.Tensor) -> torch.Tensor:
    """argmax of the warped log-probabilities plus the Gumbel noise, per row of logits
    [..., V] and noise [..., V]: an exact draw from warp(logits, params) when the noise is
    fresh, and the same token for any two models that agree, given the same noise."""
    return (log_warp(logits, params).double() + noise.to(logits.device)).argmax(dim=-1)


def truncate(probs: torch.Tensor, support_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The draft's sparse distribution: its top-K tokens of probs [V], renormalised.

    Returns (ids [K'], q [K']) most likely first, K' <= support_size, zero-probability
    tokens left out. The draft samples from exactly this q and sends it to the verifier.
    """
    top_probs, top_ids = torch.topk(probs, min(support_size, probs.shape[-1]))
    keep = top_probs > 0
    top_probs, top_ids = top_probs[keep], top_ids[keep]
    return top_ids, top_probs / top_probs.sum()


def sample(probs: torch.Tensor, generator: torch.Generator) -> int:
    """One draw from probs [V] (non-negative, any positive total): the first token whose
    cumulative mass exceeds a uniform draw over the total (inverse CDF, in float64). A
    zero-probability token adds nothing to the cumulative mass, so it is never drawn.
    torch.multinomial draws the same distribution about 7x slower over 4,096 tokens on a
    CPU (95 against 14 µs), and a sampled request pays one draw per round."""
    cumulative = probs.double().cumsum(-1)
    total = float(cumulative[-1])
    if not total > 0:
        raise ValueError(f"cannot sample from a distribution of total mass {total}")
    u = float(torch.rand((), generator=generator, dtype=torch.float64, device=probs.device)) * total
    # Kept below the total, which the product can round up to: the first token whose
    # cumulative mass reaches the total is then drawn, a token of positive probability.
    return int(torch.searchsorted(cumulative, min(u, math.nextafter(total, 0.0)), right=True))


def dense_row(ids: Sequence[int], probs: Sequence[float], vocab_size: int, device: torch.device | str) -> torch.Tensor:
    """q [V] of one draft position from its sparse (ids, probs)."""
    q = torch.zeros(vocab_size, dtype=torch.float32, device=device)
    q[torch.tensor(ids, dtype=torch.long, device=device)] = torch.tensor(probs, dtype=torch.float32, device=device)
    return q


def residual(p: torch.Tensor, q: torch.Tensor) -> torch.Tensor:
    """norm(max(0, p - q)) [V]: the correction distribution after a rejection."""
    diff = (p.double() - q.double()).clamp_min(0.0)
    total = diff.sum()
    # A rejection implies q(x) > p(x) for the rejected x, so the residual has positive
    # mass in exact arithmetic; only float rounding with p == q everywhere else can
    # empty it, and then p itself is the limit.
    if total <= 0:
        return p
    return (diff / total).to(p.dtype)


def verify_greedy(target_logits: torch.Tensor, draft_ids: Sequence[int]) -> RoundOutcome:
    """Greedy verification. target_logits [k+1, V], k draft_ids."""
    return verify_perturbed(target_logits.argmax(dim=-1), draft_ids)


def verify_perturbed(best: torch.Tensor, draft_ids: Sequence[int]) -> RoundOutcome:
    """The greedy rule given the target's choice at each of the k+1 positions, best [k+1]:
    accept while the draft token is the target's choice, then emit the target's choice."""
    choices = best.tolist()
    k = len(draft_ids)
    accepted = next((i for i in range(k) if choices[i] != draft_ids[i]), k)
    return RoundOutcome(accepted, choices[accepted])


def verify_sampled(
    p: torch.Tensor,
    draft_ids: Sequence[int],
    support_ids: Sequence[Sequence[int]],
    support_probs: Sequence[Sequence[float]],
    generator: torch.Generator,
) -> RoundOutcome:
    """Exact speculative sampling. p [k+1, V]; draft token i was drawn from the sparse q_i
    that puts support_probs[i][j] on token support_ids[i][j] and nothing elsewhere. Only the
    draft tokens' q and, after a rejection, that one position's q are needed, so q is never
    built whole."""
    k = len(draft_ids)
    drafted = torch.tensor(list(draft_ids), dtype=torch.long, device=p.device)
    p_draft = p[torch.arange(k, device=p.device), drafted].tolist()  # [k] target probability of each draft token
    q_draft = [dict(zip(ids, probs)).get(d, 0.0) for d, ids, probs in zip(draft_ids, support_ids, support_probs)]
    u = torch.rand(k, generator=generator, device=p.device).tolist()
    for i in range(k):
        # u < p/q, written without dividing: accept with probability min(1, p/q).
        if u[i] * q_draft[i] >= p_draft[i]:
            q = dense_row(support_ids[i], support_probs[i], p.shape[-1], p.device)
            return RoundOutcome(i, sample(residual(p[i], q), generator))
    return RoundOutcome(k, sample(p[k], generator))


@dataclass(frozen=True)
class DraftChoice:
    """A proposed token and, when sampling, the sparse q it was drawn from."""

    id: int
    support_ids: list[int]  # empty when greedy
    support_probs: list[float]


def propose_token(
    logits: torch.Tensor,
    params: SamplingParams,
    support_size: int,
    generator: torch.Generator,
    noise: torch.Tensor | None = None,
) -> DraftChoice:
    """The draft's choice at one position from its logits [V]: the argmax when greedy;
    with a seeded request's Gumbel noise [V] for this position, the coupled choice (no
    support is sent: verification needs none); else a draw from its warped distribution
    truncated to the top support_size tokens."""
    if params.greedy:
        return DraftChoice(int(logits.argmax()), [], [])
    if noise is not None:
        return DraftChoice(int(coupled_choice(logits, params, noise)), [], [])
    ids, q = truncate(warp(logits, params), support_size)
    return DraftChoice(int(ids[sample(q, generator)]), ids.tolist(), q.tolist())


def verify_round(
    logits: torch.Tensor,
    params: SamplingParams,
    draft_ids: Sequence[int],
    support_ids: Sequence[Sequence[int]],
    support_probs: Sequence[Sequence[float]],
    generator: torch.Generator,
    noise: torch.Tensor | None = None,
) -> RoundOutcome:
    """Verifies k draft tokens against the target's logits [k+1, V] at their positions;
    `noise` [k+1, V]: a seeded request's Gumbel vectors of those positions (coupled
    verification: the greedy rule on the perturbed warped log-probabilities)."""
    if params.greedy:
        return verify_greedy(logits, draft_ids)
    if noise is not None:
        return verify_perturbed(coupled_choice(logits, params, noise), draft_ids)
    return verify_sampled(warp(logits, params), draft_ids, support_ids, support_probs, generator)
