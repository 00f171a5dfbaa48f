"""Cache rollback: after rounds with rejections, cached decoding equals a full recompute,
in the verifier's target sessions and in the drafter's sessions (the runtime-level
rollback is in test_runtime.py)."""

from __future__ import annotations

import pytest
import torch

from draft_service.drafter import Drafter, Open, Propose
from specdec.runtime import CausalLM, ModelSpec
from specdec.sampling import SamplingParams
from verify_service.verifier import DraftProposal, Prefill, Verifier, Verify


@pytest.fixture(scope="module")
def target(toy) -> CausalLM:
    return CausalLM.load(ModelSpec(str(toy.target)))


@pytest.fixture(scope="module")
def far(toy) -> CausalLM:
    return CausalLM.load(ModelSpec(str(toy.far)))


def full_logits(model: CausalLM, ids: list[int]) -> torch.Tensor:
    return model.forward(model.new_cache(), ids)[-1]


def greedy_reference(model: CausalLM, prompt: list[int], n: int) -> list[int]:
    """Greedy decoding by full recompute at every step (no cache at all)."""
    ids = list(prompt)
    for _ in range(n):
        ids.append(int(full_logits(model, ids).argmax()))
    return ids[len(prompt) :]


def test_rounds_with_rejections_equal_full_recompute(target, far):
    """A far draft's proposals are mostly rejected; every round rolls both caches back."""
    params = SamplingParams()
    prompt = [5, 17, 42, 99, 3]
    verifier, drafter = Verifier(target), Drafter(far, support_size=8)
    verifier.execute([Prefill("s", prompt, params, seed=0, capacity=200)])
    drafter.execute([Open("s", prompt, params, seed=0, capacity=200)])
    accepted, appended, rejections = 0, [], 0
    while len(verifier.sessions["s"].tokens) < len(prompt) + 60:
        [tokens] = drafter.execute([Propose("s", accepted, appended, 4)])
        draft = DraftProposal([t.id for t in tokens], [[]] * 4, [[]] * 4)
        [verified] = verifier.execute([Verify("s", draft)])
        accepted, appended = verified.accepted, [verified.tokens[-1]]
        rejections += verified.accepted < 4

        session = verifier.sessions["s"]
        assert session.cache.length == len(session.tokens) - 1
        cached = target.forward(session.cache, session.tokens[-1:])[-1]
        session.cache.rollback(len(session.tokens) - 1)
        assert torch.allclose(cached, full_logits(target, session.tokens), atol=1e-5)

        dsession = drafter.sessions["s"]
        assert dsession.tokens[: dsession.committed] == session.tokens[: dsession.committed]
    assert rejections > 5
    generated = verifier.sessions["s"].tokens[len(prompt) :]
    assert generated == greedy_reference(target, prompt, len(generated))


def test_drafter_rollback_equals_recompute(far):
    drafter = Drafter(far, support_size=8)
    prompt = [1, 2, 3, 4]
    drafter.execute([Open("d", prompt, SamplingParams(), seed=0, capacity=0)])
    [first] = drafter.execute([Propose("d", 0, [], 5)])
    # the verifier kept 2 of the 5 and appended its own token 77
    [second] = drafter.execute([Propose("d", 2, [77], 3)])
    committed = prompt + [t.id for t in first[:2]] + [77]
    expected = greedy_reference(far, committed, 3)
    assert [t.id for t in second] == expected
    session = drafter.sessions["d"]
    assert session.tokens == committed + expected
    assert session.cache.length == len(session.tokens) - 1


def test_a_session_that_fails_inside_a_draft_batch_leaves_the_others_their_proposals(far, monkeypatch):
    """One session's sampling raises on its second draft token: it gets its exception, the
    other sessions of the batch still get all their tokens, the same as proposed alone."""
    from draft_service import drafter as drafter_module
    from draft_service.drafter import ProposeBatch

    params = SamplingParams()
    alone = Drafter(far, support_size=8)
    for sid in ("a", "c"):
        alone.open(Open(sid, [5, 6, 7], params, seed=1, capacity=64))
    expected = {sid: [t.id for t in alone.propose(Propose(sid, 0, [], 3))] for sid in ("a", "c")}

    drafter = Drafter(far, support_size=8)
    for sid in ("a", "b", "c"):
        drafter.open(Open(sid, [5, 6, 7], params, seed=1, capacity=64))
    choose = drafter_module.Drafter._choose

    def failing(self, session, logits):
        if session is drafter.sessions["b"] and len(session.tokens) > session.committed:
            raise RuntimeError("sampling failed")
        return choose(self, session, logits)

    monkeypatch.setattr(drafter_module.Drafter, "_choose", failing)
    results = drafter.propose_batch(ProposeBatch([Propose(sid, 0, [], 3) for sid in ("a", "b", "c")])).tokens
    assert isinstance(results[1], RuntimeError)
    assert {sid: [t.id for t in r] for sid, r in zip(("a", "c"), (results[0], results[2]))} == expected
