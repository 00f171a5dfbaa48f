"""The batched runtime: ragged batches of sessions give each session the logits it gets alone
and that transformers' own forward gives, for every model feature the runtime supports;
what it does not support runs on transformers' forward and says why; the KV pool reserves,
releases and refuses as documented."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from transformers import (
    GPT2Config,
    GPT2LMHeadModel,
    LlamaConfig,
    LlamaForCausalLM,
    MistralConfig,
    MistralForCausalLM,
    Qwen2Config,
    Qwen2ForCausalLM,
)

from specdec.defaults import DEFAULT_TARGET
from specdec.kv_pool import KVPool, PoolExhausted
from specdec.runtime import CausalLM, KVCache, ModelSpec

# float32 throughout. Against transformers' full-sequence forward (other kernels, other
# summation orders) and between a session alone and inside a batch (other matmul shapes).
VS_TRANSFORMERS_ATOL = 1e-4
VS_ALONE_ATOL = 1e-5
# One row's logits alone against the same row inside batches of 1 to 80 rows.
BATCH_INVARIANCE_ATOL = 1e-4

VOCAB = 96
SMALL = dict(vocab_size=VOCAB, hidden_size=32, intermediate_size=48, num_hidden_layers=2, max_position_embeddings=128)
LLAMA3_ROPE = {
    "rope_type": "llama3", "rope_theta": 10000.0, "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
    "original_max_position_embeddings": 16,
}  # fmt: skip
SUPPORTED = {
    "gpt2": lambda: GPT2LMHeadModel(GPT2Config(vocab_size=VOCAB, n_embd=32, n_layer=2, n_head=2, n_positions=128)),
    "llama-gqa-llama3": lambda: LlamaForCausalLM(
        LlamaConfig(**SMALL, num_attention_heads=4, num_key_value_heads=2, rope_parameters=LLAMA3_ROPE)
    ),
    "qwen2-qkv-biases": lambda: Qwen2ForCausalLM(Qwen2Config(**SMALL, num_attention_heads=4, num_key_value_heads=2)),
    "mistral-window-8": lambda: MistralForCausalLM(
        MistralConfig(**SMALL, num_attention_heads=4, num_key_value_heads=1, sliding_window=8)
    ),
    "llama-tied": lambda: LlamaForCausalLM(
        LlamaConfig(**SMALL, num_attention_heads=2, num_key_value_heads=2, tie_word_embeddings=True)
    ),
    "llama-head-dim-12": lambda: LlamaForCausalLM(
        LlamaConfig(**SMALL, num_attention_heads=4, num_key_value_heads=2, head_dim=12)
    ),
    "llama-all-biases": lambda: LlamaForCausalLM(
        LlamaConfig(**SMALL, num_attention_heads=4, num_key_value_heads=4, attention_bias=True, mlp_bias=True)
    ),
}
UNSUPPORTED = {
    "hidden_act gelu": lambda: LlamaForCausalLM(LlamaConfig(**SMALL, num_attention_heads=2, hidden_act="gelu")),
    "rope_type dynamic": lambda: LlamaForCausalLM(
        LlamaConfig(**SMALL, num_attention_heads=2, rope_parameters={"rope_type": "dynamic", "factor": 2.0})
    ),
    "activation_function relu": lambda: GPT2LMHeadModel(
        GPT2Config(vocab_size=VOCAB, n_embd=32, n_layer=1, n_head=2, n_positions=128, activation_function="relu")
    ),
}


def save(build, path: Path) -> str:
    """A random model saved like a checkpoint; biases drawn too (they start as zeros)."""
    torch.manual_seed(0)
    model = build()
    with torch.no_grad():
        for name, parameter in model.named_parameters():
            if name.endswith(".bias"):
                parameter.normal_(0, 0.2)
    model.save_pretrained(path)
    return str(path)


@pytest.fixture(scope="module", params=sorted(SUPPORTED))
def supported(request, tmp_path_factory) -> CausalLM:
    model = CausalLM.load(ModelSpec(save(SUPPORTED[request.param], tmp_path_factory.mktemp(request.param))))
    assert model.backend == "batched", model.unbatched_reason
    return model


def reference(model: CausalLM, ids: list[int]) -> torch.Tensor:
    """transformers' own logits of a whole sequence, no cache."""
    with torch.no_grad():
        return model.model(torch.tensor([ids])).logits[0].float()


