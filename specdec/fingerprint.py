"""Tokenizer fingerprints, and the first difference between two of them (same-origin guard).

A fingerprint holds digests of what decides how text becomes ids: the vocabulary (token
string and id), the BPE merges, the special tokens and the normalize/pre-tokenize/decode
pipeline. Block digests of the vocabulary locate a difference without sending it whole.
"""

from __future__ import annotations

import hashlib
import json
from typing import TYPE_CHECKING

from specdec.v1 import pairing_pb2

if TYPE_CHECKING:  # importing transformers takes seconds: clients (specdec generate) never need it
    from transformers import PreTrainedTokenizerBase

BLOCK = 256  # vocabulary ids per block digest


def _sha256(parts: list[str]) -> str:
    digest = hashlib.sha256()
    for part in parts:
        digest.update(part.encode("utf-8", "surrogatepass") + b"\0")
    return digest.hexdigest()


def fingerprint(tokenizer: PreTrainedTokenizerBase) -> pairing_pb2.TokenizerFingerprint:
    by_id = sorted((i, token) for token, i in tokenizer.get_vocab().items())
    entries = [f"{i}\t{token}" for i, token in by_id]
    blocks: dict[int, list[str]] = {}
    for (i, _), entry in zip(by_id, entries, strict=True):
        blocks.setdefault(i // BLOCK, []).append(entry)
    merges: list[str] = []
    pipeline = type(tokenizer).__name__
    if tokenizer.is_fast:
        spec = json.loads(tokenizer.backend_tokenizer.to_str())
        merges = [m if isinstance(m, str) else " ".join(m) for m in spec.get("model", {}).get("merges", [])]
        pipeline = json.dumps({k: spec.get(k) for k in ("normalizer", "pre_tokenizer", "decoder", "post_processor")})
    special = sorted(
        f"{role}={token}" for role, value in tokenizer.special_tokens_map.items()
        for token in (value if isinstance(value, list) else [value])
    )  # fmt: skip
    return pairing_pb2.TokenizerFingerprint(
        present=True,
        vocab_size=len(by_id),
        vocab_sha256=_sha256(entries),
        vocab_block_sha256=[_sha256(blocks.get(b, [])) for b in range(max(blocks, default=-1) + 1)],
        merges=len(merges),
        merges_sha256=_sha256(merges),
        special_tokens=special,
        pipeline_sha256=_sha256([pipeline]),
    )


def load_fingerprint(model_path: str) -> pairing_pb2.TokenizerFingerprint:
    """The fingerprint of the tokenizer stored with a model; present=False when it has none."""
    from transformers import AutoTokenizer

    try:
        tokenizer = AutoTokenizer.from_pretrained(model_path)
    except (OSError, ValueError):
        return pairing_pb2.TokenizerFingerprint(present=False)
    return fingerprint(tokenizer)


def first_difference(
    target: pairing_pb2.TokenizerFingerprint, draft: pairing_pb2.TokenizerFingerprint
) -> str | None:
    """What differs first between the target's and the draft's tokenizers; None if equal."""
    if not target.present or not draft.present:
        missing = [name for name, fp in (("target", target), ("draft", draft)) if not fp.present]
        return f"no tokenizer to compare: the {' and the '.join(missing)} model has none"
    for b, (ours, theirs) in enumerate(zip(target.vocab_block_sha256, draft.vocab_block_sha256)):
        if ours != theirs:
            return f"vocabulary: token ids {b * BLOCK}..{(b + 1) * BLOCK - 1} differ"
    if target.vocab_size != draft.vocab_size or target.vocab_sha256 != draft.vocab_sha256:
        return f"vocabulary size: target {target.vocab_size} tokens, draft {draft.vocab_size}"
    if target.merges != draft.merges or target.merges_sha256 != draft.merges_sha256:
        return f"BPE merges: target {target.merges}, draft {draft.merges} (or the same count in another order)"
    if list(target.special_tokens) != list(draft.special_tokens):
        ours, theirs = set(target.special_tokens), set(draft.special_tokens)
        first = sorted(ours ^ theirs)[0]
        side = "target" if first in ours else "draft"
        return f"special tokens: only the {side} has {first}"
    if target.pipeline_sha256 != draft.pipeline_sha256:
        return "normalizer, pre-tokenizer, decoder or post-processor configuration"
    return None
