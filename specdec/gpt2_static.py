"""A lean forward for GPT-2-architecture models over a preallocated ("static") KV cache.

transformers' generic forward spends about half a millisecond per step on Python
bookkeeping (module hooks, mask construction, cache objects, output dataclasses), which
for a small draft model is most of its step. This module runs the same weights with the
same math in a handful of tensor ops per layer, writing keys and values in place into a
cache allocated once per session, so a rollback is just a length change. Its logits
match transformers' to float32 rounding (tests/test_runtime.py checks it).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace

import torch
import torch.nn.functional as F
from transformers import GPT2LMHeadModel, PreTrainedModel

# bias [out], x [n, in], weight -> bias + x times weight [n, out], as torch.addmm
Linear = Callable[[torch.Tensor | None, torch.Tensor, torch.Tensor], torch.Tensor]


# Up to this many new positions on a CPU, attention runs as two batched matmuls around a
# softmax: at decode and verify sizes that is 1.3-1.8x faster there than
# scaled_dot_product_attention, whose per-call overhead is a large part of a small model's
# step. Longer forwards (prefills), and other devices, keep SDPA, which does not hold the
# [heads, n, context] scores in memory at once.
MATMUL_ATTENTION_MAX_POSITIONS = 64


# From this width on, a float32 model on a CPU multiplies by weights that oneDNN reordered
# once into its blocked layout: at the few rows of a decode step or a verify that is 2-4x
# faster per matmul than addmm, whose gemm repacks the weights on every call (the committed
# 384-wide target: a step 4.8 -> 3.3 ms, a 9-position verify 7.4 -> 4.5 ms). Below it the
# packed call's own overhead wins (the 96-wide draft: 0.45 -> 0.62 ms a step).
PACK_MIN_WIDTH = 256


def can_pack(device: torch.device, dtype: torch.dtype) -> bool:
    """Whether this torch has oneDNN's prepacked linear for weights of this device and dtype."""
    return (
        device.type == "cpu" and dtype == torch.float32 and torch.backends.mkldnn.is_available()
        and hasattr(torch.ops.mkldnn, "_reorder_linear_weight") and hasattr(torch.ops.mkldnn, "_linear_pointwise")
    )  # fmt: skip


def _packed(weight: torch.Tensor) -> torch.Tensor:
    """weight [out, in] (nn.Linear's layout) reordered for oneDNN; 9 rows is the batch it is
    tuned for (a verify of 8 draft tokens), any number of rows still works."""
    return torch.ops.mkldnn._reorder_linear_weight(weight.contiguous(), 9)


