"""What a model service states about itself: in the pairing handshake and in Info."""

from __future__ import annotations

from specdec.host import HostProbe
from specdec.runtime import CausalLM
from specdec.v1 import common_pb2, pairing_pb2


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


def kv_pool_info(model: CausalLM) -> common_pb2.KVPoolInfo:
    """The model's KV pool as Info reports it; empty on the one-session transformers path."""
    stats = model.pool_stats()
    if stats is None:
        return common_pb2.KVPoolInfo()
    return common_pb2.KVPoolInfo(
        capacity_tokens=stats.capacity_tokens,
        reserved_tokens=stats.reserved_tokens,
        used_tokens=stats.used_tokens,
        bytes=stats.bytes,
    )
