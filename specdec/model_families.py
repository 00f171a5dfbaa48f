"""Turns a transformers causal LM into the one description the batched forward runs.

Two families: GPT-2 (LayerNorm with bias, learned positions, fused qkv with bias, gelu tanh
MLP) and Llama (RMSNorm, rotary positions, separate q/k/v that are fused here, SwiGLU MLP),
the latter also covering Qwen2 (q/k/v biases) and Mistral (sliding window). `supports`
names whatever a model has that the batched forward does not do; such a model runs on
transformers' own forward instead.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from transformers import (
    GPT2LMHeadModel,
    LlamaForCausalLM,
    MistralForCausalLM,
    PreTrainedModel,
    Qwen2ForCausalLM,
)
from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

LLAMA_FAMILY = (LlamaForCausalLM, Qwen2ForCausalLM, MistralForCausalLM)
# Rope types whose frequencies do not depend on the sequence length (transformers' own init
# functions compute them); "default" is the plain one.
STATIC_ROPE_TYPES = ("default", "linear", "llama3")


@dataclass
class Layer:
    """One block's weights; matrices are [in, out] (as torch.addmm multiplies), views allowed."""

    norm1: tuple[torch.Tensor, torch.Tensor | None]  # weight, bias (None: RMSNorm)
    qkv_w: torch.Tensor  # [C, (H + 2 KV) * D]: queries, keys, values
    qkv_b: torch.Tensor | None
    o_w: torch.Tensor  # [H * D, C]
    o_b: torch.Tensor | None
    norm2: tuple[torch.Tensor, torch.Tensor | None]
    up_w: torch.Tensor  # [C, I] (GPT-2) or [C, 2I]: SwiGLU's gate then up
    up_b: torch.Tensor | None
    down_w: torch.Tensor  # [I, C]
    down_b: torch.Tensor | None


@dataclass
class Rope:
    inv_freq: torch.Tensor  # [D / 2], float32
    attention_scaling: float  # multiplies cos and sin


@dataclass
class Description:
    """A decoder-only transformer as the batched forward runs it."""

    family: str  # "gpt2" or "llama"
    width: int
    heads: int
    kv_heads: int
    head_dim: int
    eps: float
    mlp: str  # "gelu_tanh" or "swiglu"
    embed: torch.Tensor  # [V, C]
    positions: torch.Tensor | None  # learned position embeddings [P, C] (GPT-2)
    rope: Rope | None
    sliding_window: int | None  # a query sees this many positions, itself included
    layers: list[Layer]
    final_norm: tuple[torch.Tensor, torch.Tensor | None]
    head: torch.Tensor  # [V, C]


def supports(model: PreTrainedModel) -> str | None:
    """None when the batched forward can run the model, else what it cannot do."""
    if isinstance(model, GPT2LMHeadModel):
        config = model.config
        checks = {
            f"activation_function {config.activation_function} is not gelu_new": (
                config.activation_function != "gelu_new"
            ),
            "scale_attn_weights is off": not config.scale_attn_weights,
            "scale_attn_by_inverse_layer_idx is on": config.scale_attn_by_inverse_layer_idx,
            "reorder_and_upcast_attn is on": config.reorder_and_upcast_attn,
            "cross-attention is on": config.add_cross_attention,
        }
    elif type(model) in LLAMA_FAMILY:
        config = model.config
        rope = config.rope_parameters or {}
        rope_type = rope.get("rope_type", "default")
        layer_types = set(getattr(config, "layer_types", None) or [])
        checks = {
            f"hidden_act {config.hidden_act} is not silu": config.hidden_act != "silu",
            f"rope_type {rope_type} is not one of {STATIC_ROPE_TYPES}": rope_type not in STATIC_ROPE_TYPES,
            "partial rotary embeddings": rope.get("partial_rotary_factor", 1.0) != 1.0,
            f"layer_types mix {sorted(layer_types)}": len(layer_types) > 1,
            "the lm_head has a bias": model.lm_head.bias is not None,
        }
    else:
        return f"architecture {type(model).__name__} is neither GPT-2 nor of the Llama family"
    failed = [why for why, bad in checks.items() if bad]
    return "; ".join(failed) or None


def describe(model: PreTrainedModel) -> Description:
    """The model's weights (detached: no forward here records an autograd graph, so none
    needs a grad mode around it, which cost a draft's step 6%) in the common description."""
    if isinstance(model, GPT2LMHeadModel):
        return _gpt2(model)
    return _llama(model)


