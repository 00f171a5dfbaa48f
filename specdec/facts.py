"""What a model service states about itself in the pairing handshake."""

from __future__ import annotations

from specdec.host import HostProbe
from specdec.runtime import CausalLM
from specdec.v1 import pairing_pb2


def model_facts(model: CausalLM, name: str) -> pairing_pb2.ModelFacts:
    return pairing_pb2.ModelFacts(
        name=name,
        parameters=model.parameters,
        vocab_size=model.vocab_size,
        max_positions=model.max_positions,
        dtype=str(model.dtype).removeprefix("torch."),
    )


def memory_facts(model: CausalLM, probe: HostProbe, kv_budget_bytes: int) -> pairing_pb2.MemoryFacts:
    """Memory figures now; kv_budget_bytes is what every session slot may reserve together."""
    kind, total, used = probe.memory(model.device)
    return pairing_pb2.MemoryFacts(
        kind=kind,
        total_bytes=total,
        weights_bytes=model.weights_bytes,
        kv_budget_bytes=kv_budget_bytes,
        used_bytes=used,
    )


def peer_facts(
    model: CausalLM,
    name: str,
    tokenizer: pairing_pb2.TokenizerFingerprint,
    probe: HostProbe,
    kv_budget_bytes: int,
) -> pairing_pb2.PeerFacts:
    return pairing_pb2.PeerFacts(
        host=probe.identity(),
        device=probe.device(model.device),
        model=model_facts(model, name),
        tokenizer=tokenizer,
        memory=memory_facts(model, probe, kv_budget_bytes),
    )