def sequences(count: int, length: int, seed: int) -> list[list[int]]:
    generator = torch.Generator().manual_seed(seed)
    return [torch.randint(0, VOCAB, (length,), generator=generator).tolist() for _ in range(count)]


def run_rounds(model: CausalLM, batched: bool) -> list[list[tuple[int, torch.Tensor]]]:
    """Four sessions fed ragged rounds (1, 5, 9 and a 30-token chunk in one forward), one round
    with rejected continuations rolled back; per session, (start, logits) of every real feed."""
    seqs = sequences(4, 72, seed=1)
    junk = sequences(4, 9, seed=2)
    caches = [model.new_cache(100) for _ in seqs]
    rounds = [
        [20, 3, 11, 30],  # prefills of different lengths: a chunk of 30 among them
        [1, 5, 9, 1],
        "reject",  # sessions 1 and 2 feed a continuation that is rolled back
        [30, 1, 5, 9],
        [1, 9, 1, 5],
    ]
    fed = [0] * 4
    seen: list[list[tuple[int, torch.Tensor]]] = [[] for _ in seqs]
    for plan in rounds:
        if plan == "reject":
            lengths = [cache.length for cache in caches]
            chunks, who = [seqs[0][fed[0] : fed[0] + 1], junk[1][:5], junk[2][:9]], [0, 1, 2]
        else:
            chunks, who = [seq[fed[i] : fed[i] + n] for i, (seq, n) in enumerate(zip(seqs, plan))], [0, 1, 2, 3]
        if batched:
            outs = model.forward_batch([caches[i] for i in who], chunks)
        else:
            outs = [model.forward(caches[i], chunk) for i, chunk in zip(who, chunks)]
        for i, chunk, out in zip(who, chunks, outs):
            if plan != "reject" or i == 0:
                seen[i].append((fed[i], out))
                fed[i] += len(chunk)
        if plan == "reject":
            for i in (1, 2):
                caches[i].rollback(lengths[i])
        assert [cache.length for cache in caches] == fed
    for i, seq in enumerate(seqs):
        full = reference(model, seq[: fed[i]])
        for start, out in seen[i]:
            delta = (out - full[start : start + len(out)]).abs().max().item()
            assert delta < VS_TRANSFORMERS_ATOL, (i, start, len(out), delta)
    return seen


def test_ragged_batches_match_one_session_and_transformers(supported):
    batched, alone = run_rounds(supported, batched=True), run_rounds(supported, batched=False)
    for session_batched, session_alone in zip(batched, alone):
        for (start, a), (_, b) in zip(session_batched, session_alone):
            assert (a - b).abs().max().item() < VS_ALONE_ATOL, start


def test_sliding_window_hides_positions_older_than_the_window(tmp_path):
    """Mistral with a window of 8 and 2 layers: the last position's logits reach back 2 x 7
    positions, no further. A token changed just beyond that reach changes nothing; one
    changed at its edge changes them (so the window is not trivially everything)."""
    model = CausalLM.load(ModelSpec(save(SUPPORTED["mistral-window-8"], tmp_path)))
    [seq] = sequences(1, 40, seed=3)
    last = len(seq) - 1

    def changed_at(position: int) -> torch.Tensor:
        ids = list(seq)
        ids[position] = (ids[position] + 1) % VOCAB
        return model.forward(model.new_cache(64), ids)[-1]

    base = model.forward(model.new_cache(64), seq)[-1]
    assert torch.allclose(changed_at(last - 15), base, atol=VS_ALONE_ATOL)
    assert not torch.allclose(changed_at(last - 14), base, atol=1e-3)


