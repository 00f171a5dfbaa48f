"""One preallocated store of keys and values that every session of a model reserves from.

The pool is a single tensor [layers, 2, kv_heads, tokens, head_dim]: a layer's keys (index
0) and values (index 1) side by side, so that one copy writes both. A session reserves a
contiguous run of tokens, so its cache is a view of the pool at every layer, a batched
forward writes the new keys and values of all its sessions with one indexed copy per layer,
and a rollback is a length change. Runs are handed out first-fit from a free list whose
neighbours coalesce on release.
"""

from __future__ import annotations

import bisect
import threading
from dataclasses import dataclass

import torch

from specdec.errors import ResourceExhausted

POOL_FLAG = "--kv-pool-tokens"


class PoolExhausted(ResourceExhausted):
    """No free run of the pool is long enough for a reservation."""


@dataclass
class Reservation:
    """A session's run of the pool: tokens offset .. offset+tokens-1, of which the first
    `length` hold keys and values; `held` tokens are kept from other sessions (a whole
    slot in a slotted pool)."""

    offset: int
    tokens: int
    held: int
    length: int = 0
    released: bool = False


@dataclass(frozen=True)
class PoolStats:
    capacity_tokens: int
    reserved_tokens: int  # held by sessions (whole slots in a slotted pool)
    used_tokens: int  # sum of the sessions' lengths
    bytes: int  # of the pool tensor


class KVPool:
    """Keys and values of `tokens` positions in every layer, allocated once.

    Thread-safe: requests reserve on their handler threads, the model's thread releases,
    and a dropped cache releases from whichever thread the garbage collector runs on, maybe
    one inside `reserve` already. So a release is queued (a list append, atomic) and the
    queue is applied under the lock by whoever holds it next."""

    def __init__(
        self,
        layers: int,
        kv_heads: int,
        head_dim: int,
        tokens: int,
        dtype: torch.dtype,
        device: torch.device,
        slot_tokens: int = 0,
    ) -> None:
        """slot_tokens > 0: every reservation takes a whole slot of that many tokens, at a
        multiple of it. Runs of varied lengths fragment a pool (a hole left by a shorter
        request fits no longer one), so that sessions wait although tokens are free; slots
        as long as the longest reservation never do. 0: runs as long as asked, first fit."""
        if tokens < 1:
            raise ValueError(f"a KV pool needs at least one token, got {tokens}")
        if not 0 <= slot_tokens <= tokens:
            raise ValueError(f"slot_tokens must be in 0..{tokens}, got {slot_tokens}")
        # empty here, zeroed by the model's first forward (`zero_once`): zeroing now would run
        # an OpenMP region on the loading thread (see batched_forward.BatchedForward.prepare
        # for why that matters). A padded attention multiplies positions no forward wrote
        # by a weight of 0, which must not meet a NaN left in fresh memory.
        self.kv = torch.empty(layers, 2, kv_heads, tokens, head_dim, dtype=dtype, device=device)
        self._zeroed = False
        # Each layer's [2, kv_heads, tokens, head_dim] view, made once: indexing the pool
        # with a tuple in every layer of every step costs more than a draft's attention.
        self.layer_kv = list(self.kv.unbind(0))
        self.capacity_tokens = tokens
        self.slot_tokens = slot_tokens
        self._free: list[tuple[int, int]] = [(0, tokens)]  # (offset, tokens), sorted by offset
        self._live: dict[int, Reservation] = {}
        self._lock = threading.Lock()
        self._released: list[Reservation] = []  # queued by release(), applied under the lock

    def zero_once(self) -> None:
        """Zeroes the pool before its first use (on the thread that runs the model)."""
        if not self._zeroed:
            self.kv.zero_()
            self._zeroed = True

    @property
    def bytes_per_token(self) -> int:
        return self.kv.nbytes // self.capacity_tokens

    def fits(self, tokens: int) -> bool:
        """Whether a reservation of this many tokens would succeed now."""
        with self._lock:
            self._apply_releases()
            return self._find(tokens) is not None

    def _held(self, tokens: int) -> int:
        return self.slot_tokens if self.slot_tokens and tokens <= self.slot_tokens else tokens

    def _find(self, tokens: int) -> tuple[int, int] | None:
        """(index in the free list, offset) of the first run that can hold the reservation."""
        held = self._held(tokens)
        for i, (offset, run) in enumerate(self._free):
            start = offset
            if self.slot_tokens and tokens <= self.slot_tokens:
                start = -(-offset // self.slot_tokens) * self.slot_tokens  # the next slot boundary
            if start + held <= offset + run:
                return i, start
        return None

    def reserve(self, tokens: int) -> Reservation:
        """First-fit run of `tokens` positions; PoolExhausted when no free run is long enough."""
        if tokens < 1:
            raise ValueError(f"a reservation needs at least one token, got {tokens}")
        with self._lock:
            self._apply_releases()
            return self._reserve(tokens)

    def _reserve(self, tokens: int) -> Reservation:
        found = self._find(tokens)
        if found is None:
            free = sum(run for _, run in self._free)
            largest = max((run for _, run in self._free), default=0)
            slots = f" in slots of {self.slot_tokens}" if self.slot_tokens else ""
            raise PoolExhausted(
                f"the KV pool cannot reserve {tokens} tokens{slots}: {free} of its {self.capacity_tokens} are free, "
                f"the largest free run {largest}; free sessions or raise {POOL_FLAG}"
            )
        i, start = found
        offset, run = self._free.pop(i)
        held = self._held(tokens)
        if start > offset:  # the part of the run before the slot stays free
            self._free.insert(i, (offset, start - offset))
            i += 1
        if start + held < offset + run:
            self._free.insert(i, (start + held, offset + run - start - held))
        self._live[start] = Reservation(start, tokens, held)
        return self._live[start]

    def release(self, reservation: Reservation) -> None:
        """Returns the run to the free list, merged with free neighbours. Idempotent."""
        self._released.append(reservation)
        if self._lock.acquire(blocking=False):  # else the holder, or the next caller, applies it
            try:
                self._apply_releases()
            finally:
                self._lock.release()

    def _apply_releases(self) -> None:
        while self._released:
            self._give_back(self._released.pop())

    def _give_back(self, reservation: Reservation) -> None:
        if reservation.released:
            return
        reservation.released = True
        del self._live[reservation.offset]
        start, end = reservation.offset, reservation.offset + reservation.held
        i = bisect.bisect_left(self._free, (start, 0))
        if i < len(self._free) and self._free[i][0] == end:  # the run after
            end += self._free.pop(i)[1]
        if i > 0 and sum(self._free[i - 1]) == start:  # the run before
            i -= 1
            start = self._free.pop(i)[0]
        self._free.insert(i, (start, end - start))

    def stats(self) -> PoolStats:
        with self._lock:
            self._apply_releases()
            return self._stats()

    def _stats(self) -> PoolStats:
        return PoolStats(
            capacity_tokens=self.capacity_tokens,
            reserved_tokens=sum(r.held for r in self._live.values()),
            used_tokens=sum(r.length for r in self._live.values()),
            bytes=self.kv.nbytes,
        )
