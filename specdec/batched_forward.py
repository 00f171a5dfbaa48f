"""One forward over the new positions of many sessions, each attending to its own cache.

transformers' generic forward spends about half a millisecond per call on Python
bookkeeping (module hooks, mask construction, cache objects, output dataclasses), which for
a small draft model is most of its step, and it runs one session at a time. This forward
runs a model_families.Description in a handful of tensor ops per layer: the rows of every
session go through the projections and the MLP as one matrix, their keys and values are
written into the KV pool with one copy per layer, and attention loops over the sessions on
views of the pool (see docs/design.md, "Batched runtime", for what that loop costs).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import replace
from typing import NamedTuple

import torch
import torch.nn.functional as F

from specdec.model_families import Description, Layer

# bias [out] or None, x [n, in], weight (as prepared) -> x times weight plus bias [n, out]
Linear = Callable[[torch.Tensor | None, torch.Tensor, torch.Tensor], torch.Tensor]

# Up to this many new positions on a CPU, a session's attention runs as two batched matmuls
# around a softmax: at decode and verify sizes that is 1.3-1.8x faster there than
# scaled_dot_product_attention, whose per-call overhead is a large part of a small model's
# step. Longer runs (prefills), and other devices, use SDPA, which does not hold the
# [heads, n, context] scores in memory at once.
MATMUL_ATTENTION_MAX_POSITIONS = 64

# From this width on, a float32 model on a CPU multiplies by weights that oneDNN reordered
# once into its blocked layout: at the few rows of a decode step or a verify that is 2-4x
# faster per matmul than addmm, whose gemm repacks the weights on every call (the committed
# 384-wide target: a step 4.8 -> 3.3 ms, a 9-position verify 7.4 -> 4.5 ms). Below it the
# packed call's own overhead wins (the 96-wide draft: 0.45 -> 0.62 ms a step).
PACK_MIN_WIDTH = 256


class Segment(NamedTuple):
    """One session's part of a batch: its ids at positions start.. of its pool run at offset."""

    offset: int
    start: int
    ids: Sequence[int]


def can_pack(device: torch.device, dtype: torch.dtype) -> bool:
    """Whether this torch has oneDNN's prepacked linear for weights of this device and dtype."""
    return (
        device.type == "cpu" and dtype == torch.float32 and torch.backends.mkldnn.is_available()
        and hasattr(torch.ops.mkldnn, "_reorder_linear_weight") and hasattr(torch.ops.mkldnn, "_linear_pointwise")
    )  # fmt: skip


def _packed(weight: torch.Tensor) -> torch.Tensor:
    """weight [in, out] reordered for oneDNN (which takes nn.Linear's [out, in]); 9 rows is the
    batch it is tuned for (a verify of 8 draft tokens), any number of rows still works."""
    return torch.ops.mkldnn._reorder_linear_weight(weight.t().contiguous(), 9)