def test_a_row_is_the_same_alone_and_inside_batches_of_up_to_80_rows():
    """The committed target (packed oneDNN matmuls): one session's next-token logits alone
    against the same position inside batches of 1 to 80 rows of varied composition."""
    model = CausalLM.load(ModelSpec(DEFAULT_TARGET))
    vocab = model.vocab_size
    generator = torch.Generator().manual_seed(4)
    probe = model.new_cache(64)
    model.forward(probe, torch.randint(0, vocab, (40,), generator=generator).tolist())
    fillers = [model.new_cache(128) for _ in range(4)]
    for i, cache in enumerate(fillers):
        model.forward(cache, torch.randint(0, vocab, (7 + 13 * i,), generator=generator).tolist())
    alone = model.forward(probe, [11])
    probe.rollback(40)
    compositions = [[], [1], [4], [1, 1, 1], [8, 1], [30], [1, 5, 9, 30], [20, 20, 19, 20], [79]]
    worst = 0.0
    for trial, sizes in enumerate(compositions):
        caches = [probe] + fillers[: len(sizes)]
        ids = [[11]] + [torch.randint(0, vocab, (n,), generator=generator).tolist() for n in sizes]
        at = trial % len(caches)  # the probe first, in the middle, last
        caches.insert(at, caches.pop(0))
        ids.insert(at, ids.pop(0))
        lengths = [cache.length for cache in caches]
        outs = model.forward_batch(caches, ids)
        assert sum(map(len, ids)) <= 80
        worst = max(worst, (outs[at] - alone).abs().max().item())
        for cache, length in zip(caches, lengths):
            cache.rollback(length)
    print(f"\nmax |delta logit| of one row alone vs inside batches of 1-80 rows (committed target): {worst:.3g}")
    assert worst < BATCH_INVARIANCE_ATOL


@pytest.mark.parametrize("feature", sorted(UNSUPPORTED))
def test_unsupported_features_run_on_transformers_and_say_why(feature, tmp_path):
    model = CausalLM.load(ModelSpec(save(UNSUPPORTED[feature], tmp_path)))
    assert model.backend == "transformers" and feature in model.unbatched_reason
    assert model.pool_stats() is None and model.fits(10**9)
    seqs = sequences(3, 20, seed=5)
    caches = [model.new_cache() for _ in seqs]
    model.forward_batch(caches, [seqs[0][:4], seqs[1][:1], seqs[2][:9]])
    outs = model.forward_batch(caches, [seqs[0][4:5], seqs[1][1:20], seqs[2][9:12]])
    for out, seq, start in zip(outs, seqs, (4, 1, 9)):
        full = reference(model, seq[: start + len(out)])
        assert torch.allclose(out, full[start:], atol=VS_TRANSFORMERS_ATOL)
    assert model.last_batch == (3, 1 + 19 + 3)
    with pytest.raises(ValueError, match="batched backend cannot run"):
        CausalLM.load(ModelSpec(str(tmp_path), backend="batched"))


def test_pool_reserves_first_fit_and_coalesces_on_release():
    pool = KVPool(layers=1, kv_heads=1, head_dim=2, tokens=100, dtype=torch.float32, device=torch.device("cpu"))
    a, b, c = pool.reserve(30), pool.reserve(30), pool.reserve(30)
    assert (a.offset, b.offset, c.offset) == (0, 30, 60)
    assert pool.fits(10) and not pool.fits(11)
    pool.release(a)
    pool.release(a)  # idempotent
    assert pool.reserve(5).offset == 0  # first fit: the first free run
    pool.release(b)  # frees 30..59, next to the free 5..29: one run 5..59
    assert pool.fits(55) and not pool.fits(56)
    with pytest.raises(PoolExhausted, match="--kv-pool-tokens") as refused:
        pool.reserve(60)
    assert "60 tokens" in str(refused.value) and "65 of its 100 are free" in str(refused.value)
    assert "largest free run 55" in str(refused.value)


def test_caches_reserve_from_one_pool_and_give_it_back(tmp_path):
    model = CausalLM.load(ModelSpec(save(SUPPORTED["llama-gqa-llama3"], tmp_path), pool_tokens=300))
    pool = model._pool.kv
    stats = model.pool_stats()
    assert (stats.capacity_tokens, stats.reserved_tokens, stats.used_tokens) == (300, 0, 0)
    assert stats.bytes == pool.nbytes == 300 * model.kv_bytes_per_token
    a, b = model.new_cache(100), model.new_cache(120)
    model.forward_batch([a, b], [[1, 2, 3], [4] * 10])
    stats = model.pool_stats()
    assert (stats.reserved_tokens, stats.used_tokens) == (220, 13)
    assert a.nbytes() == 100 * model.kv_bytes_per_token
    assert model.fits(80) and not model.fits(81)
    with pytest.raises(PoolExhausted, match="--kv-pool-tokens"):
        model.new_cache(81)
    before = pool.data_ptr()
    b.rollback(2)  # a length change: nothing moves, nothing is allocated
    assert pool.data_ptr() == before and model._pool.kv is pool and model.pool_stats().used_tokens == 5
    a.release()
    a.release()
    assert model.pool_stats().reserved_tokens == 120
    del b  # a cache dropped without release() still frees its run
    assert model.pool_stats().reserved_tokens == 0 and model.fits(300)
    model.step_time_s(repeats=2)  # calibration gives its reservation back
    assert model.pool_stats().reserved_tokens == 0
    default = CausalLM.load(ModelSpec(str(tmp_path)))
    assert default.pool_stats().capacity_tokens == 8 * default.max_positions
    assert default.new_cache().capacity == default.max_positions


