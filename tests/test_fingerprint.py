"""Tokenizer fingerprints and the pairing rules as pure functions (the processes that
apply them are in test_pairing)."""

from __future__ import annotations

import json

import pytest
from transformers import AutoTokenizer

from specdec import fingerprint, pairing
from specdec.toy_models import foreign_tokenizer_copy
from specdec.v1 import pairing_pb2

def test_same_tokenizer_same_fingerprint(toy):
    assert fingerprint.load_fingerprint(str(toy.target)) == fingerprint.load_fingerprint(str(toy.close))
    assert fingerprint.first_difference(
        fingerprint.load_fingerprint(str(toy.target)), fingerprint.load_fingerprint(str(toy.far))
    ) is None


def test_swapped_tokens_are_named_by_their_block(toy, tmp_path):
    foreign = foreign_tokenizer_copy(toy.close, tmp_path / "foreign")
    ours, theirs = fingerprint.load_fingerprint(str(toy.target)), fingerprint.load_fingerprint(str(foreign))
    swapped = json.loads((foreign / "tokenizer.json").read_text())["model"]["vocab"]
    original = json.loads((toy.target / "tokenizer.json").read_text())["model"]["vocab"]
    first = min(i for token, i in swapped.items() if original[token] != i)
    block = first // fingerprint.BLOCK
    expected = f"vocabulary: token ids {block * fingerprint.BLOCK}..{(block + 1) * fingerprint.BLOCK - 1} differ"
    assert fingerprint.first_difference(ours, theirs) == expected


def test_special_tokens_and_missing_tokenizers_are_named(toy, tmp_path):
    ours = fingerprint.load_fingerprint(str(toy.target))
    tokenizer = AutoTokenizer.from_pretrained(toy.target)
    tokenizer.add_special_tokens({"pad_token": "<pad>"})  # a new token: id 400, in the second block
    assert fingerprint.first_difference(ours, fingerprint.fingerprint(tokenizer)) == "vocabulary: token ids 256..511 differ"
    tokenizer = AutoTokenizer.from_pretrained(toy.target)
    tokenizer.add_special_tokens({"pad_token": tokenizer.eos_token})  # same vocabulary, one more role
    assert fingerprint.first_difference(ours, fingerprint.fingerprint(tokenizer)) == (
        "special tokens: only the draft has pad_token=<|endoftext|>"
    )
    empty = tmp_path / "no-tokenizer"
    empty.mkdir()
    missing = fingerprint.load_fingerprint(str(empty))
    assert not missing.present
    assert "the draft model has none" in fingerprint.first_difference(ours, missing)


def test_topology_rules(facts):
    tcp, uds = pairing_pb2.TRANSPORT_TCP, pairing_pb2.TRANSPORT_UNIX_SOCKET
    here, there, unknown = facts(), facts(boot="another-kernel", host="node-b"), facts(boot="")
    policy = pairing.PairingPolicy()
    assert pairing.decide(uds, here, there, policy).state == pairing_pb2.PAIRING_STATE_PAIRED  # a socket is local
    assert pairing.decide(tcp, here, facts(host="container-2"), policy).state == pairing_pb2.PAIRING_STATE_PAIRED
    refused = pairing.decide(tcp, here, there, policy)
    assert refused.state == pairing_pb2.PAIRING_STATE_REFUSED and refused.status == "FAILED_PRECONDITION"
    assert "node-a" in refused.detail and "node-b" in refused.detail and not refused.same_host
    assert "boot id is missing" in pairing.decide(tcp, here, unknown, policy).detail
    # The draft applies the same rule to the verifier.
    assert "another machine" in pairing.check_verifier(tcp, there, here, allow_different_tokenizer=False)
    assert pairing.check_verifier(uds, there, here, allow_different_tokenizer=False) is None


def test_same_origin_and_memory_rules(facts, toy, tmp_path):
    foreign_fp = fingerprint.load_fingerprint(str(foreign_tokenizer_copy(toy.close, tmp_path / "f")))
    uds = pairing_pb2.TRANSPORT_UNIX_SOCKET
    here, foreign = facts(), facts(tokenizer=foreign_fp)
    assert pairing.decide(uds, here, foreign, pairing.PairingPolicy()).state == pairing_pb2.PAIRING_STATE_REFUSED
    allowed = pairing.decide(uds, here, foreign, pairing.PairingPolicy(allow_different_tokenizer=True))
    assert allowed.state == pairing_pb2.PAIRING_STATE_PAIRED and list(allowed.overrides) == ["same-origin"]
    # A draft that could propose ids the target cannot score is refused, override or not.
    big = facts()
    big.model.vocab_size = 401
    assert "cannot score" in pairing.decide(uds, here, big, pairing.PairingPolicy(allow_different_tokenizer=True)).detail

    # used 10 + KV 10 of 100 = 20%; used 65 + KV 10 = 75%: above the 70% limit.
    assert pairing.decide(uds, facts(used=10), facts(), pairing.PairingPolicy()).target_memory_share == pytest.approx(0.2)
    full = pairing.decide(uds, facts(used=65), facts(), pairing.PairingPolicy())
    assert full.state == pairing_pb2.PAIRING_STATE_REFUSED and "75%" in full.detail and "above 70%" in full.detail
    forced = pairing.decide(uds, facts(used=65), facts(), pairing.PairingPolicy(allow_memory_pressure=True))
    assert forced.state == pairing_pb2.PAIRING_STATE_PAIRED and list(forced.overrides) == ["memory-headroom"]
