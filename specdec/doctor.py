"""`specdec doctor`: the deployment guide's five-point checklist, and a load check, against live services.

Each check has a verdict (pass, warn, fail) and the figure behind it:
1. output length: mean completion tokens of recent requests (pass above 256, else warn);
2. memory: the target's share of its device's memory (pass at 70% or less, else fail);
3. same origin: the draft's tokenizer equals the target's (pass or fail);
4. placement: same card or same host (pass; warn for PCIe only; fail across machines);
5. acceptance: α̂ = accepted / (accepted + rejections) over recent requests, which unlike
   the acceptance rate (accepted / proposed) does not fall as clients ask for more draft
   tokens per round (k). The guide's floor is an acceptance rate of 0.4, which assumes
   the usual k; it is judged as the α̂ whose expected acceptance rate at the default k
   (NUM_DRAFT_TOKENS, 4) is 0.4, about 0.67 (pass at or above, else fail). The figure
   keeps the acceptance rate at the k clients used.
6. load: the share of AUTO rounds the batch chooser held at k = 0 because of load, and α̂
   by load band (sessions per step). Warns when most rounds were held (speculation rarely
   pays at the load served) or when α̂ in a loaded band is LOAD_ALPHA_DROP below the
   lightest band's (the same draft should be kept as often in a batch as alone).
"""

from __future__ import annotations

from dataclasses import asdict, dataclass

import grpc

from specdec.defaults import NUM_DRAFT_TOKENS
from specdec.pairing import MEMORY_SHARE_LIMIT
from specdec.serving import channel_options
from specdec.speculation_gain import alpha_for_acceptance_rate
from specdec.v1 import generation_pb2, generation_pb2_grpc, pairing_pb2, verify_pb2, verify_pb2_grpc

LONG_OUTPUT_TOKENS = 256
ACCEPTANCE_FLOOR = 0.4  # the guide's, an acceptance rate at the usual k
ALPHA_FLOOR = alpha_for_acceptance_rate(ACCEPTANCE_FLOOR, NUM_DRAFT_TOKENS)  # the same floor, for any k
HELD_WARN = 0.5  # share of AUTO rounds held at k = 0 by load above which the load check warns
LOAD_ALPHA_DROP = 0.1
LOAD_MIN_PROPOSED = 200  # draft tokens a band needs before its α̂ is compared
PASS, WARN, FAIL = "pass", "warn", "fail"
LINK_NAMES = {
    pairing_pb2.GPU_LINK_NONE_CPU: "CPU, no GPU link",
    pairing_pb2.GPU_LINK_SAME_DEVICE: "same GPU",
    pairing_pb2.GPU_LINK_MIG_SLICE: "MIG slices of one GPU",
    pairing_pb2.GPU_LINK_NVLINK: "NVLink peers",
    pairing_pb2.GPU_LINK_PCIE: "PCIe only",
    pairing_pb2.GPU_LINK_UNKNOWN: "GPU link unknown",
}


@dataclass(frozen=True)
class Check:
    name: str
    verdict: str  # pass, warn or fail
    figure: str  # the measured figure behind the verdict
    detail: str  # what it means, in a sentence


def fetch_info(verify: str | None, gateway: str | None, recent: int, timeout_s: float) -> verify_pb2.VerifyInfo:
    """The verify service's Info, asked directly or through the gateway."""
    if verify:
        with grpc.insecure_channel(verify, options=channel_options()) as channel:
            stub = verify_pb2_grpc.VerifyStub(channel)
            return stub.GetInfo(verify_pb2.VerifyInfoRequest(recent_requests=recent), timeout=timeout_s)
    with grpc.insecure_channel(gateway, options=channel_options()) as channel:
        stub = generation_pb2_grpc.GenerationStub(channel)
        return stub.GetInfo(generation_pb2.GatewayInfoRequest(recent_requests=recent), timeout=timeout_s).verify


def checks(info: verify_pb2.VerifyInfo) -> list[Check]:
    recent, pairing = info.recent, info.pairing
    return [
        output_length(recent),
        memory(pairing),
        same_origin(pairing),
        placement(pairing),
        acceptance(recent),
        load(recent),
    ]


def output_length(recent: verify_pb2.RecentRequests) -> Check:
    if recent.requests == 0:
        return Check("output length", WARN, "no finished requests yet", "nothing to average; ask again after traffic")
    mean = recent.mean_completion_tokens
    figure = f"{mean:.0f} tokens on average over the last {recent.requests} requests"
    if mean > LONG_OUTPUT_TOKENS:
        return Check("output length", PASS, figure, f"above {LONG_OUTPUT_TOKENS}: long outputs, where speculation pays")
    return Check(
        "output length", WARN, figure,
        f"at most {LONG_OUTPUT_TOKENS}: short outputs gain little from speculation (about 1.05-1.2x at 32 tokens)",
    )  # fmt: skip


def memory(pairing: pairing_pb2.Pairing) -> Check:
    share, m = pairing.target_memory_share, pairing.target_memory
    figure = (
        f"{share:.1%} of {m.total_bytes / 2**30:.1f} GiB {m.kind} memory "
        f"(weights {m.weights_bytes / 2**20:.0f} MiB, in use {m.used_bytes / 2**20:.0f} MiB, "
        f"KV budget {m.kv_budget_bytes / 2**20:.0f} MiB)"
    )
    if share <= MEMORY_SHARE_LIMIT:
        return Check("target memory", PASS, figure, f"at most {MEMORY_SHARE_LIMIT:.0%}: room for the draft")
    return Check("target memory", FAIL, figure, f"above {MEMORY_SHARE_LIMIT:.0%}: a draft pushes the target into swapping")


