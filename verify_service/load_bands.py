"""A request's rounds by the load they ran under (the sessions of their step), for
RecentRequests.load_bands and the doctor's load check: how often AUTO held a session at
k = 0 for the batch's sake, and the acceptance in each band (a draft that misses only
under load would show here, not in one overall figure)."""

from __future__ import annotations

from dataclasses import dataclass, field

from specdec.v1 import common_pb2, verify_pb2

# (fewest, most) sessions per step of each band; most 0: no upper bound.
BANDS: tuple[tuple[int, int], ...] = ((1, 1), (2, 4), (5, 16), (17, 0))


def band_of(sessions: int) -> int:
    return next(i for i, (low, high) in enumerate(BANDS) if sessions >= low and (not high or sessions <= high))


@dataclass
class LoadTally:
    """Per band: AUTO rounds, of them held by load, draft tokens proposed and accepted,
    rounds ending in a rejection."""

    counts: list[list[int]] = field(default_factory=lambda: [[0] * 5 for _ in BANDS])

    def add(self, stats: common_pb2.RoundStats, auto: bool) -> None:
        row = self.counts[band_of(max(1, stats.batch_sessions))]
        row[0] += auto
        row[1] += stats.auto_choice == common_pb2.AUTO_CHOICE_LOAD
        row[2] += stats.draft_tokens
        row[3] += stats.accepted_tokens
        row[4] += stats.draft_tokens > stats.accepted_tokens


def band_protos(tallies: list[LoadTally]) -> list[verify_pb2.LoadBand]:
    """The bands summed over `tallies`."""
    bands = []
    for i, (low, high) in enumerate(BANDS):
        auto, held, proposed, accepted, rejections = (sum(t.counts[i][j] for t in tallies) for j in range(5))
        bands.append(
            verify_pb2.LoadBand(
                min_sessions=low,
                max_sessions=high,
                auto_rounds=auto,
                held_by_load=held,
                draft_tokens_proposed=proposed,
                draft_tokens_accepted=accepted,
                rejections=rejections,
                alpha_hat=accepted / (accepted + rejections) if accepted + rejections else 0.0,
            )
        )
    return bands