def _d(tensor: torch.Tensor | None) -> torch.Tensor | None:
    return None if tensor is None else tensor.detach()


def _gpt2(model: GPT2LMHeadModel) -> Description:
    config, t = model.config, model.transformer
    width = config.n_embd
    layers = [  # GPT-2's Conv1D stores weights [in, out] already
        Layer(
            norm1=(_d(b.ln_1.weight), _d(b.ln_1.bias)),
            qkv_w=_d(b.attn.c_attn.weight),
            qkv_b=_d(b.attn.c_attn.bias),
            o_w=_d(b.attn.c_proj.weight),
            o_b=_d(b.attn.c_proj.bias),
            norm2=(_d(b.ln_2.weight), _d(b.ln_2.bias)),
            up_w=_d(b.mlp.c_fc.weight),
            up_b=_d(b.mlp.c_fc.bias),
            down_w=_d(b.mlp.c_proj.weight),
            down_b=_d(b.mlp.c_proj.bias),
        )
        for b in t.h
    ]
    return Description(
        family="gpt2", width=width, heads=config.n_head, kv_heads=config.n_head, head_dim=width // config.n_head,
        eps=config.layer_norm_epsilon, mlp="gelu_tanh", embed=_d(t.wte.weight), positions=_d(t.wpe.weight), rope=None,
        sliding_window=None, layers=layers, final_norm=(_d(t.ln_f.weight), _d(t.ln_f.bias)),
        head=_d(model.lm_head.weight),
    )  # fmt: skip


def _cat_bias(parts: list[torch.Tensor | None], sizes: list[int], like: torch.Tensor) -> torch.Tensor | None:
    """The biases of fused projections, zeros for a part without one; None if none has one."""
    if all(part is None for part in parts):
        return None
    return torch.cat([
        part.detach() if part is not None else like.new_zeros(size) for part, size in zip(parts, sizes)
    ])  # fmt: skip


def _llama(model: PreTrainedModel) -> Description:
    config, m = model.config, model.model
    heads, kv_heads = config.num_attention_heads, config.num_key_value_heads or config.num_attention_heads
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // heads
    rope = config.rope_parameters or {}
    rope_type = rope.get("rope_type", "default")
    init = ROPE_INIT_FUNCTIONS.get(rope_type, type(m.rotary_emb).compute_default_rope_parameters)  # "default" is not in it
    inv_freq, attention_scaling = init(config, device=torch.device("cpu"))
    layers = []
    for block in m.layers:
        attn, mlp = block.self_attn, block.mlp
        projections = (attn.q_proj, attn.k_proj, attn.v_proj)
        layers.append(
            Layer(
                norm1=(_d(block.input_layernorm.weight), None),
                # nn.Linear stores [out, in]: fused along out, then seen as [in, out]
                qkv_w=torch.cat([p.weight.detach() for p in projections]).t(),
                qkv_b=_cat_bias(
                    [p.bias for p in projections], [p.out_features for p in projections], attn.q_proj.weight
                ),
                o_w=_d(attn.o_proj.weight).t(),
                o_b=_d(attn.o_proj.bias),
                norm2=(_d(block.post_attention_layernorm.weight), None),
                up_w=torch.cat([mlp.gate_proj.weight.detach(), mlp.up_proj.weight.detach()]).t(),
                up_b=_cat_bias(
                    [mlp.gate_proj.bias, mlp.up_proj.bias], [mlp.gate_proj.out_features] * 2, mlp.gate_proj.weight
                ),
                down_w=_d(mlp.down_proj.weight).t(),
                down_b=_d(mlp.down_proj.bias),
            )
        )
    layer_types = getattr(config, "layer_types", None) or []
    window = getattr(config, "sliding_window", None)
    if layer_types and layer_types[0] != "sliding_attention":  # Qwen2 names which layers slide
        window = None
    return Description(
        family="llama", width=config.hidden_size, heads=heads, kv_heads=kv_heads, head_dim=head_dim,
        eps=config.rms_norm_eps, mlp="swiglu", embed=_d(m.embed_tokens.weight), positions=None,
        rope=Rope(inv_freq.float(), float(attention_scaling)), sliding_window=window, layers=layers,
        final_norm=(_d(m.norm.weight), None), head=_d(model.lm_head.weight),
    )  # fmt: skip
