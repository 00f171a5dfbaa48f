"""Speculative decoding in one process, with the services' own session classes
(draft_service.drafter.Drafter, verify_service.verifier.Verifier) and no RPC. For
measurements that must not depend on a network stack: the model recipe's acceptance
figures and tests of the round logic."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from draft_service.drafter import Close, Drafter, Open, Propose
from specdec.runtime import CausalLM
from specdec.sampling import SamplingParams
from verify_service.verifier import NO_DRAFT, DraftProposal, Prefill, Release, Verifier, Verify


@dataclass(frozen=True)
class OfflineResult:
    tokens: list[int]  # the completion (exactly max_new_tokens)
    rounds: int
    proposed: int
    accepted: int
    rejections: int  # rounds that ended in a rejection


def _run(component: Drafter | Verifier, step: object) -> object:
    [result] = component.execute([step])
    if isinstance(result, Exception):
        raise result
    return result


def speculate(
    target: CausalLM,
    draft: CausalLM | None,
    prompt_ids: Sequence[int],
    max_new_tokens: int,
    k: int,
    params: SamplingParams = SamplingParams(),
    seed: int = 0,
    support_size: int = 32,
    coupled: bool = False,
) -> OfflineResult:
    """Decodes max_new_tokens tokens; with draft=None (or k=0), target-only rounds.
    `coupled`: sample as a seeded request is served (coupled by the seed's Gumbel noise);
    else by rejection sampling, the draft drawing from a stream of its own."""
    verifier = Verifier(target)
    capacity = len(prompt_ids) + max_new_tokens
    _run(verifier, Prefill("offline", list(prompt_ids), params, seed, capacity, coupled))
    drafter = Drafter(draft, support_size) if draft is not None and k > 0 else None
    if drafter is not None:
        draft_seed = seed if coupled else seed + 1  # rejection sampling needs the draft's own stream
        _run(drafter, Open("offline", list(prompt_ids), params, draft_seed, capacity, coupled))
    tokens: list[int] = []
    rounds = proposed = accepted = rejections = 0
    last_accepted, appended = 0, []
    while len(tokens) < max_new_tokens:
        step_k = min(k, max_new_tokens - len(tokens) - 1) if drafter is not None else 0
        proposal = NO_DRAFT
        if step_k > 0:
            draft_tokens = _run(drafter, Propose("offline", last_accepted, appended, step_k))
            proposal = DraftProposal(
                ids=[t.id for t in draft_tokens],
                support_ids=[list(t.support_ids) for t in draft_tokens],
                support_probs=[list(t.support_probs) for t in draft_tokens],
            )
        verified = _run(verifier, Verify("offline", proposal))
        last_accepted, appended = verified.accepted, [verified.tokens[-1]]
        tokens += verified.tokens
        rounds += 1
        proposed += len(proposal.ids)
        accepted += verified.accepted
        rejections += verified.accepted < len(proposal.ids)
    _run(verifier, Release("offline"))
    if drafter is not None:
        _run(drafter, Close("offline"))
    return OfflineResult(tokens[:max_new_tokens], rounds, proposed, accepted, rejections)
