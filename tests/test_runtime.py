"""The model runtime: the batched forward gives transformers' logits for GPT-2, both backends
roll back correctly, and an architecture it does not know runs on transformers' forward
(tests/test_batched_runtime.py covers the Llama family, batches and the KV pool)."""

from __future__ import annotations

import pytest
import torch
from transformers import GPTNeoXConfig, GPTNeoXForCausalLM

from specdec import batched_forward, model_families
from specdec.defaults import DEFAULT_DRAFT, DEFAULT_TARGET
from specdec.runtime import CausalLM, ModelSpec


@pytest.fixture(scope="module", params=[False, True], ids=["addmm", "packed"])
def pair(toy, request) -> dict[str, CausalLM]:
    """The batched forward multiplying by the weights as stored, and by oneDNN-packed ones
    (the toy is narrower than PACK_MIN_WIDTH, so packing is asked for)."""
    models = {backend: CausalLM.load(ModelSpec(str(toy.target), backend=backend)) for backend in ("batched", "transformers")}
    for model in models.values():  # the toy's biases are zeros: make them count, the same in both
        generator = torch.Generator().manual_seed(0)
        for name, parameter in sorted(model.model.named_parameters()):
            if name.endswith(".bias"):
                parameter.data.normal_(0, 0.1, generator=generator)
    batched = models["batched"]
    if request.param and not batched_forward.can_pack(batched.device, batched.dtype):
        pytest.skip("this torch has no oneDNN prepacked linear")
    batched._batched = batched_forward.BatchedForward(model_families.describe(batched.model), pack=request.param)
    return models


def test_auto_picks_the_batched_forward_for_gpt2(toy):
    model = CausalLM.load(ModelSpec(str(toy.target)))
    assert model.backend == "batched" and model.unbatched_reason is None


def test_weights_are_packed_from_the_minimum_width_on():
    narrow = CausalLM.load(ModelSpec(DEFAULT_DRAFT))  # 96 wide
    wide = CausalLM.load(ModelSpec(DEFAULT_TARGET))  # 384 wide
    assert narrow.model.config.n_embd < batched_forward.PACK_MIN_WIDTH <= wide.model.config.n_embd
    assert not narrow._batched.pack
    assert wide._batched.pack == batched_forward.can_pack(wide.device, wide.dtype)
    with pytest.raises(ValueError, match="cannot pack"):
        batched_forward.BatchedForward(model_families.describe(wide.model.to(torch.bfloat16)), pack=True)


def test_batched_forward_matches_transformers_through_steps_and_rollbacks(pair):
    static, generic = pair["batched"], pair["transformers"]
    caches = {name: model.new_cache(300) for name, model in pair.items()}
    ids = [(i * 37) % static.vocab_size for i in range(120)]
    # prefill, single steps, a multi-token verify, a rollback into it, more steps
    plan = [("feed", ids[:60]), ("feed", ids[60:61]), ("feed", ids[61:70]), ("rollback", 63), ("feed", ids[63:64]), ("feed", ids[64:90])]
    for action, arg in plan:
        if action == "rollback":
            for cache in caches.values():
                cache.rollback(arg)
            continue
        a = static.forward(caches["batched"], arg)
        b = generic.forward(caches["transformers"], arg)
        assert torch.allclose(a, b, atol=1e-4, rtol=1e-4), (action, len(arg), (a - b).abs().max())
        assert torch.equal(a.argmax(-1), b.argmax(-1))


def test_batched_forward_records_no_autograd_graph(toy):
    """The lean forward enters no grad mode of its own (a per-call cost on a draft's step),
    so it must read weights that record nothing, whoever calls it and however."""
    model = CausalLM.load(ModelSpec(str(toy.target)))
    assert all(parameter.requires_grad for parameter in model.model.parameters())
    cache = model.new_cache(8)
    logits = model._batched.forward([batched_forward.Segment(cache.offset, 0, [1, 2, 3])], model._pool.layer_kv)
    assert logits.grad_fn is None and not logits.requires_grad
    assert not model._pool.kv.requires_grad


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize(
    "n", [1, 9, batched_forward.MATMUL_ATTENTION_MAX_POSITIONS, batched_forward.MATMUL_ATTENTION_MAX_POSITIONS + 1]
)
def test_attention_is_causal_softmax_attention_on_both_paths(n, dtype):
    # n up to the limit takes the matmul path on a CPU, n beyond it SDPA: both must be the
    # same causal attention, checked against a float64 reference that masks by position.
    heads, dim, start = 3, 16, 37
    generator = torch.Generator().manual_seed(n)
    q, keys, values = (torch.randn(heads, size, dim, generator=generator) for size in (n, start + n, start + n))
    scale = dim**-0.5
    scores = (q.double() @ keys.double().transpose(1, 2)) * scale
    query_positions = torch.arange(start, start + n)[:, None]
    scores[:, torch.arange(start + n)[None, :] > query_positions] = float("-inf")
    expected = torch.softmax(scores, -1) @ values.double()
    bias = batched_forward.attention_bias(n, start + n, None, dtype, q.device)
    got = batched_forward.attend((q * scale).to(dtype), keys.to(dtype), values.to(dtype), bias)
    assert got.dtype == dtype and got.shape == (heads, n, dim)
    tolerance = 1e-5 if dtype == torch.float32 else 3e-2
    assert torch.allclose(got.double(), expected, atol=tolerance, rtol=tolerance), (got.double() - expected).abs().max()


@pytest.mark.parametrize("backend", ["batched", "transformers"])
def test_rollback_then_forward_equals_recompute(pair, backend):
    model = pair[backend]
    ids = list(range(10, 40))
    cache = model.new_cache(64)
    model.forward(cache, ids[:20])
    model.forward(cache, [7, 7, 7, 7])  # a rejected continuation
    cache.rollback(20)
    assert cache.length == 20
    logits = model.forward(cache, ids[20:])
    assert torch.allclose(logits, model.forward(model.new_cache(64), ids)[20:], atol=1e-5)
    with pytest.raises(ValueError):
        cache.rollback(31)


def test_capacity_is_enforced(pair):
    model = pair["batched"]
    cache = model.new_cache(8)
    model.forward(cache, [1] * 8)
    with pytest.raises(ValueError, match="capacity"):
        model.forward(cache, [1])


def test_other_architectures_run_on_transformers(tmp_path):
    config = GPTNeoXConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                           num_attention_heads=2, max_position_embeddings=64)
    GPTNeoXForCausalLM(config).save_pretrained(tmp_path)
    model = CausalLM.load(ModelSpec(str(tmp_path)))
    assert model.backend == "transformers" and "GPTNeoXForCausalLM" in model.unbatched_reason
    cache = model.new_cache()
    model.forward(cache, [1, 2, 3])
    cache.rollback(1)
    assert torch.allclose(model.forward(cache, [5])[-1], model.forward(model.new_cache(), [1, 5])[-1], atol=1e-5)
    with pytest.raises(ValueError, match="batched backend cannot run"):
        CausalLM.load(ModelSpec(str(tmp_path), backend="batched"))
