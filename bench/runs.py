"""One timed generation per call, for each kind of column the benchmark compares.

  ours_run  one request through our gateway (speculation on at k, off, or AUTO)
  peer_run  transformers' `generate` in this process: plain, or assisted by the draft
            (`assistant_model`) with its default schedule or a constant number of tokens

Every run returns a Run: the completion's ids and the wall time from sending the
request to the last token (prefill included, in both worlds).
"""

from __future__ import annotations

import copy
import time
from dataclasses import dataclass, field

import torch
from transformers import AutoModelForCausalLM, GenerationConfig, PreTrainedModel

from specdec.client import connect, generate
from specdec.v1 import common_pb2, generation_pb2

PEER_PLAIN = "generate"  # plain transformers generate, no assistant
PEER_DEFAULT = "assisted-default"  # assistant_model with transformers' default schedule
PEER_CONSTANT = "assisted-constant"  # assistant_model with num_assistant_tokens = our best k, constant


@dataclass(frozen=True)
class Job:
    prompt_index: int
    prompt_ids: list[int]
    length: int  # max_new_tokens
    temperature: float
    seed: int  # torch.manual_seed of the peer runs (ours go unseeded, see ours_run)


@dataclass
class Run:
    token_ids: list[int]
    seconds: float  # send to last token
    rounds: int = 0
    proposed: int = 0
    accepted: int = 0
    rejections: int = 0
    # Sums over the rounds after the first (the first one also pays for the prefills):
    steady_rounds: int = 0
    steady_s: float = 0.0  # client-side wall time from the first message to the last
    draft_compute_s: float = 0.0  # the draft model's own time for its proposals
    draft_wait_s: float = 0.0  # what the rounds waited for them (RPC included, the part hidden by asking early not)
    # The draft's compute on the rounds' critical path: per round, its compute or, when the
    # proposal was asked for early and arrived sooner, what the round waited.
    draft_path_s: float = 0.0
    target_s: float = 0.0  # target forwards plus acceptance
    draft_tokens: list[int] = field(default_factory=list)  # k of every round (ours; 0: target-only)
    round_tokens: list[int] = field(default_factory=list)  # tokens every round emitted (ours)

    @property
    def tokens_per_s(self) -> float:
        return len(self.token_ids) / self.seconds


def ours_run(gateway: str, job: Job, k: int, auto: bool = False) -> Run:
    """k = 0: speculation off, unless auto (AUTO mode, which chooses k itself). Sent
    unseeded: a seeded request is sampled by coupling, whose acceptance is lower
    (bench.coupling measures that path); this measures what a request gets by default."""
    req = generation_pb2.GenerateRequest(max_new_tokens=job.length, temperature=job.temperature)
    req.token_ids.ids.extend(job.prompt_ids)
    if auto:
        req.speculation.mode = common_pb2.SPECULATION_MODE_AUTO
    else:
        req.speculation.mode = common_pb2.SPECULATION_MODE_ON if k else common_pb2.SPECULATION_MODE_OFF
    if k:
        req.speculation.num_draft_tokens = k
    arrivals: list[float] = []
    channel, stub = connect(gateway)
    with channel:
        completion = generate(stub, req, timeout=600, on_message=lambda _m: arrivals.append(time.perf_counter()))
    run = Run(completion.token_ids, completion.elapsed_s)
    u = completion.usage
    run.rounds, run.proposed, run.accepted, run.rejections = u.rounds, u.draft_tokens_proposed, u.draft_tokens_accepted, u.rejections
    run.draft_tokens = [m.round.draft_tokens for m in completion.messages]
    run.round_tokens = [len(m.token_ids) for m in completion.messages]
    steady = completion.messages[1:]
    if steady:
        run.steady_rounds = len(steady)
        run.steady_s = arrivals[-1] - arrivals[0]
        run.draft_compute_s = sum(m.round.draft_compute_us for m in steady) / 1e6
        run.draft_wait_s = sum(m.round.draft_time_us for m in steady) / 1e6
        run.draft_path_s = sum(min(m.round.draft_time_us, m.round.draft_compute_us) for m in steady) / 1e6
        run.target_s = sum(m.round.verify_time_us for m in steady) / 1e6
    return run


@dataclass(frozen=True)
class Peer:
    """The pair loaded with transformers, as a user of assisted generation loads it."""

    target: PreTrainedModel
    draft: PreTrainedModel
    draft_config: GenerationConfig  # the draft's generation config as loaded
    eos_token_id: int | None

    @classmethod
    def load(cls, target_path: str, draft_path: str) -> Peer:
        target = AutoModelForCausalLM.from_pretrained(target_path).eval()
        draft = AutoModelForCausalLM.from_pretrained(draft_path).eval()
        return cls(target, draft, copy.deepcopy(draft.generation_config), target.generation_config.eos_token_id)


def peer_run(peer: Peer, job: Job, kind: str, k: int) -> Run:
    """transformers' own loop on the same pair, same prompt, same length."""
    ids = torch.tensor([job.prompt_ids])
    kwargs: dict = {
        "max_new_tokens": job.length,
        "attention_mask": torch.ones_like(ids),
        "pad_token_id": peer.eos_token_id,
        "do_sample": job.temperature > 0,
    }
    if job.temperature > 0:
        kwargs.update(temperature=job.temperature, top_k=0, top_p=1.0)
        torch.manual_seed(job.seed)
    if kind != PEER_PLAIN:
        # A fresh copy of the draft's generation config each run: transformers adapts
        # some of its fields in place across calls, which would couple the cells.
        config = copy.deepcopy(peer.draft_config)
        if kind == PEER_CONSTANT:
            config.num_assistant_tokens = k
            config.num_assistant_tokens_schedule = "constant"
            config.assistant_confidence_threshold = 0.0  # no early stop: exactly k per round
        peer.draft.generation_config = config
        kwargs["assistant_model"] = peer.draft
    start = time.perf_counter()
    with torch.inference_mode():
        out = peer.target.generate(ids, **kwargs)
    seconds = time.perf_counter() - start
    return Run(out[0, ids.shape[1] :].tolist(), seconds)
