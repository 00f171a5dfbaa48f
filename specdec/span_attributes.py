"""Span names and attributes of a request's trace, in one place.

A trace: `generate` (gateway) > `decode` (verify) > one `round` per speculation round,
each with `draft.propose` (in the draft service's process) and `target.verify` (the
target's forward over the round's positions). `decode` also has `target.prefill` and
`draft.prefill`. GenAI attributes follow the OpenTelemetry GenAI conventions; the rest
are `specdec.*`.
"""

from __future__ import annotations

from opentelemetry.util.types import Attributes

from specdec.v1 import common_pb2, pairing_pb2

GENERATE, DECODE, ROUND = "generate", "decode", "round"
DRAFT_PROPOSE, TARGET_VERIFY = "draft.propose", "target.verify"
DRAFT_PREFILL, TARGET_PREFILL = "draft.prefill", "target.prefill"


def _enum_suffix(name: str, prefix: str) -> str:
    return name.removeprefix(prefix).lower()


def finish_reason(reason: common_pb2.FinishReason) -> str:
    """"length", "stop" (a stop sequence) or "eos"."""
    return _enum_suffix(common_pb2.FinishReason.Name(reason), "FINISH_REASON_")


def request(model: str, max_new_tokens: int, temperature: float, top_k: int, top_p: float) -> Attributes:
    return {
        "gen_ai.operation.name": "text_completion",
        "gen_ai.request.model": model,
        "gen_ai.request.max_tokens": max_new_tokens,
        "gen_ai.request.temperature": temperature,
        "gen_ai.request.top_k": top_k,
        "gen_ai.request.top_p": top_p,
    }


def usage(u: common_pb2.Usage, finish: common_pb2.FinishReason) -> Attributes:
    return {
        "gen_ai.usage.input_tokens": u.prompt_tokens,
        "gen_ai.usage.output_tokens": u.completion_tokens,
        "gen_ai.response.finish_reasons": [finish_reason(finish)],
        "specdec.rounds": u.rounds,
        "specdec.draft_tokens.proposed": u.draft_tokens_proposed,
        "specdec.draft_tokens.accepted": u.draft_tokens_accepted,
        "specdec.acceptance_rate": u.acceptance_rate,
    }


def speculation(s: common_pb2.Speculation) -> Attributes:
    attributes: dict = {"specdec.speculating": s.speculating}
    if not s.speculating:
        attributes["specdec.target_only.reason"] = _enum_suffix(
            common_pb2.TargetOnlyReason.Name(s.reason), "TARGET_ONLY_REASON_"
        )
    if s.detail:
        attributes["specdec.speculation.detail"] = s.detail
    return attributes


def pairing(p: pairing_pb2.Pairing) -> Attributes:
    """The pairing the request ran under: state, transport, GPU link, memory headroom,
    same-origin check and any override."""
    attributes: dict = {
        "specdec.pairing.state": _enum_suffix(pairing_pb2.PairingState.Name(p.state), "PAIRING_STATE_"),
        "specdec.pairing.transport": _enum_suffix(pairing_pb2.Transport.Name(p.transport), "TRANSPORT_"),
        "specdec.pairing.link": _enum_suffix(pairing_pb2.GpuLink.Name(p.link), "GPU_LINK_"),
        "specdec.pairing.same_host": p.same_host,
        "specdec.pairing.same_origin": p.tokenizer_match,
        "specdec.pairing.target_memory_share": p.target_memory_share,
        "specdec.pairing.memory_headroom": max(0.0, 1.0 - p.target_memory_share),
        "specdec.pairing.overrides": list(p.overrides),
    }
    if p.detail:
        attributes["specdec.pairing.detail"] = p.detail
    if p.draft.model.name:
        attributes["specdec.draft.model"] = p.draft.model.name
    return attributes


def round_stats(stats: common_pb2.RoundStats, emitted: int, running_acceptance: float) -> Attributes:
    """What one round did: k, accepted, which token closed it, where its time went."""
    bonus = stats.closing == common_pb2.CLOSING_TOKEN_BONUS
    return {
        "specdec.round.index": stats.index,
        "specdec.round.draft_tokens": stats.draft_tokens,
        "specdec.round.accepted_tokens": stats.accepted_tokens,
        "specdec.round.emitted_tokens": emitted,
        "specdec.round.bonus": bonus and stats.draft_tokens > 0,
        "specdec.round.correction": not bonus,
        "specdec.round.draft_time_us": stats.draft_time_us,
        "specdec.round.draft_compute_us": stats.draft_compute_us,
        "specdec.round.verify_time_us": stats.verify_time_us,
        "specdec.batch.sessions": stats.batch_sessions,
        "specdec.batch.positions": stats.batch_positions,
        "specdec.acceptance_rate.running": running_acceptance,
    }


def auto_choice_name(choice: common_pb2.AutoChoice) -> str:
    """An AutoChoice as spans and metrics name it: best_k, load, ..."""
    return _enum_suffix(common_pb2.AutoChoice.Name(choice), "AUTO_CHOICE_")


def auto_choice(stats: common_pb2.RoundStats, reason: str) -> Attributes:
    """How AUTO mode chose the round's k; `reason` (set when the choice changed) says why."""
    attributes: dict = {
        "specdec.auto.choice": auto_choice_name(stats.auto_choice),
        "specdec.auto.expected_gain": stats.expected_gain,
        "specdec.auto.alpha_hat": stats.alpha_estimate,
    }
    if stats.predicted_tokens_per_s:
        attributes["specdec.auto.predicted_tokens_per_s"] = stats.predicted_tokens_per_s
    if reason:
        attributes["specdec.auto.reason"] = reason
    return attributes