def _packed_addmm(bias: torch.Tensor | None, x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """bias plus x [n, in] times a weight from _packed, in torch.addmm's argument order, so
    that the unpacked path calls torch.addmm itself (GPT-2 stores weights [in, out])."""
    return torch.ops.mkldnn._linear_pointwise(x, weight, bias, "none", [], "")


def _addmm_gelu(bias: torch.Tensor, x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """GPT-2's MLP activation (gelu, tanh form) of torch.addmm(bias, x, weight)."""
    return F.gelu(torch.addmm(bias, x, weight), approximate="tanh")


def _packed_addmm_gelu(bias: torch.Tensor, x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """_addmm_gelu with a weight from _packed, the gelu applied inside oneDNN's matmul: on a
    9-position verify of the committed target that saved 14 us of a 59 us MLP input
    projection (the separate gelu's pass over [9, 1536]), 1 us on a single position."""
    return torch.ops.mkldnn._linear_pointwise(x, weight, bias, "gelu", [], "tanh")


def causal_bias(n: int, start: int, dtype: torch.dtype, device: torch.device) -> torch.Tensor | None:
    """[n, start+n] added to the attention scores: -inf where query i (position start+i) must
    not look, the positions after start+i, and 0 elsewhere. None for a single query, which
    sees every cached position. Built once a forward, in the form both attention paths take."""
    if n == 1:
        return None
    return torch.full((n, start + n), float("-inf"), dtype=dtype, device=device).triu_(start + 1)


def attend(q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """Causal attention of n queries over the keys and values of every position up to the
    last query's: q [H, n, D] already scaled by 1/sqrt(D), keys and values [H, end, D], bias
    from causal_bias -> [H, n, D]."""
    if q.device.type != "cpu" or q.shape[1] > MATMUL_ATTENTION_MAX_POSITIONS:
        return F.scaled_dot_product_attention(q, keys, values, attn_mask=bias, scale=1.0)
    scores = torch.bmm(q, keys.transpose(1, 2))  # [H, n, end]
    # Cast only where needed: a cast to the dtype a tensor has is still a dispatched op.
    if scores.dtype != torch.float32:
        scores = scores.float()  # softmax in float32
    if bias is not None:
        scores.add_(bias)
    weights = torch.softmax(scores, -1)
    return torch.bmm(weights if weights.dtype == values.dtype else weights.to(values.dtype), values)


def supports(model: PreTrainedModel) -> str | None:
    """None when the model can run here, else why not."""
    if not isinstance(model, GPT2LMHeadModel):
        return f"architecture {type(model).__name__} is not GPT-2"
    config = model.config
    checks = {
        "activation_function is not gelu_new": config.activation_function != "gelu_new",
        "scale_attn_weights is off": not config.scale_attn_weights,
        "scale_attn_by_inverse_layer_idx is on": config.scale_attn_by_inverse_layer_idx,
        "reorder_and_upcast_attn is on": config.reorder_and_upcast_attn,
        "cross-attention is on": config.add_cross_attention,
    }
    failed = [why for why, bad in checks.items() if bad]
    return "; ".join(failed) or None


@dataclass
class _Layer:
    ln1: tuple[torch.Tensor, torch.Tensor]
    attn_w: torch.Tensor  # [C, 3C]; as prepared for the forward, the query's columns scaled by 1/sqrt(head_dim)
    attn_b: torch.Tensor  # [3C]; likewise
    proj_w: torch.Tensor  # [C, C]
    proj_b: torch.Tensor
    ln2: tuple[torch.Tensor, torch.Tensor]
    fc_w: torch.Tensor  # [C, 4C]
    fc_b: torch.Tensor
    out_w: torch.Tensor  # [4C, C]
    out_b: torch.Tensor


def _query_scaled(weight: torch.Tensor, bias: torch.Tensor, scale: float) -> tuple[torch.Tensor, torch.Tensor]:
    """Copies of c_attn's weight [C, 3C] and bias [3C] whose query part (the first C outputs)
    is multiplied by the attention's scale, so that no forward multiplies the scores by it:
    on a draft's step that multiplication (a Python float wrapped into a tensor and cast)
    cost as much as a matmul."""
    width = weight.shape[0]
    weight, bias = weight.clone(), bias.clone()
    weight[:, :width].mul_(scale)
    bias[:width].mul_(scale)
    return weight, bias


class StaticCache:
    """Keys and values of one session, [layers, 2, heads, capacity, head_dim]: a layer's
    keys (index 0) and values (index 1) side by side, so that one copy writes both."""

    def __init__(self, layers: int, heads: int, capacity: int, head_dim: int, dtype: torch.dtype, device: torch.device):
        self.kv = torch.zeros(layers, 2, heads, capacity, head_dim, dtype=dtype, device=device)
        self.capacity = capacity
        # Each layer's [2, heads, capacity, head_dim] view, made once: indexing the buffer
        # with a tuple in every layer of every step costs more than the single-token
        # attention itself on a small model.
        self.layer_kv = list(self.kv.unbind(0))

    def nbytes(self) -> int:
        return self.kv.nbytes


class StaticGPT2:
    def __init__(self, model: GPT2LMHeadModel, pack: bool | None = None) -> None:
        """pack: multiply by oneDNN-packed weights (None: where the width and device call for
        it, PACK_MIN_WIDTH). Packing keeps a second copy of every weight matrix. The
        weights are read on the first forward: a model trained after that needs a new
        StaticGPT2."""
        config = model.config
        t = model.transformer
        self.heads = config.n_head
        self.width = config.n_embd
        self.shape = [self.width]  # layer_norm's normalized shape, a list made once
        self.head_dim = self.width // self.heads
        self.eps = config.layer_norm_epsilon
        # Detached weights: no forward here records an autograd graph, so none needs a grad
        # mode around it, which on every call cost a single-token step of the draft 6%.
        self.wte = t.wte.weight.detach()
        self.wpe = t.wpe.weight.detach()
        self.lm_head = model.lm_head.weight.detach()  # [V, C], tied to wte in GPT-2
        self.ln_f = (t.ln_f.weight.detach(), t.ln_f.bias.detach())
        self._stored = [  # each block's weights as the model stores them
            _Layer(
                ln1=(block.ln_1.weight.detach(), block.ln_1.bias.detach()),
                attn_w=block.attn.c_attn.weight.detach(),
                attn_b=block.attn.c_attn.bias.detach(),
                proj_w=block.attn.c_proj.weight.detach(),
                proj_b=block.attn.c_proj.bias.detach(),
                ln2=(block.ln_2.weight.detach(), block.ln_2.bias.detach()),
                fc_w=block.mlp.c_fc.weight.detach(),
                fc_b=block.mlp.c_fc.bias.detach(),
                out_w=block.mlp.c_proj.weight.detach(),
                out_b=block.mlp.c_proj.bias.detach(),
            )
            for block in t.h
        ]
        packable = can_pack(self.wte.device, self.wte.dtype)
        if pack and not packable:
            raise ValueError(f"cannot pack {self.wte.dtype} weights on {self.wte.device} with this torch")
        self.pack = packable and self.width >= PACK_MIN_WIDTH if pack is None else pack
        # What the forward multiplies by, made by _prepare: the blocks' weights, the head
        # ([C, V] or packed) and the functions that multiply (the second for the MLP's input,
        # with its activation).
        self._layers: list[_Layer] | None = None
        self._head: torch.Tensor | None = None
        self._linear: Linear = torch.addmm
        self._linear_gelu: Linear = _addmm_gelu

    def _prepare(self) -> None:
        """The matrices the forward multiplies by: each block's with the attention's scale in
        its query weights, all of them packed where self.pack says, and the head.

        Made on the first forward, not in __init__: oneDNN's reorder and the copies of larger
        matrices run in OpenMP regions, and once the loading thread has run one, the engine
        thread's own OpenMP workers stop spinning between regions (libgomp throttles them
        when it manages more threads than there are cores) and each step pays their
        wake-ups: the committed target stepped in 2.8 ms on the thread that ran the first
        region, 5.1 ms on another thread after it."""
        scale = 1.0 / math.sqrt(self.head_dim)
        layers = []
        for layer in self._stored:
            attn_w, attn_b = _query_scaled(layer.attn_w, layer.attn_b, scale)
            layer = replace(layer, attn_w=attn_w, attn_b=attn_b)
            if self.pack:
                layer = replace(
                    layer, attn_w=_packed(layer.attn_w.T), proj_w=_packed(layer.proj_w.T), fc_w=_packed(layer.fc_w.T), out_w=_packed(layer.out_w.T)
                )  # fmt: skip
            layers.append(layer)
        if self.pack:
            self._head, self._linear, self._linear_gelu = _packed(self.lm_head), _packed_addmm, _packed_addmm_gelu
        elif self.lm_head.device.type == "cpu":
            # At batch 1 on a CPU, gemm reads a contiguous [C, V] copy faster than the
            # transposed view (the committed draft's head on one thread: 72 -> 46 us warm,
            # 113 -> 86 us right after a target step).
            self._head = self.lm_head.t().contiguous()
        else:
            self._head = self.lm_head.t()
        self._layers = layers

    def new_cache(self, capacity: int) -> StaticCache:
        return StaticCache(len(self._stored), self.heads, capacity, self.head_dim, self.wte.dtype, self.wte.device)

    def forward(self, cache: StaticCache, start: int, ids: Sequence[int]) -> torch.Tensor:
        """Logits [n, V] of the n token ids at positions start..start+n-1; writes their keys
        and values into the cache at those positions."""
        n = len(ids)
        if start + n > cache.capacity:
            raise ValueError(f"{start + n} positions exceed the session's cache of {cache.capacity}")
        if self._layers is None:
            self._prepare()
        layers, linear = self._layers, self._linear
        if n == 1:
            # Rows by narrow, not by an index tensor: making that tensor from a Python int
            # cost a warm step of the committed draft 12 us, 6%.
            x = self._step(self.wte.narrow(0, int(ids[0]), 1) + self.wpe.narrow(0, start, 1), layers, linear, cache, start)
        else:
            index = torch.tensor(list(ids), dtype=torch.long, device=self.wte.device)
            x = self._positions(torch.index_select(self.wte, 0, index).add_(self.wpe[start : start + n]), layers, linear, cache, start)
        x = torch.layer_norm(x, self.shape, *self.ln_f, self.eps)
        return linear(None, x, self._head) if self.pack else torch.mm(x, self._head)

    def _step(self, x: torch.Tensor, layers: list[_Layer], linear: Linear, cache: StaticCache, start: int) -> torch.Tensor:
        """The blocks over one position, x [1, C] -> [1, C]. Its q, k, v and attention output
        are plain views where several positions need permutes and reshapes: a small draft's
        step is mostly per-operation costs, so each one left out shows."""
        for layer, kv in zip(layers, cache.layer_kv):
            h = torch.layer_norm(x, self.shape, *layer.ln1, self.eps)
            qkv = linear(layer.attn_b, h, layer.attn_w).view(3, self.heads, 1, self.head_dim)  # q, k, v: [H, 1, D] each
            kv.narrow(2, start, 1).copy_(qkv[1:])
            keys, values = kv.narrow(2, 0, start + 1)  # [H, start+1, D] each
            x = self._rest_of_block(x, attend(qkv[0], keys, values, None).view(1, self.width), layer, linear)
        return x

    def _positions(self, x: torch.Tensor, layers: list[_Layer], linear: Linear, cache: StaticCache, start: int) -> torch.Tensor:
        """The blocks over n positions, x [n, C] -> [n, C]: a prefill or a verify."""
        n = x.shape[0]
        bias = causal_bias(n, start, x.dtype, x.device)
        for layer, kv in zip(layers, cache.layer_kv):
            h = torch.layer_norm(x, self.shape, *layer.ln1, self.eps)
            qkv = linear(layer.attn_b, h, layer.attn_w).view(n, 3, self.heads, self.head_dim).permute(1, 2, 0, 3)  # [3, H, n, D]
            kv.narrow(2, start, n).copy_(qkv[1:])
            keys, values = kv.narrow(2, 0, start + n)  # [H, start+n, D] each
            attended = attend(qkv[0], keys, values, bias).transpose(0, 1).reshape(n, self.width)
            x = self._rest_of_block(x, attended, layer, linear)
        return x

    def _rest_of_block(self, x: torch.Tensor, attended: torch.Tensor, layer: _Layer, linear: Linear) -> torch.Tensor:
        """x [n, C] plus the projection of its attention's output attended [n, C], then plus
        the MLP of that: a block after its attention."""
        x = linear(layer.proj_b, attended, layer.proj_w).add_(x)
        h = torch.layer_norm(x, self.shape, *layer.ln2, self.eps)
        return linear(layer.out_b, self._linear_gelu(layer.fc_b, h, layer.fc_w), layer.out_w).add_(x)
