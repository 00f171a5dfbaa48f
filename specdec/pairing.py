"""The pairing rules (docs/design.md, same-host pairing): which drafts a target may use.

Three guards, each a way speculation turns into a loss:
- topology: a unix-socket peer is on this kernel; a TCP peer only when its boot id is
  ours; anything else is another machine and is refused. Both on CUDA, the GPU link is
  classified and a PCIe-only pair warns (or is refused under require_nvlink).
- same origin: the tokenizer fingerprints must be equal, unless the operator overrides.
- memory headroom: the target (weights or process memory, plus the KV budget of
  max_sessions full-context sessions) may hold at most 70% of its device's memory,
  unless the operator overrides.
The draft service applies the first two to the verifier too (check_verifier).
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass

from specdec.fingerprint import first_difference
from specdec.gpu_link import classify_devices
from specdec.serving import unix_socket_path
from specdec.v1 import pairing_pb2

MEMORY_SHARE_LIMIT = 0.70
REFUSAL_FACTS_KEY = "specdec-draft-facts-bin"  # trailing metadata of a refused Pair: the draft's PeerFacts
OVERRIDE_SAME_ORIGIN = "same-origin"
OVERRIDE_MEMORY = "memory-headroom"

LinkClassifier = Callable[[str, str], tuple["pairing_pb2.GpuLink", str]]


@dataclass(frozen=True)
class PairingPolicy:
    """The operator's choices; each override shows in Info and in every stream."""

    require_nvlink: bool = False  # refuse a PCIe-only GPU pair instead of warning
    allow_different_tokenizer: bool = False  # same-origin override
    allow_memory_pressure: bool = False  # memory-headroom override


def transport_of_address(address: str) -> pairing_pb2.Transport:
    """How a client reaches a gRPC target address."""
    return pairing_pb2.TRANSPORT_UNIX_SOCKET if unix_socket_path(address) else pairing_pb2.TRANSPORT_TCP


def transport_of_peer(peer: str) -> pairing_pb2.Transport:
    """How a caller reached a server, from grpc's context.peer() ("unix:...", "ipv4:...")."""
    return pairing_pb2.TRANSPORT_UNIX_SOCKET if peer.startswith("unix:") else pairing_pb2.TRANSPORT_TCP


def describe_host(host: pairing_pb2.HostIdentity) -> str:
    boot = host.boot_id[:8] + "..." if host.boot_id else "unknown"
    return f"{host.hostname or '?'} (boot id {boot}, pid {host.pid})"


def same_host(transport: pairing_pb2.Transport, ours: pairing_pb2.HostIdentity, theirs: pairing_pb2.HostIdentity) -> bool:
    if transport == pairing_pb2.TRANSPORT_UNIX_SOCKET:
        return True
    return bool(ours.boot_id) and ours.boot_id == theirs.boot_id


def topology_refusal(
    transport: pairing_pb2.Transport, ours: pairing_pb2.HostIdentity, theirs: pairing_pb2.HostIdentity, peer: str
) -> str | None:
    """Why a peer is on another machine, naming both hosts; None when it is on ours."""
    if same_host(transport, ours, theirs):
        return None
    if not ours.boot_id or not theirs.boot_id:
        return (
            f"cannot show that the {peer} at {describe_host(theirs)} shares this host {describe_host(ours)}: "
            "a boot id is missing, and a TCP peer pairs only with a matching boot id"
        )
    return (
        f"the {peer} runs on another machine: {describe_host(theirs)}; this host is {describe_host(ours)}; "
        "a draft and its target must share one host (unix socket, or TCP with one boot id)"
    )


def origin_refusal(target: pairing_pb2.PeerFacts, draft: pairing_pb2.PeerFacts) -> str | None:
    """How the draft's tokenizer differs from the target's; None when same-origin."""
    difference = first_difference(target.tokenizer, draft.tokenizer)
    return f"tokenizers differ: {difference}" if difference else None


def vocabulary_refusal(target: pairing_pb2.PeerFacts, draft: pairing_pb2.PeerFacts) -> str | None:
    """A draft that can propose ids the target cannot score is refused, override or not."""
    if draft.model.vocab_size > target.model.vocab_size:
        return (
            f"the draft's output layer has {draft.model.vocab_size} tokens, more than the target's "
            f"{target.model.vocab_size}: it could propose ids the target cannot score"
        )
    return None