def test_a_bad_session_fails_the_batch_before_anything_runs(toy):
    model = CausalLM.load(ModelSpec(str(toy.target), pool_tokens=64))
    good, full, spare = model.new_cache(16), model.new_cache(8), model.new_cache(8)
    model.forward_batch([good, full], [[1, 2], [1] * 8])
    forwards = model.forwards
    stranger = KVCache(8, state=None)
    bad_batches = {
        "session 1 of the batch: 9 positions exceed its capacity of 8": ([good, full], [[3], [3]]),
        "session 2 of the batch feeds no ids": ([good, spare, full], [[3], [3], []]),
        "the same cache twice": ([good, good], [[3], [4]]),
        "session 1 of the batch is not a cache of this model": ([good, stranger], [[3], [3]]),
        "one id list per cache": ([good, spare], [[3]]),
    }
    for message, (caches, ids) in bad_batches.items():
        with pytest.raises(ValueError, match=message):
            model.forward_batch(caches, ids)
    spare.release()
    with pytest.raises(ValueError, match="session 1 of the batch was released"):
        model.forward_batch([good, spare], [[3], [3]])
    assert (good.length, full.length, model.forwards) == (2, 8, forwards)
    model.forward_batch([good], [[3]])
    assert model.forwards == forwards + 1 and model.last_batch == (1, 1)


def test_forward_equals_a_batch_of_one(tmp_path):
    model = CausalLM.load(ModelSpec(save(SUPPORTED["qwen2-qkv-biases"], tmp_path)))
    a, b = model.new_cache(), model.new_cache()
    assert torch.equal(model.forward(a, [1, 2, 3]), model.forward_batch([b], [[1, 2, 3]])[0])
    assert torch.equal(model.forward(a, [4]), model.forward_batch([b], [[4]])[0])


def test_a_slotted_pool_gives_each_session_a_whole_slot_and_never_fragments():
    pool = KVPool(1, 1, 2, 100, torch.float32, torch.device("cpu"), slot_tokens=30)
    a, b, c = (pool.reserve(n) for n in (10, 30, 25))
    assert [r.offset for r in (a, b, c)] == [0, 30, 60]
    assert pool.stats().reserved_tokens == 90  # whole slots
    assert not pool.fits(11)  # 10 tokens left, no slot
    pool.release(b)
    d = pool.reserve(29)  # the freed slot, whatever the lengths before
    assert d.offset == 30
    with pytest.raises(PoolExhausted, match="in slots of 30"):
        pool.reserve(1)


@pytest.mark.parametrize("feature", sorted(f for f in SUPPORTED if "window" not in f))
def test_padded_attention_over_slots_matches_the_loop(feature, tmp_path, monkeypatch):
    """With every session in a slot of the pool, a step's attention is one padded, masked
    computation over all slots: ragged rounds after rollbacks give transformers' logits
    (run_rounds checks) and the loop's within VS_ALONE_ATOL, and the padded path ran."""
    path = save(SUPPORTED[feature], tmp_path / feature)
    loop = CausalLM.load(ModelSpec(path))
    slotted = CausalLM.load(ModelSpec(path, pool_tokens=4 * 128, pool_slots=True))
    assert slotted._pool.slot_tokens == 128
    calls = []
    padded = slotted._batched._attend_padded
    monkeypatch.setattr(slotted._batched, "_attend_padded", lambda *args: calls.append(1) or padded(*args))
    got, expected = run_rounds(slotted, batched=True), run_rounds(loop, batched=True)
    assert calls  # the padded path carried the batched rounds
    for session_got, session_expected in zip(got, expected):
        for (start, a), (_, b) in zip(session_got, session_expected):
            assert (a - b).abs().max().item() < VS_ALONE_ATOL, (start, (a - b).abs().max().item())
