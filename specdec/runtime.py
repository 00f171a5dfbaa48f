"""Model runtime shared by the draft and verify services.

Loads any transformers causal LM (local path or hub id) and runs it over per-session KV
caches: prefill, incremental forward, rollback to any prefix length, and forwards over the
new positions of many sessions at once, so no session ever recomputes its prefix. GPT-2 and
Llama-family models run on the batched forward of specdec.batched_forward, their caches
reserved from one preallocated KV pool, unless the generic transformers path is asked for;
every other model runs on transformers' own forward, one session per forward, and
`CausalLM.unbatched_reason` says why. Not thread-safe, but for the pool's reservations:
each service runs its forwards on one thread only (the verify service's round loop, the
draft service's engine).
"""

from __future__ import annotations

import logging

import time
import weakref
from collections.abc import Sequence
from dataclasses import dataclass, replace

import torch
from transformers import AutoModelForCausalLM, DynamicCache, PreTrainedModel

from specdec import model_families
from specdec.batched_forward import BatchedForward, Segment
from specdec.kv_pool import KVPool, PoolStats, Reservation

DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}
BACKENDS = ("auto", "batched", "transformers")
# The default pool: this many whole contexts, but at most this many bytes.
DEFAULT_POOL_CONTEXTS = 8
DEFAULT_POOL_MAX_BYTES = 2**30


@dataclass(frozen=True)
class ModelSpec:
    """Where a model comes from and how it runs."""

    path: str  # local directory or hub id
    device: str = "cpu"
    dtype: str = "float32"  # one of DTYPES
    backend: str = "auto"  # one of BACKENDS; auto = batched where the model allows it
    # Tokens of the batched runtime's KV pool, shared by all sessions; 0: the model's context
    # times pool_contexts, capped at DEFAULT_POOL_MAX_BYTES (never under one context).
    pool_tokens: int = 0
    pool_contexts: int = DEFAULT_POOL_CONTEXTS  # a service passes its most sessions: none waits for the pool by default
    # Each session takes a slot of a whole context (at most the pool): the services' pools,
    # which must not fragment; False: runs as long as asked.
    pool_slots: bool = False


class KVCache:
    """The keys and values of one session's first `length` tokens: a reservation of the
    model's KV pool (batched runtime) or a transformers DynamicCache (generic path)."""

    def __init__(self, capacity: int, pool: KVPool | None = None, state: DynamicCache | None = None) -> None:
        self.capacity = capacity  # most tokens this session may hold
        self.state = state
        self.pool = pool
        self._length = 0
        self._reservation: Reservation | None = None
        self._release = None
        self._bytes_per_token = 0
        if pool is not None:
            self._bytes_per_token = pool.bytes_per_token
            self._reservation = pool.reserve(capacity)
            # A cache dropped without release() still gives its run back (once).
            self._release = weakref.finalize(self, pool.release, self._reservation)

    @property
    def offset(self) -> int | None:
        """Pool position of this session's first token (None on the generic path)."""
        return None if self._reservation is None else self._reservation.offset

    @property
    def length(self) -> int:
        return self._length

    @length.setter
    def length(self, length: int) -> None:
        self._length = length
        if self._reservation is not None:
            self._reservation.length = length  # the pool's used_tokens

    def rollback(self, length: int) -> None:
        """Forgets every position at or after `length` (0 <= length <= self.length)."""
        if not 0 <= length <= self.length:
            raise ValueError(f"cannot roll back a cache of {self.length} tokens to {length}")
        if length < self.length and self.state is not None:
            # transformers 5 crops by a negative count: the number of positions to drop.
            self.state.crop(length - self.length)
        # A pooled cache keeps its run: positions past `length` are overwritten later.
        self.length = length

    def release(self) -> None:
        """Gives the pool reservation back (idempotent; nothing to do on the generic path).
        The cache must not be used afterwards."""
        if self._release is not None:
            self._release()

    @property
    def released(self) -> bool:
        return self._reservation is not None and self._reservation.released

    def nbytes(self) -> int:
        """Memory held by the keys and values (a pooled cache: its whole reservation)."""
        if self._reservation is not None:
            return 0 if self._reservation.released else self._reservation.held * self._bytes_per_token
        return sum(layer.keys.nbytes + layer.values.nbytes for layer in self.state.layers if layer.is_initialized)