def memory_share(memory: pairing_pb2.MemoryFacts) -> float:
    """The target's share of its device: weights (process memory on the host) + KV budget."""
    held = memory.used_bytes if memory.kind == "host" else memory.weights_bytes
    held = max(held, memory.weights_bytes)
    return (held + memory.kv_budget_bytes) / memory.total_bytes if memory.total_bytes else 0.0


def check_verifier(
    transport: pairing_pb2.Transport,
    verifier: pairing_pb2.PeerFacts,
    draft: pairing_pb2.PeerFacts,
    allow_different_tokenizer: bool,
) -> str | None:
    """The draft service's side of the handshake: why it refuses this verifier, if it does."""
    refusal = topology_refusal(transport, draft.host, verifier.host, "verify service")
    refusal = refusal or vocabulary_refusal(verifier, draft)
    if refusal is None and not allow_different_tokenizer:
        refusal = origin_refusal(verifier, draft)
    return refusal


def describe_refused_draft(record: pairing_pb2.Pairing, target: pairing_pb2.PeerFacts, draft: pairing_pb2.PeerFacts) -> None:
    """Fills what the verify side can tell of a draft that refused it from the facts it sent."""
    record.draft.CopyFrom(draft)
    record.draft_host = describe_host(draft.host)
    record.same_host = same_host(record.transport, target.host, draft.host)
    origin = origin_refusal(target, draft)
    record.tokenizer_match = origin is None
    record.tokenizer_difference = origin or ""


def decide(
    transport: pairing_pb2.Transport,
    target: pairing_pb2.PeerFacts,
    draft: pairing_pb2.PeerFacts,
    policy: PairingPolicy,
    classify_link: LinkClassifier = classify_devices,
) -> pairing_pb2.Pairing:
    """The verify service's verdict on a draft that answered the handshake."""
    pairing = base_record(transport, target)
    pairing.draft.CopyFrom(draft)
    pairing.draft_host = describe_host(draft.host)
    pairing.same_host = same_host(transport, target.host, draft.host)
    refusals: list[str] = []

    topology = topology_refusal(transport, target.host, draft.host, "draft service")
    if topology:
        refusals.append(topology)
    else:
        pairing.link, pairing.link_detail = classify_link(target.device.gpu_uuid, draft.device.gpu_uuid)
        if pairing.link == pairing_pb2.GPU_LINK_PCIE:
            if policy.require_nvlink:
                refusals.append(f"PCIe-only GPU pair under --require-nvlink: {pairing.link_detail}")
            else:
                pairing.warnings.append(f"PCIe-only GPU pair, every round crosses PCIe: {pairing.link_detail}")
        elif pairing.link == pairing_pb2.GPU_LINK_UNKNOWN:
            pairing.warnings.append(f"GPU link not classified: {pairing.link_detail}")

    vocabulary = vocabulary_refusal(target, draft)
    if vocabulary:
        refusals.append(vocabulary)
    origin = origin_refusal(target, draft)
    pairing.tokenizer_match = origin is None
    pairing.tokenizer_difference = origin or ""
    if origin and policy.allow_different_tokenizer:
        pairing.overrides.append(OVERRIDE_SAME_ORIGIN)
        pairing.warnings.append(f"same-origin guard overridden: {origin}")
    elif origin:
        refusals.append(f"{origin} (the draft is not same-origin)")

    share = pairing.target_memory_share
    if share > MEMORY_SHARE_LIMIT:
        figures = f"the target holds {share:.0%} of its {target.memory.kind} memory, above {MEMORY_SHARE_LIMIT:.0%}"
        if policy.allow_memory_pressure:
            pairing.overrides.append(OVERRIDE_MEMORY)
            pairing.warnings.append(f"memory-headroom guard overridden: {figures}")
        else:
            refusals.append(f"{figures}: a draft would push it into swapping")

    if refusals:
        pairing.state = pairing_pb2.PAIRING_STATE_REFUSED
        pairing.status = "FAILED_PRECONDITION"
        pairing.detail = "; ".join(refusals)
    else:
        pairing.state = pairing_pb2.PAIRING_STATE_PAIRED
    return pairing


def base_record(transport: pairing_pb2.Transport, target: pairing_pb2.PeerFacts) -> pairing_pb2.Pairing:
    """A pairing record with the target's own figures and nothing known of the draft."""
    return pairing_pb2.Pairing(
        transport=transport,
        verifier_host=describe_host(target.host),
        target_memory_share=memory_share(target.memory),
        target_memory=target.memory,
        checked_at_unix_ms=int(time.time() * 1e3),
    )