def _no_draft(pairing: pairing_pb2.Pairing) -> str | None:
    if pairing.state == pairing_pb2.PAIRING_STATE_NOT_CONFIGURED:
        return "no draft service is configured"
    if pairing.state in (pairing_pb2.PAIRING_STATE_UNREACHABLE, pairing_pb2.PAIRING_STATE_UNSPECIFIED):
        return f"the draft service did not answer the handshake: {pairing.detail or 'not attempted'}"
    return None


def same_origin(pairing: pairing_pb2.Pairing) -> Check:
    missing = _no_draft(pairing)
    if missing or not pairing.draft.tokenizer.present and not pairing.tokenizer_difference:
        return Check("same-origin draft", FAIL, missing or "draft refused before stating its tokenizer", pairing.detail)
    if pairing.tokenizer_match:
        return Check("same-origin draft", PASS, "tokenizer fingerprints equal", "the draft shares the target's tokenizer")
    overridden = " (overridden by the operator)" if "same-origin" in pairing.overrides else ""
    return Check("same-origin draft", FAIL, pairing.tokenizer_difference + overridden, "acceptance collapses with a foreign draft")


def placement(pairing: pairing_pb2.Pairing) -> Check:
    missing = _no_draft(pairing)
    if missing:
        return Check("same card or host", FAIL, missing, "no paired draft to place")
    if not pairing.same_host:
        return Check("same card or host", FAIL, f"{pairing.verifier_host} vs {pairing.draft_host}", pairing.detail)
    link = LINK_NAMES.get(pairing.link, "not classified")
    figure = f"{link}; {pairing.link_detail}" if pairing.link_detail else link
    if pairing.link == pairing_pb2.GPU_LINK_PCIE:
        return Check("same card or host", WARN, figure, "same host, but every round crosses PCIe")
    if pairing.link == pairing_pb2.GPU_LINK_UNKNOWN:
        return Check("same card or host", WARN, figure, "same host; the GPU link could not be classified")
    return Check("same card or host", PASS, figure, "draft and target share the host")


def acceptance(recent: verify_pb2.RecentRequests) -> Check:
    if recent.draft_tokens_proposed == 0:
        return Check("acceptance rate", WARN, "no draft tokens proposed in the window", "nothing to measure yet")
    figure = (
        f"α̂ {recent.alpha_hat:.3f} (acceptance {recent.acceptance_rate:.3f} at the k clients used: "
        f"{recent.draft_tokens_accepted}/{recent.draft_tokens_proposed} draft tokens, {recent.rejections} rejections, "
        f"{recent.speculated_requests} speculated requests)"
    )
    floor = f"{ALPHA_FLOOR:.2f} = the guide's {ACCEPTANCE_FLOOR} acceptance at k = {NUM_DRAFT_TOKENS}"
    if recent.alpha_hat >= ALPHA_FLOOR:
        return Check("acceptance rate", PASS, figure, f"α̂ at least {floor}")
    return Check("acceptance rate", FAIL, figure, f"α̂ below {floor}: a draft problem (not same-origin?)")


def _band_name(band: verify_pb2.LoadBand) -> str:
    if band.max_sessions == band.min_sessions:
        return f"{band.min_sessions}"
    return f"{band.min_sessions}-{band.max_sessions}" if band.max_sessions else f"{band.min_sessions}+"


def load(recent: verify_pb2.RecentRequests) -> Check:
    bands = list(recent.load_bands)
    rounds = sum(b.auto_rounds for b in bands)
    if not rounds:
        return Check("load", WARN, "no AUTO rounds in the window", "nothing to judge yet")
    held = sum(b.held_by_load for b in bands)
    by_band = ", ".join(
        f"{_band_name(b)}: {b.held_by_load}/{b.auto_rounds} held, α̂ {b.alpha_hat:.2f}" for b in bands if b.auto_rounds
    )
    figure = f"{held / rounds:.0%} of {rounds} AUTO rounds held at k = 0 by load (sessions per step {by_band})"
    if held / rounds > HELD_WARN:
        detail = "most rounds ran target-only for the batch's sake: speculation rarely pays at this load"
        return Check("load", WARN, figure, detail)
    measured = [b for b in bands if b.draft_tokens_proposed >= LOAD_MIN_PROPOSED]
    if len(measured) >= 2 and min(b.alpha_hat for b in measured[1:]) < measured[0].alpha_hat - LOAD_ALPHA_DROP:
        detail = f"α̂ falls by over {LOAD_ALPHA_DROP} under load: the draft is kept less often in a batch"
        return Check("load", WARN, figure, detail)
    return Check("load", PASS, figure, "speculation adapts to load: k falls as the batch fills, α̂ holds")


def report_json(found: list[Check], info: verify_pb2.VerifyInfo) -> dict:
    return {
        "ok": all(c.verdict != FAIL for c in found),
        "window": info.recent.window,
        "checks": [asdict(c) for c in found],
    }


def report_text(found: list[Check]) -> str:
    width = max(len(c.name) for c in found)
    lines = [f"[{c.verdict.upper():4}] {c.name:<{width}}  {c.figure}\n       {'':<{width}}  {c.detail}" for c in found]
    failed = sum(c.verdict == FAIL for c in found)
    lines.append(f"{failed} check(s) failed" if failed else "no check failed")
    return "\n".join(lines)