class CausalLM:
    """A causal language model with cache-aware, batched forwards and a forward counter."""

    def __init__(
        self, model: PreTrainedModel, name: str, backend: str = "auto", pool_tokens: int = 0,
        pool_contexts: int = DEFAULT_POOL_CONTEXTS,
        pool_slots: bool = False,
    ) -> None:  # fmt: skip
        if backend not in BACKENDS:
            raise ValueError(f"backend must be one of {BACKENDS}, got {backend!r}")
        self.model = model.eval()
        self.name = name
        self.device = next(model.parameters()).device
        self.forwards = 0
        self.last_batch = (0, 0)  # sessions and positions of the last forward
        unsupported = model_families.supports(model)
        if backend == "batched" and unsupported:
            raise ValueError(f"the batched backend cannot run {name}: {unsupported}")
        if backend == "transformers":
            unsupported = "the transformers backend was asked for"
        self.unbatched_reason: str | None = unsupported
        self._batched: BatchedForward | None = None
        self._pool: KVPool | None = None
        if unsupported is None:
            self._batched = BatchedForward(model_families.describe(model))
            d = self._batched.d
            tokens = pool_tokens or self._default_pool_tokens(pool_contexts)
            slot = min(self.max_positions, tokens) if pool_slots else 0
            self._pool = KVPool(len(d.layers), d.kv_heads, d.head_dim, tokens, self.dtype, self.device, slot)
        self.backend = "batched" if self._batched is not None else "transformers"

    @classmethod
    def load(cls, spec: ModelSpec) -> CausalLM:
        if spec.dtype not in DTYPES:
            raise ValueError(f"dtype must be one of {sorted(DTYPES)}, got {spec.dtype!r}")
        model = AutoModelForCausalLM.from_pretrained(spec.path, dtype=DTYPES[spec.dtype])
        return cls(
            model.to(spec.device), spec.path, spec.backend, spec.pool_tokens, spec.pool_contexts, spec.pool_slots
        )

    @classmethod
    def load_for_service(cls, spec: ModelSpec, role: str, log: logging.Logger) -> CausalLM:
        """A model service's model: one slot of its pool per session (so the pool never
        fragments), and a warning in the log when it cannot run batched."""
        model = cls.load(replace(spec, pool_slots=True))
        if model.unbatched_reason:
            log.warning("the %s runs one session per forward (transformers path): %s", role, model.unbatched_reason)
        return model

    def _default_pool_tokens(self, contexts: int) -> int:
        tokens = contexts * self.max_positions
        return max(self.max_positions, min(tokens, DEFAULT_POOL_MAX_BYTES // self.kv_bytes_per_token))

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
        """A cache for a session of at most `capacity` tokens (default: the context), reserved
        from the KV pool on the batched runtime (PoolExhausted when it does not fit)."""
        capacity = min(capacity or self.max_positions, self.max_positions)
        if self._pool is not None:
            return KVCache(capacity, pool=self._pool)
        return KVCache(capacity, state=DynamicCache(config=self.model.config))

    def fits(self, tokens: int) -> bool:
        """Whether a cache of this many tokens can be reserved now (always on the generic path)."""
        return self._pool is None or self._pool.fits(tokens)

    def pool_stats(self) -> PoolStats | None:
        return None if self._pool is None else self._pool.stats()

    def new_generator(self, seed: int) -> torch.Generator:
        return torch.Generator(device=self.device).manual_seed(seed)

    @torch.inference_mode()
    def forward(self, cache: KVCache, ids: Sequence[int]) -> torch.Tensor:
        """Feeds ids after the cached prefix; returns their logits [len(ids), V], float32: a
        forward_batch of one, without its lists (a draft's step is short)."""
        self._check(0, cache, ids)
        if self._batched is not None:
            self._pool.zero_once()
            logits = self._batched.forward((Segment(cache.offset, cache.length, ids),), self._pool.layer_kv)
        else:
            logits = self._generic(cache, ids)
        cache.length += len(ids)
        self.forwards += 1
        self.last_batch = (1, len(ids))
        return logits.float()

    @torch.inference_mode()
    def forward_batch(self, caches: Sequence[KVCache], ids: Sequence[Sequence[int]]) -> list[torch.Tensor]:
        """One forward over the new ids of every session, each after its own cached prefix;
        returns each session's logits [len(ids[i]), V], float32. Every session is checked
        before anything runs: a bad one raises ValueError and no cache changes."""
        if len(caches) != len(ids) or not caches:
            raise ValueError(f"a batch needs one id list per cache, at least one: got {len(caches)} and {len(ids)}")
        if len(caches) == 1:  # one stream's every round: the lean path
            return [self.forward(caches[0], ids[0])]
        if len({id(cache) for cache in caches}) != len(caches):
            raise ValueError("a batch holds the same cache twice")
        for i, (cache, ids_i) in enumerate(zip(caches, ids)):
            self._check(i, cache, ids_i)
        if self._batched is not None:
            segments = [Segment(cache.offset, cache.length, ids_i) for cache, ids_i in zip(caches, ids)]
            self._pool.zero_once()
            logits = self._batched.forward(segments, self._pool.layer_kv, self._pool.slot_tokens).float()
            out = list(logits.split([len(ids_i) for ids_i in ids]))
        else:
            out = [self._generic(cache, ids_i).float() for cache, ids_i in zip(caches, ids)]
        for cache, ids_i in zip(caches, ids):
            cache.length += len(ids_i)
        self.forwards += 1
        self.last_batch = (len(caches), sum(len(ids_i) for ids_i in ids))
        return out

    def _check(self, i: int, cache: KVCache, ids: Sequence[int]) -> None:
        """ValueError naming session i of a batch if it cannot take these ids."""
        if not ids:
            raise ValueError(f"session {i} of the batch feeds no ids")
        if cache.length + len(ids) > cache.capacity:
            raise ValueError(
                f"session {i} of the batch: {cache.length + len(ids)} positions exceed its capacity of {cache.capacity}"
            )
        if cache.pool is not self._pool:
            raise ValueError(f"session {i} of the batch is not a cache of this model")
        if cache.pool is not None and cache.released:
            raise ValueError(f"session {i} of the batch was released")

    def _generic(self, cache: KVCache, ids: Sequence[int]) -> torch.Tensor:
        input_ids = torch.tensor(list(ids), dtype=torch.long, device=self.device)
        return self.model(input_ids=input_ids[None], cache=cache.state, use_cache=True).logits[0]

    def step_time_s(self, repeats: int = 15) -> float:
        """Median wall time of one single-token forward with a warm cache."""
        cache = self.new_cache(16)
        try:
            self.forward(cache, [0] * 8)
            times = []
            for _ in range(repeats):
                start = time.perf_counter()
                self.forward(cache, [0])
                times.append(time.perf_counter() - start)
                cache.rollback(8)
        finally:
            cache.release()
        self.forwards -= repeats + 1  # calibration is not service work
        return sorted(times)[len(times) // 2]