def _packed_linear(bias: torch.Tensor | None, x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    return torch.ops.mkldnn._linear_pointwise(x, weight, bias, "none", [], "")


def _packed_linear_gelu(bias: torch.Tensor | None, x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """The gelu applied inside oneDNN's matmul: on a 9-position verify of the committed
    target that saved 14 us of a 59 us MLP input projection, 1 us on a single position."""
    return torch.ops.mkldnn._linear_pointwise(x, weight, bias, "gelu", [], "tanh")


def _linear(bias: torch.Tensor | None, x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    return torch.mm(x, weight) if bias is None else torch.addmm(bias, x, weight)


def _linear_gelu(bias: torch.Tensor | None, x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    return F.gelu(_linear(bias, x, weight), approximate="tanh")


def attention_bias(
    n: int, keys: int, window: int | None, dtype: torch.dtype, device: torch.device
) -> torch.Tensor | None:
    """[n, keys] added to the scores of n queries, the last n of `keys` positions: -inf where a
    query must not look (later positions; with a window, positions `window` or more before
    it), 0 elsewhere. None where no query needs a mask: one query that sees all its keys.
    Built once a forward per session, in the form both attention paths take."""
    first = keys - n  # index of the first query among the keys
    if n == 1 and (window is None or keys <= window):
        return None
    bias = torch.full((n, keys), float("-inf"), dtype=dtype, device=device).triu_(first + 1)
    if window is not None and keys - 1 - window >= 0:  # some key is too old for the first query
        bias += torch.full((n, keys), float("-inf"), dtype=dtype, device=device).tril_(first - window)
    return bias


def attend(q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """Attention of grouped queries q [KV, group * n, D] (already scaled; each kv head's query
    heads one after another, n positions each) over keys and values [KV, L, D], bias [n, L]
    or None -> [KV, group * n, D]."""
    kv_heads, rows, _ = q.shape
    n = 1 if bias is None else bias.shape[0]
    if q.device.type != "cpu" or n > MATMUL_ATTENTION_MAX_POSITIONS:
        mask = None if bias is None else bias.repeat(rows // n, 1)  # the same mask for every query head
        return F.scaled_dot_product_attention(q, keys, values, attn_mask=mask, scale=1.0)
    scores = torch.bmm(q, keys.transpose(1, 2))  # [KV, group * n, L]
    # Cast only where needed: a cast to the dtype a tensor has is still a dispatched op.
    if scores.dtype != torch.float32:
        scores = scores.float()  # softmax in float32
    if bias is not None:
        (scores if rows == n else scores.view(kv_heads, -1, *bias.shape)).add_(bias)
    weights = torch.softmax(scores, -1)
    return torch.bmm(weights if weights.dtype == values.dtype else weights.to(values.dtype), values)


class _Padded(NamedTuple):
    """A step's rows laid out for one attention over every slot of the pool."""

    slots: int
    slot_tokens: int
    longest_n: int  # new positions of the longest session: each slot's padded rows
    keys: int  # positions of the longest cache after this step: the keys attended over
    flat: torch.Tensor  # [rows]: each row's index among the slots * longest_n padded rows
    masked: torch.Tensor  # [slots, longest_n, keys] bool: keys a padded row must not see


class _Session(NamedTuple):
    """Where one segment's rows, keys and mask are, computed once a forward."""

    first_row: int
    rows: int
    keys_from: int  # pool position of its first key any of its queries sees
    keys: int
    bias: torch.Tensor | None


class BatchedForward:
    def __init__(self, description: Description, pack: bool | None = None) -> None:
        """pack: multiply by oneDNN-packed weights (None: where the width and device call for
        it, PACK_MIN_WIDTH). Packing keeps a second copy of every weight matrix. The weights
        are read on the first forward: a model trained after that needs a new BatchedForward."""
        self.d = description
        self.heads, self.kv_heads, self.head_dim = description.heads, description.kv_heads, description.head_dim
        self.group = self.heads // self.kv_heads  # query heads per kv head
        self.shape = [description.width]  # the norms' normalized shape, a list made once
        embed = description.embed
        self.device, self.dtype = embed.device, embed.dtype
        packable = can_pack(self.device, self.dtype)
        if pack and not packable:
            raise ValueError(f"cannot pack {self.dtype} weights on {self.device} with this torch")
        self.pack = packable and description.width >= PACK_MIN_WIDTH if pack is None else pack
        # A norm is called as norm(x, *args), args a tuple made once (no Python frame of ours
        # in between: a draft's step pays for each).
        self._norm = torch.layer_norm if description.family == "gpt2" else torch.rms_norm
        self._gelu = description.mlp == "gelu_tanh"
        # What the forward multiplies by, made by prepare: the blocks' weights, the head and
        # the functions that multiply (the second for GPT-2's MLP input, with its activation).
        self._layers: list[Layer] | None = None
        self._final_norm = self._norm_args(description.final_norm)
        self._head: torch.Tensor | None = None
        self._inv_freq: torch.Tensor | None = None
        self._causal: torch.Tensor | None = None  # -inf above the diagonal; _bias hands out views of it
        self._linear: Linear = _linear
        self._linear_gelu: Linear = _linear_gelu

    def prepare(self) -> None:
        """The matrices the forward multiplies by: each block's with the attention's scale in
        its query weights, all of them packed where self.pack says, and the head.

        Run on the first forward, not in __init__: oneDNN's reorder and the copies of larger
        matrices run in OpenMP regions, and once the loading thread has run one, the engine
        thread's own OpenMP workers stop spinning between regions (libgomp throttles them
        when it manages more threads than there are cores) and each step pays their
        wake-ups: the committed target stepped in 2.8 ms on the thread that ran the first
        region, 5.1 ms on another thread after it."""
        queries = self.heads * self.head_dim
        scale = self.head_dim**-0.5
        layers = []
        for layer in self.d.layers:
            # The scale in the query weights: no forward multiplies the scores by it, which
            # on a draft's step (a Python float wrapped into a tensor and cast) cost a matmul.
            qkv_w = layer.qkv_w.clone()
            qkv_w[:, :queries].mul_(scale)
            qkv_b = None if layer.qkv_b is None else layer.qkv_b.clone()
            if qkv_b is not None:
                qkv_b[:queries].mul_(scale)
            layer = replace(
                layer, qkv_w=qkv_w, qkv_b=qkv_b, norm1=self._norm_args(layer.norm1), norm2=self._norm_args(layer.norm2)
            )
            if self.pack:
                layer = replace(
                    layer, qkv_w=_packed(layer.qkv_w), o_w=_packed(layer.o_w), up_w=_packed(layer.up_w),
                    down_w=_packed(layer.down_w),
                )  # fmt: skip
            layers.append(layer)
        head = self.d.head
        if all(b is not None for layer in layers for b in (layer.qkv_b, layer.o_b, layer.up_b, layer.down_b)):
            # torch.addmm itself, not our wrapper's Python frame around it (GPT-2: all biases)
            self._linear = torch.addmm
        if self.pack:
            self._head, self._linear, self._linear_gelu = _packed(head.t()), _packed_linear, _packed_linear_gelu
        elif self.device.type == "cpu":
            # At batch 1 on a CPU, gemm reads a contiguous [C, V] copy faster than the
            # transposed view (the committed draft's head on one thread: 72 -> 46 us warm,
            # 113 -> 86 us right after a target step).
            self._head = head.t().contiguous()
        else:
            self._head = head.t()
        if self.d.rope is not None:
            self._inv_freq = self.d.rope.inv_freq.to(self.device)
        self._layers = layers

    def forward(self, segments: Sequence[Segment], layer_kv: list[torch.Tensor], slot_tokens: int = 0) -> torch.Tensor:
        """Logits [rows, V] of every segment's ids, segment after segment; writes their keys
        and values into the pool layers layer_kv ([2, KV, tokens, D] each) at their slots.
        slot_tokens: the pool's slot size when every session holds a slot (0: none)."""
        if self._layers is None:
            self.prepare()
        if len(segments) == 1 and len(segments[0].ids) == 1:
            x = self._step(segments[0], layer_kv)
        else:
            x = self._rows(segments, layer_kv, self._padded_plan(segments, layer_kv, slot_tokens))
        x = self._norm(x, *self._final_norm)
        return _packed_linear(None, x, self._head) if self.pack else torch.mm(x, self._head)

    def _norm_args(self, norm: tuple[torch.Tensor, torch.Tensor | None]) -> tuple:
        """The arguments after x of torch.layer_norm (GPT-2) or torch.rms_norm (Llama)."""
        weight, bias = norm
        return (self.shape, weight, bias, self.d.eps) if self.d.family == "gpt2" else (self.shape, weight, self.d.eps)

    def _rotary(self, freqs: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """cos and signed sin [rows, D] of the rotary embedding from its angles [rows, D/2]:
        q rotates to q * cos + roll(q, D/2) * sin, the roll making rotate_half's (x2, x1) and
        the sign of its -x2 folded into sin's first half."""
        cos, sin = freqs.cos(), freqs.sin()
        cos, sin = torch.cat((cos, cos), -1), torch.cat((-sin, sin), -1)
        if self.d.rope.attention_scaling != 1.0:
            cos, sin = cos * self.d.rope.attention_scaling, sin * self.d.rope.attention_scaling
        if cos.dtype != self.dtype:
            cos, sin = cos.to(self.dtype), sin.to(self.dtype)
        return cos, sin

    def _rotate(self, qk: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> None:
        """Applies the rotary embedding in place to queries and keys qk [..., rows, D]."""
        rolled = qk.roll(self.head_dim // 2, -1)
        qk.mul_(cos).addcmul_(rolled, sin)

    def _split_qkv(self, qkv: torch.Tensor, rows: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """The projection's output [rows, (H + 2 KV) * D] seen head-major: queries [H, rows, D],
        new keys and values [2, KV, rows, D], and the rotary embedding's part, queries and
        keys [H + KV, rows, D] or [2, H, rows, D]. Views only, the fewest for a model without
        GQA (each view is a dispatched op, and a draft's forward is mostly such costs)."""
        heads, kv_heads, dim = self.heads, self.kv_heads, self.head_dim
        if heads == kv_heads:
            qkv = qkv.view(rows, 3, heads, dim).permute(1, 2, 0, 3)  # [3, H, rows, D]
            return qkv[0], qkv[1:], qkv[:2]  # the last: queries and keys, for the rotary embedding
        qkv = qkv.view(rows, heads + 2 * kv_heads, dim).transpose(0, 1)  # [H + 2 KV, rows, D]
        return qkv[:heads], qkv[heads:].view(2, kv_heads, rows, dim), qkv[: heads + kv_heads]

    def _step(self, segment: Segment, layer_kv: list[torch.Tensor]) -> torch.Tensor:
        """The blocks over one position of one session, [1, C]: a decode step, where a small
        draft's time is mostly per-operation costs, so each one left out shows."""
        heads, kv_heads, group, dim = self.heads, self.kv_heads, self.group, self.head_dim
        token, start = int(segment.ids[0]), segment.start
        slot = segment.offset + start
        window = self.d.sliding_window
        keys_from = segment.offset + (0 if window is None else max(0, start - window + 1))
        # Rows by narrow, not by an index tensor: making that tensor from a Python int cost a
        # warm step of the committed draft 12 us, 6%.
        x = self.d.embed.narrow(0, token, 1)
        if self.d.positions is not None:
            x = x + self.d.positions.narrow(0, start, 1)
        # The angles by a multiplication, not from a position tensor (as the embedding's narrow).
        rotary = self._rotary((self._inv_freq * start)[None]) if self._inv_freq is not None else None
        linear, norm = self._linear, self._norm
        for layer, kv in zip(self._layers, layer_kv):
            qkv = linear(layer.qkv_b, norm(x, *layer.norm1), layer.qkv_w)
            # One position: every layout is a view, the grouped queries [KV, group, D] too.
            if group == 1:
                qkv = qkv.view(3, heads, 1, dim)
                q, new_kv = qkv[0], qkv[1:]
            else:
                qkv = qkv.view(heads + 2 * kv_heads, 1, dim)
                q, new_kv = qkv[:heads].view(kv_heads, group, dim), qkv[heads:].view(2, kv_heads, 1, dim)
            if rotary is not None:
                self._rotate(qkv[:2] if group == 1 else qkv[: heads + kv_heads], *rotary)
            kv.narrow(2, slot, 1).copy_(new_kv)
            keys, values = kv.narrow(2, keys_from, slot + 1 - keys_from)
            x = self._rest_of_block(x, attend(q, keys, values, None).view(1, heads * dim), layer)
        return x

    def _bias(self, n: int, keys: int, window: int | None) -> torch.Tensor | None:
        """attention_bias(n, keys, window), as a view of one causal mask made once where no
        key falls out of the window: building a small mask costs a verify forward of the
        committed target several percent (a fill in an OpenMP region, on every forward)."""
        if n == 1 or (window is not None and keys - 1 - window >= 0):
            return attention_bias(n, keys, window, self.dtype, self.device)
        if self._causal is None or self._causal.shape[0] < keys:
            size = max(keys, 2 * (0 if self._causal is None else self._causal.shape[0]), 256)
            self._causal = torch.full((size, size), float("-inf"), dtype=self.dtype, device=self.device).triu_(1)
        first = keys - n
        return self._causal[first : first + n, :keys]

    def _padded_plan(
        self, segments: Sequence[Segment], layer_kv: list[torch.Tensor], slot_tokens: int
    ) -> _Padded | None:
        """Where a step's rows go in one padded attention over every slot of the pool, or None
        where the loop over sessions is the better choice: no slots, a sliding window, a
        prompt chunk among the rows (its padding would cost more than the loop), or a step
        that fills less than half the slots."""
        tokens = layer_kv[0].shape[2]
        if not slot_tokens or tokens % slot_tokens or self.d.sliding_window is not None or len(segments) < 2:
            return None
        slots = tokens // slot_tokens
        longest_n = max(len(s.ids) for s in segments)
        if 2 * len(segments) < slots or longest_n > MATMUL_ATTENTION_MAX_POSITIONS:
            return None
        if any(s.offset % slot_tokens for s in segments):
            return None
        keys = max(s.start + len(s.ids) for s in segments)
        flat, query_position = [], torch.full((slots, longest_n), 0, dtype=torch.long)
        for s in segments:
            slot, n = s.offset // slot_tokens, len(s.ids)
            flat += range(slot * longest_n, slot * longest_n + n)
            query_position[slot, :n] = torch.arange(s.start, s.start + n)
        # Masked: keys after a query's position (its own session's future, and past its
        # length). A padded row sees key 0 only, so that its softmax stays finite.
        masked = torch.arange(keys)[None, None, :] > query_position[:, :, None]
        return _Padded(
            slots, slot_tokens, longest_n, keys,
            torch.tensor(flat, dtype=torch.long, device=self.device), masked.to(self.device),
        )  # fmt: skip

    def _attend_padded(self, q: torch.Tensor, kv: torch.Tensor, plan: _Padded) -> torch.Tensor:
        """Every session's attention in one computation over all slots: q [H, rows, D] ->
        [H, rows, D]. Keys and values are a view of the pool, [KV * slots, keys, D]."""
        kv_heads, group, dim, n, slots = self.kv_heads, self.group, self.head_dim, plan.longest_n, plan.slots
        padded = q.new_zeros(self.heads, slots * n, dim).index_copy_(1, plan.flat, q)
        if group > 1:  # [H, slots*n, D] -> [KV * slots, group * n, D]
            padded = (
                padded.view(kv_heads, group, slots, n, dim).transpose(1, 2).reshape(kv_heads * slots, group * n, dim)
            )
        else:
            padded = padded.view(kv_heads * slots, n, dim)
        keys, values = (
            half.view(kv_heads, slots, plan.slot_tokens, dim)[:, :, : plan.keys].reshape(
                kv_heads * slots, plan.keys, dim
            )
            for half in kv
        )
        scores = torch.bmm(padded, keys.transpose(1, 2))
        if scores.dtype != torch.float32:
            scores = scores.float()
        scores.view(kv_heads, slots, group, n, plan.keys).masked_fill_(plan.masked[None, :, None], float("-inf"))
        weights = torch.softmax(scores, -1)
        out = torch.bmm(weights if weights.dtype == values.dtype else weights.to(values.dtype), values)
        if group > 1:  # back to [H, slots*n, D]
            out = out.view(kv_heads, slots, group, n, dim).transpose(1, 2).reshape(self.heads, slots * n, dim)
        else:
            out = out.view(self.heads, slots * n, dim)
        return out.index_select(1, plan.flat)

    def _rows(
        self, segments: Sequence[Segment], layer_kv: list[torch.Tensor], padded: _Padded | None = None
    ) -> torch.Tensor:
        """The blocks over the rows of every segment, [rows, C]: prefills, verifies, batches;
        attention padded over the pool's slots where `padded` says how, else a loop."""
        heads, dim = self.heads, self.head_dim
        window = self.d.sliding_window
        sessions, first_row = [], 0
        for segment in segments:
            n = len(segment.ids)
            keys_from = 0 if window is None else max(0, segment.start - window + 1)
            keys = segment.start + n - keys_from
            bias = self._bias(n, keys, window)
            sessions.append(_Session(first_row, n, segment.offset + keys_from, keys, bias))
            first_row += n
        rows = first_row
        single = len(segments) == 1
        if single:
            ids = segments[0].ids
            start = segments[0].start
            slot = segments[0].offset + start
            position_index = None if self._inv_freq is None else torch.arange(start, start + rows, device=self.device)
        else:
            ids = [i for segment in segments for i in segment.ids]
            positions = [p for segment in segments for p in range(segment.start, segment.start + len(segment.ids))]
            position_index = torch.tensor(positions, dtype=torch.long, device=self.device)
            offsets = [segment.offset for segment in segments for _ in segment.ids]
            slots = torch.tensor([o + p for o, p in zip(offsets, positions)], dtype=torch.long, device=self.device)
        x = torch.index_select(self.d.embed, 0, torch.tensor(list(ids), dtype=torch.long, device=self.device))
        if self.d.positions is not None:
            x = x.add_(self.d.positions[start : start + rows] if single else self.d.positions[position_index])
        rotary = None
        if self._inv_freq is not None:
            rotary = self._rotary(position_index.to(torch.float32)[:, None] * self._inv_freq)
        linear, norm = self._linear, self._norm
        for layer, kv in zip(self._layers, layer_kv):
            q, new_kv, qk = self._split_qkv(linear(layer.qkv_b, norm(x, *layer.norm1), layer.qkv_w), rows)
            if rotary is not None:
                self._rotate(qk, *rotary)
            if single:
                kv.narrow(2, slot, rows).copy_(new_kv)
                attended = self._attend_session(q, kv, sessions[0])
            else:
                kv.index_copy_(2, slots, new_kv)  # every session's new keys and values at once
                if padded is not None:
                    attended = self._attend_padded(q, kv, padded)
                else:
                    attended = torch.cat([self._attend_session(q, kv, session) for session in sessions], 1)
            x = self._rest_of_block(x, attended.transpose(0, 1).reshape(rows, heads * dim), layer)
        return x

    def _attend_session(self, q: torch.Tensor, kv: torch.Tensor, session: _Session) -> torch.Tensor:
        """One session's attention over its own keys in the pool: q [H, rows, D] of the whole
        batch -> its rows' output [H, n, D]."""
        n = session.rows
        if n != q.shape[1]:
            q = q.narrow(1, session.first_row, n)
        if self.group > 1:  # [H, n, D] -> [KV, group * n, D]: each kv head's queries in a row
            q = q.reshape(self.kv_heads, self.group * n, self.head_dim)
        keys, values = kv.narrow(2, session.keys_from, session.keys)
        attended = attend(q, keys, values, session.bias)
        return attended.view(self.heads, n, self.head_dim) if self.group > 1 else attended

    def _rest_of_block(self, x: torch.Tensor, attended: torch.Tensor, layer: Layer) -> torch.Tensor:
        """x [n, C] plus the projection of its attention's output attended [n, H * D], then plus
        the MLP of that: a block after its attention."""
        linear = self._linear
        x = linear(layer.o_b, attended, layer.o_w).add_(x)
        h = self._norm(x, *layer.norm2)
        if self._gelu:
            inner = self._linear_gelu(layer.up_b, h, layer.up_w)
        else:
            gate, up = linear(layer.up_b, h, layer.up_w).chunk(2, -1)
            inner = F.silu(gate).mul_(up)
        return linear(layer.down_b, inner, layer.down_w).add_(x)
