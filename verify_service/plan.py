"""A Decode request, validated and with every default resolved."""

from __future__ import annotations

import secrets
import uuid
from dataclasses import dataclass

from specdec import requests
from specdec.defaults import NUM_DRAFT_TOKENS
from specdec.errors import InvalidArgument
from specdec.sampling import SamplingParams
from specdec.v1 import common_pb2, verify_pb2

AUTO = common_pb2.SPECULATION_MODE_AUTO


@dataclass(frozen=True)
class Plan:
    """A validated request with every default resolved."""

    request_id: str
    prompt_ids: list[int]
    max_new_tokens: int
    params: SamplingParams
    seed: int  # the request's, or a fresh random one
    seeded: bool  # the request set its seed: sampled by coupling, repeatable in every mode
    mode: common_pb2.SpeculationMode  # ON, OFF or AUTO (the service's default resolved)
    num_draft_tokens: int  # k of every round in ON mode

    @property
    def capacity(self) -> int:
        """The longest the sequence can grow: prompt plus output."""
        return len(self.prompt_ids) + self.max_new_tokens

    def sampling_proto(self) -> common_pb2.SamplingParams:
        """The draft's sampling settings: the seed only for a seeded request (the draft
        then proposes with the same noise as the target; else it draws its own)."""
        p = self.params
        sampling = common_pb2.SamplingParams(temperature=p.temperature, top_k=p.top_k, top_p=p.top_p)
        if self.seeded:
            sampling.seed = self.seed
        return sampling


@dataclass(frozen=True)
class PlanLimits:
    vocab_size: int
    context: int  # the target's positions
    max_new_tokens: int  # largest max_new_tokens a request may ask for
    default_mode: common_pb2.SpeculationMode  # of a request that names none


def make_plan(request: verify_pb2.DecodeRequest, limits: PlanLimits) -> Plan:
    """Validates a request (InvalidArgument naming the field) and resolves defaults."""
    prompt = requests.check_prompt_ids(request.prompt_ids, limits.vocab_size, limits.context)
    max_new = requests.check_max_new_tokens(request.max_new_tokens, limits.max_new_tokens, len(prompt), limits.context)
    params = requests.sampling_params(request.sampling)
    k = requests.check_num_draft_tokens(request.num_draft_tokens or NUM_DRAFT_TOKENS)
    seeded = request.sampling.HasField("seed")
    mode = request.speculation
    if mode not in common_pb2.SpeculationMode.values():
        raise InvalidArgument(f"speculation: unknown mode {mode}")
    if mode == common_pb2.SPECULATION_MODE_UNSPECIFIED:
        mode = common_pb2.SPECULATION_MODE_ON if request.num_draft_tokens else limits.default_mode
    if mode == AUTO and request.num_draft_tokens:
        raise InvalidArgument("num_draft_tokens: AUTO mode chooses k every round; set speculation ON for a fixed k")
    return Plan(
        request_id=request.request_id or uuid.uuid4().hex,
        prompt_ids=prompt,
        max_new_tokens=max_new,
        params=params,
        seed=request.sampling.seed if seeded else secrets.randbits(63),
        seeded=seeded,
        mode=mode,
        num_draft_tokens=k,
    )
