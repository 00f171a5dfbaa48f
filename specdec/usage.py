"""Per-request totals and the two acceptance figures of docs/design.md.

acceptance rate = accepted / proposed; α̂ = accepted / (accepted + rejections), where a
rejection is a round that proposed draft tokens and ended with a correction.
"""

from __future__ import annotations

from dataclasses import dataclass

from specdec.v1 import common_pb2


@dataclass
class UsageTally:
    prompt_tokens: int
    completion_tokens: int = 0
    rounds: int = 0
    proposed: int = 0
    accepted: int = 0
    rejections: int = 0

    def add(self, round_stats: common_pb2.RoundStats, emitted: int) -> None:
        self.rounds += 1
        self.completion_tokens += emitted
        self.proposed += round_stats.draft_tokens
        self.accepted += round_stats.accepted_tokens
        if round_stats.accepted_tokens < round_stats.draft_tokens:
            self.rejections += 1

    @property
    def acceptance_rate(self) -> float:
        return self.accepted / self.proposed if self.proposed else 0.0

    def to_proto(self) -> common_pb2.Usage:
        return common_pb2.Usage(
            prompt_tokens=self.prompt_tokens,
            completion_tokens=self.completion_tokens,
            rounds=self.rounds,
            draft_tokens_proposed=self.proposed,
            draft_tokens_accepted=self.accepted,
            rejections=self.rejections,
            acceptance_rate=self.acceptance_rate,
            alpha_hat=self.accepted / (self.accepted + self.rejections) if self.accepted + self.rejections else 0.0,
        )
