"""Model runtime shared by the draft and verify services.

Loads any transformers causal LM (local path or hub id) and runs it over per-session KV
caches: prefill, incremental forward, and rollback to any prefix length, so no session
ever recomputes its prefix. Not thread-safe: each service calls it from its one engine
thread only.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import dataclass

import torch
from transformers import AutoModelForCausalLM, DynamicCache, PreTrainedModel

DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}


@dataclass(frozen=True)
class ModelSpec:
    """Where a model comes from and how it runs."""

    path: str  # local directory or hub id
    device: str = "cpu"
    dtype: str = "float32"  # one of DTYPES


class KVCache:
    """The keys and values of one session's first `length` tokens."""

    def __init__(self, model: PreTrainedModel) -> None:
        self.layers = DynamicCache(config=model.config)
        self.length = 0

    def rollback(self, length: int) -> None:
        """Forgets every position at or after `length` (0 <= length <= self.length)."""
        if not 0 <= length <= self.length:
            raise ValueError(f"cannot roll back a cache of {self.length} tokens to {length}")
        if length < self.length:
            # transformers 5 crops by a negative count: the number of positions to drop.
            self.layers.crop(length - self.length)
            self.length = length

    def nbytes(self) -> int:
        """Memory held by the cached keys and values."""
        total = 0
        for layer in self.layers.layers:
            if getattr(layer, "keys", None) is not None:
                total += layer.keys.nbytes + layer.values.nbytes
        return total


class CausalLM:
    """A causal language model with cache-aware forwards and counters."""

    def __init__(self, model: PreTrainedModel, name: str) -> None:
        self.model = model.eval()
        self.name = name
        self.device = next(model.parameters()).device
        self.forwards = 0

    @classmethod
    def load(cls, spec: ModelSpec) -> CausalLM:
        if spec.dtype not in DTYPES:
            raise ValueError(f"dtype must be one of {sorted(DTYPES)}, got {spec.dtype!r}")
        model = AutoModelForCausalLM.from_pretrained(spec.path, dtype=DTYPES[spec.dtype])
        return cls(model.to(spec.device), spec.path)

    @property
    def vocab_size(self) -> int:
        return int(self.model.get_output_embeddings().weight.shape[0])

    @property
    def max_positions(self) -> int:
        return int(self.model.config.max_position_embeddings)

    @property
    def parameters(self) -> int:
        return sum(p.numel() for p in self.model.parameters())

    @property
    def eos_token_ids(self) -> frozenset[int]:
        eos = self.model.generation_config.eos_token_id
        if eos is None:
            eos = self.model.config.eos_token_id
        if eos is None:
            return frozenset()
        return frozenset([eos] if isinstance(eos, int) else eos)

    def new_cache(self) -> KVCache:
        return KVCache(self.model)

    def new_generator(self, seed: int) -> torch.Generator:
        return torch.Generator(device=self.device).manual_seed(seed)

    @torch.inference_mode()
    def forward(self, cache: KVCache, ids: Sequence[int]) -> torch.Tensor:
        """Feeds ids after the cached prefix; returns their logits [len(ids), V], float32."""
        input_ids = torch.tensor([list(ids)], dtype=torch.long, device=self.device)
        out = self.model(input_ids=input_ids, cache=cache.layers, use_cache=True)
        cache.length += len(ids)
        self.forwards += 1
        return out.logits[0].float()

    def step_time_s(self, repeats: int = 15) -> float:
        """Median wall time of one single-token forward with a warm cache."""
        cache = self.new_cache()
        self.forward(cache, [0] * 8)
        times = []
        for _ in range(repeats):
            start = time.perf_counter()
            self.forward(cache, [0])
            times.append(time.perf_counter() - start)
            cache.rollback(8)
        self.forwards -= repeats + 1  # calibration is not service work
        return sorted(times)[len(times) // 2]
