"""The metric instruments of the three services, named once here.

Every service counts the speculation it sees (draft tokens proposed and accepted, tokens
generated) under the same names, so one dashboard query works on any of them; the
acceptance-rate gauge is accepted / proposed since the service started. Prometheus names
follow from these (`specdec.draft.tokens.accepted` -> specdec_draft_tokens_accepted_total).
"""

from __future__ import annotations

import resource
import threading
from collections.abc import Callable, Iterable

import torch
from opentelemetry.metrics import CallbackOptions, Histogram, Meter, Observation

ROUND_SECONDS = (0.0005, 0.001, 0.002, 0.005, 0.01, 0.02, 0.05, 0.1, 0.2, 0.5, 1.0, 2.0)
TOKENS_PER_ROUND = tuple(float(n) for n in range(17))
TOKENS_PER_SECOND = (1, 2, 5, 10, 20, 50, 100, 200, 500, 1000, 2000, 5000)


class SpeculationMetrics:
    """Speculation counters, the acceptance-rate gauge and the per-round/request histograms."""

    def __init__(self, meter: Meter) -> None:
        self._lock = threading.Lock()
        self._proposed = 0
        self._accepted = 0
        self.proposed = meter.create_counter(
            "specdec.draft.tokens.proposed", unit="{token}", description="draft tokens proposed for verification"
        )
        self.accepted = meter.create_counter(
            "specdec.draft.tokens.accepted", unit="{token}", description="draft tokens the target accepted"
        )
        self.generated = meter.create_counter(
            "specdec.tokens.generated", unit="{token}", description="completion tokens emitted (accepted + closing)"
        )
        meter.create_observable_gauge(
            "specdec.acceptance.rate",
            callbacks=[self._acceptance],
            unit="1",
            description="accepted / proposed draft tokens since the service started",
        )
        self.accepted_per_round = meter.create_histogram(
            "specdec.round.accepted_tokens",
            unit="{token}",
            description="draft tokens accepted per speculation round",
            explicit_bucket_boundaries_advisory=TOKENS_PER_ROUND,
        )
        self.round_duration = meter.create_histogram(
            "specdec.round.duration",
            unit="s",
            description="wall time of one speculation round (proposal, verification, bookkeeping)",
            explicit_bucket_boundaries_advisory=ROUND_SECONDS,
        )
        self.tokens_per_second = meter.create_histogram(
            "specdec.request.tokens_per_second",
            unit="{token}/s",
            description="completion tokens per second of a finished request, from its first round to its last",
            explicit_bucket_boundaries_advisory=TOKENS_PER_SECOND,
        )

    def speculated(self, proposed: int, accepted: int) -> None:
        with self._lock:
            self._proposed += proposed
            self._accepted += accepted
        if proposed:
            self.proposed.add(proposed)
        if accepted:
            self.accepted.add(accepted)

    def _acceptance(self, options: CallbackOptions) -> Iterable[Observation]:
        with self._lock:
            proposed, accepted = self._proposed, self._accepted
        if proposed:
            yield Observation(accepted / proposed)


class ModeMetrics:
    """The verify service's count of sessions by speculation mode, and of AUTO sessions
    that went target-only."""

    def __init__(self, meter: Meter) -> None:
        self.sessions = meter.create_counter(
            "specdec.sessions", unit="{session}", description="requests admitted, by speculation mode (mode: on, off, auto)"
        )
        self.auto_fallbacks = meter.create_counter(
            "specdec.auto.fallbacks",
            unit="{session}",
            description="AUTO requests that went target-only because no k was expected to gain",
        )
        self.rounds = meter.create_counter(
            "specdec.rounds",
            unit="{round}",
            description="rounds run, by the k chosen (k: 0 for target-only) and, in AUTO mode, how (choice)",
        )


def observe_sessions(meter: Meter, count: Callable[[], int], description: str) -> None:
    """An up-down gauge of the sessions (or streams) open now."""
    meter.create_observable_up_down_counter(
        "specdec.sessions.active",
        callbacks=[lambda options: [Observation(count())]],
        unit="{session}",
        description=description,
    )


def observe_peak_memory(meter: Meter, device: torch.device) -> None:
    """Peak memory of the process's model: the device allocator's peak on a GPU, else the
    process's peak resident set (what the model and its caches made it grow to)."""

    def peak(options: CallbackOptions) -> Iterable[Observation]:
        if device.type == "cuda":
            yield Observation(torch.cuda.max_memory_allocated(device), {"device": str(device)})
        else:
            yield Observation(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024, {"device": str(device)})

    meter.create_observable_gauge(
        "specdec.process.memory.peak", callbacks=[peak], unit="By", description="peak memory of the model's device"
    )


def proposal_duration(meter: Meter) -> Histogram:
    """The draft service's time per proposal (its share of a round)."""
    return meter.create_histogram(
        "specdec.draft.proposal.duration",
        unit="s",
        description="wall time of one proposal inside the draft service",
        explicit_bucket_boundaries_advisory=ROUND_SECONDS,
    )


# Sessions and positions per forward: powers of two up to the largest batches served.
BATCH_SESSIONS = [1, 2, 4, 8, 16, 32, 64, 128]
BATCH_POSITIONS = [1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 1024, 2048]


class ForwardMetrics:
    """How many sessions and positions shared each model forward: what batching achieved."""

    def __init__(self, meter: Meter) -> None:
        self.sessions = meter.create_histogram(
            "specdec.forward.sessions",
            unit="{session}",
            description="sessions whose positions shared one model forward",
            explicit_bucket_boundaries_advisory=BATCH_SESSIONS,
        )
        self.positions = meter.create_histogram(
            "specdec.forward.positions",
            unit="{position}",
            description="positions one model forward ran, over all of its sessions",
            explicit_bucket_boundaries_advisory=BATCH_POSITIONS,
        )

    def record(self, sessions: int, positions: int) -> None:
        self.sessions.record(sessions)
        self.positions.record(positions)
