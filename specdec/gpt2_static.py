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
from dataclasses import dataclass, replace

import torch
import torch.nn.functional as F
from transformers import GPT2LMHeadModel, PreTrainedModel


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


def _packed_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """x [n, in] times a weight from _packed, plus bias."""
    return torch.ops.mkldnn._linear_pointwise(x, weight, bias, "none", [], "")


def _addmm_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor) -> torch.Tensor:
    """x [n, in] times weight [in, out] (as GPT-2 stores it) plus bias."""
    return torch.addmm(bias, x, weight)


def causal_bias(n: int, start: int, dtype: torch.dtype, device: torch.device) -> torch.Tensor | None:
    """[n, start+n] added to the attention scores: -inf where query i (position start+i) must
    not look, the positions after start+i, and 0 elsewhere. None for a single query, which
    sees every cached position. Built once a forward, in the form both attention paths take."""
    if n == 1:
        return None
    return torch.full((n, start + n), float("-inf"), dtype=dtype, device=device).triu_(start + 1)


def attend(q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, bias: torch.Tensor | None, scale: float) -> torch.Tensor:
    """Causal attention of n queries over the keys and values of every position up to the
    last query's: q [H, n, D], keys and values [H, end, D], bias from causal_bias -> [H, n, D]."""
    if q.device.type != "cpu" or q.shape[1] > MATMUL_ATTENTION_MAX_POSITIONS:
        return F.scaled_dot_product_attention(q, keys, values, attn_mask=bias, scale=scale)
    scores = torch.bmm(q, keys.transpose(1, 2))  # [H, n, end]
    # Cast only where needed: a cast to the dtype a tensor has is still a dispatched op.
    if scores.dtype != torch.float32:
        scores = scores.float()  # softmax in float32
    scores.mul_(scale)
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
    attn_w: torch.Tensor  # [C, 3C]
    attn_b: torch.Tensor  # [3C]
    proj_w: torch.Tensor  # [C, C]
    proj_b: torch.Tensor
    ln2: tuple[torch.Tensor, torch.Tensor]
    fc_w: torch.Tensor  # [C, 4C]
    fc_b: torch.Tensor
    out_w: torch.Tensor  # [4C, C]
    out_b: torch.Tensor


class StaticCache:
    """Keys and values of one session, [layers, heads, capacity, head_dim] each."""

    def __init__(self, layers: int, heads: int, capacity: int, head_dim: int, dtype: torch.dtype, device: torch.device):
        self.keys = torch.zeros(layers, heads, capacity, head_dim, dtype=dtype, device=device)
        self.values = torch.zeros_like(self.keys)
        self.capacity = capacity
        # Each layer's [heads, capacity, head_dim] views, made once: indexing the 4-d buffers
        # with a tuple in every layer of every step costs more than the single-token
        # attention itself on a small model.
        self.layer_keys = list(self.keys.unbind(0))
        self.layer_values = list(self.values.unbind(0))

    def nbytes(self) -> int:
        return self.keys.nbytes + self.values.nbytes


class StaticGPT2:
    def __init__(self, model: GPT2LMHeadModel, pack: bool | None = None) -> None:
        """pack: multiply by oneDNN-packed weights (None: where the width and device call for
        it, PACK_MIN_WIDTH). Packing keeps a second copy of every weight matrix."""
        config = model.config
        t = model.transformer
        self.heads = config.n_head
        self.width = config.n_embd
        self.head_dim = self.width // self.heads
        self.eps = config.layer_norm_epsilon
        # Detached views of the weights (they follow the model's own, in place): no forward
        # here records an autograd graph, so none needs a grad mode around it, which on
        # every call cost a single-token step of the draft 6%.
        self.wte = t.wte.weight.detach()
        self.wpe = t.wpe.weight.detach()
        self.lm_head = model.lm_head.weight.detach()  # [V, C], tied to wte in GPT-2
        self._head_t = self.lm_head.t()  # [C, V], a view
        self.ln_f = (t.ln_f.weight.detach(), t.ln_f.bias.detach())
        self.layers = [
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
        # Packed on the first forward, not here: oneDNN runs the reorder in an OpenMP region,
        # and once the loading thread has run one, the engine thread's own OpenMP workers stop
        # spinning between regions (libgomp throttles them when it manages more threads than
        # there are cores) and each step pays their wake-ups: the committed target stepped in
        # 2.8 ms on the thread that ran the first region, 5.1 ms on another thread after it.
        self._packed_layers: list[_Layer] | None = None  # the layers with their matrices packed
        self._packed_head: torch.Tensor | None = None

    def new_cache(self, capacity: int) -> StaticCache:
        return StaticCache(len(self.layers), self.heads, capacity, self.head_dim, self.wte.dtype, self.wte.device)

    def forward(self, cache: StaticCache, start: int, ids: torch.Tensor) -> torch.Tensor:
        """Logits [n, V] of ids [n] at positions start..start+n-1; writes their keys and
        values into the cache at those positions."""
        n = ids.shape[0]
        end = start + n
        if end > cache.capacity:
            raise ValueError(f"{end} positions exceed the session's cache of {cache.capacity}")
        if self.pack and self._packed_layers is None:
            self._packed_layers = [
                replace(l, attn_w=_packed(l.attn_w.T), proj_w=_packed(l.proj_w.T), fc_w=_packed(l.fc_w.T), out_w=_packed(l.out_w.T))
                for l in self.layers
            ]  # fmt: skip
            self._packed_head = _packed(self.lm_head)
        x = torch.index_select(self.wte, 0, ids).add_(self.wpe[start:end])  # [n, C]
        bias = causal_bias(n, start, x.dtype, x.device)
        scale = 1.0 / math.sqrt(self.head_dim)
        layers, linear = (self._packed_layers, _packed_linear) if self._packed_layers else (self.layers, _addmm_linear)
        # A decode step (one position) takes q, k, v and the attention's output as plain views
        # instead of permutes and reshapes: on a small draft each op is a visible part of a step.
        step = n == 1
        for layer, keys, values in zip(layers, cache.layer_keys, cache.layer_values):
            h = F.layer_norm(x, (self.width,), *layer.ln1, self.eps)
            qkv = linear(h, layer.attn_w, layer.attn_b)  # [n, 3C]
            if step:
                q, k, v = qkv.view(3, self.heads, 1, self.head_dim)  # each [H, 1, D]
            else:
                q, k, v = qkv.view(n, 3, self.heads, self.head_dim).permute(1, 2, 0, 3)  # each [H, n, D]
            keys.narrow(1, start, n).copy_(k)
            values.narrow(1, start, n).copy_(v)
            attended = attend(q, keys.narrow(1, 0, end), values.narrow(1, 0, end), bias, scale)  # [H, n, D]
            attended = attended.view(1, self.width) if step else attended.transpose(0, 1).reshape(n, self.width)
            x = linear(attended, layer.proj_w, layer.proj_b).add_(x)
            h = F.layer_norm(x, (self.width,), *layer.ln2, self.eps)
            h = F.gelu(linear(h, layer.fc_w, layer.fc_b), approximate="tanh")
            x = linear(h, layer.out_w, layer.out_b).add_(x)
        x = F.layer_norm(x, (self.width,), *self.ln_f, self.eps)
        if self._packed_head is not None:
            return _packed_linear(x, self._packed_head, None)
        return torch.mm(x, self._head_t)
