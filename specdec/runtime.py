"""Model runtime shared by the draft and verify services.

Loads any transformers causal LM (local path or hub id) and runs it over per-session KV
caches: prefill, incremental forward, and rollback to any prefix length, so no session
ever recomputes its prefix. GPT-2-architecture models run on the lean static-cache forward
of specdec.gpt2_static unless the generic transformers path is asked for; every other
model runs on transformers' own forward. Not thread-safe: each service calls it from its
one engine thread only.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import dataclass

import torch
from transformers import AutoModelForCausalLM, DynamicCache, PreTrainedModel

from specdec import gpt2_static

DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}
BACKENDS = ("auto", "static-gpt2", "transformers")


@dataclass(frozen=True)
class ModelSpec:
    """Where a model comes from and how it runs."""

    path: str  # local directory or hub id
    device: str = "cpu"
    dtype: str = "float32"  # one of DTYPES
    backend: str = "auto"  # one of BACKENDS; auto = static-gpt2 where the model allows it
    pool_tokens: int = 0  # tokens of the KV pool; 0: a default


class KVCache:
    """The keys and values of one session's first `length` tokens."""

    def __init__(self, state: DynamicCache | gpt2_static.StaticCache, capacity: int) -> None:
        self.state = state
        self.capacity = capacity  # most tokens this session may hold
        self.length = 0

    def rollback(self, length: int) -> None:
        """Forgets every position at or after `length` (0 <= length <= self.length)."""
        if not 0 <= length <= self.length:
            raise ValueError(f"cannot roll back a cache of {self.length} tokens to {length}")
        if length < self.length and isinstance(self.state, DynamicCache):
            # transformers 5 crops by a negative count: the number of positions to drop.
            self.state.crop(length - self.length)
        # A static cache keeps its buffers: positions past `length` are overwritten later.
        self.length = length

    def release(self) -> None:
        """Frees the session's memory (a pooled reservation); idempotent."""

    def nbytes(self) -> int:
        """Memory held by the keys and values."""
        if isinstance(self.state, gpt2_static.StaticCache):
            return self.state.nbytes()
        return sum(layer.keys.nbytes + layer.values.nbytes for layer in self.state.layers if layer.is_initialized)


class CausalLM:
    """A causal language model with cache-aware forwards and a forward counter."""

    def __init__(self, model: PreTrainedModel, name: str, backend: str = "auto") -> None:
        if backend not in BACKENDS:
            raise ValueError(f"backend must be one of {BACKENDS}, got {backend!r}")
        self.model = model.eval()
        self.name = name
        self.device = next(model.parameters()).device
        self.forwards = 0
        unsupported = gpt2_static.supports(model)
        if backend == "static-gpt2" and unsupported:
            raise ValueError(f"the static-gpt2 backend cannot run {name}: {unsupported}")
        self._static = gpt2_static.StaticGPT2(model) if backend != "transformers" and not unsupported else None
        self.backend = "static-gpt2" if self._static else "transformers"

    @classmethod
    def load(cls, spec: ModelSpec) -> CausalLM:
        if spec.dtype not in DTYPES:
            raise ValueError(f"dtype must be one of {sorted(DTYPES)}, got {spec.dtype!r}")
        model = AutoModelForCausalLM.from_pretrained(spec.path, dtype=DTYPES[spec.dtype])
        return cls(model.to(spec.device), spec.path, spec.backend)

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
    def dtype(self) -> torch.dtype:
        return next(self.model.parameters()).dtype

    @property
    def weights_bytes(self) -> int:
        return sum(p.numel() * p.element_size() for p in self.model.parameters())

    @property
    def kv_bytes_per_token(self) -> int:
        """Bytes of keys and values one position holds in every layer."""
        config = self.model.config.get_text_config()
        heads = config.num_attention_heads
        kv_heads = getattr(config, "num_key_value_heads", None) or heads
        head_dim = getattr(config, "head_dim", None) or config.hidden_size // heads
        return 2 * config.num_hidden_layers * kv_heads * head_dim * self.dtype.itemsize

    @property
    def eos_token_ids(self) -> frozenset[int]:
        eos = self.model.generation_config.eos_token_id
        if eos is None:
            eos = self.model.config.eos_token_id
        if eos is None:
            return frozenset()
        return frozenset([eos] if isinstance(eos, int) else eos)

    def new_cache(self, capacity: int | None = None) -> KVCache:
        """A cache for a session of at most `capacity` tokens (default: the context)."""
        capacity = min(capacity or self.max_positions, self.max_positions)
        if self._static is not None:
            return KVCache(self._static.new_cache(capacity), capacity)
        return KVCache(DynamicCache(config=self.model.config), capacity)

    def new_generator(self, seed: int) -> torch.Generator:
        return torch.Generator(device=self.device).manual_seed(seed)

    @torch.inference_mode()
    def forward(self, cache: KVCache, ids: Sequence[int]) -> torch.Tensor:
        """Feeds ids after the cached prefix; returns their logits [len(ids), V], float32."""
        if cache.length + len(ids) > cache.capacity:
            raise ValueError(f"{cache.length + len(ids)} positions exceed the session's capacity of {cache.capacity}")
        if self._static is not None:
            logits = self._static.forward(cache.state, cache.length, ids)
        else:
            input_ids = torch.tensor(list(ids), dtype=torch.long, device=self.device)
            logits = self.model(input_ids=input_ids[None], cache=cache.state, use_cache=True).logits[0]
        cache.length += len(ids)
        self.forwards += 1
        return logits.float()

    def forward_batch(self, caches: Sequence[KVCache], ids: Sequence[Sequence[int]]) -> list[torch.Tensor]:
        """forward() of many sessions; each session's logits [len(ids), V]."""
        self.last_batch = (len(caches), sum(len(i) for i in ids))
        return [self.forward(cache, i) for cache, i in zip(caches, ids)]

    def fits(self, tokens: int) -> bool:
        return tokens <= self.max_positions

    def pool_stats(self) -> None:
        return None

    unbatched_reason: str | None = None
    last_batch: tuple[int, int] = (0, 0)

    def step_time_s(self, repeats: int = 15) -> float:
        """Median wall time of one single-token forward with a warm cache."""
        cache = self.new_cache(16)
        self.forward(cache, [0] * 8)
        times = []
        for _ in range(repeats):
            start = time.perf_counter()
            self.forward(cache, [0])
            times.append(time.perf_counter() - start)
            cache.rollback(8)
        self.forwards -= repeats + 1  # calibration is not service work
        return sorted(times)[len(times) // 2]
