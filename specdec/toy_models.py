"""Small, untrained model pairs that tests build and save on the fly.

They are saved exactly like real checkpoints (config, safetensors, tokenizer files) and
loaded back through the same `from_pretrained` path. Random weights are enough to test
losslessness, exactness and fault handling; acceptance is controlled by how far the
draft's weights are from the target's.
"""

from __future__ import annotations

import json
import shutil
from dataclasses import dataclass
from pathlib import Path

import torch
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
from transformers import (
    AutoModelForCausalLM,
    GPT2Config,
    GPT2LMHeadModel,
    LlamaConfig,
    LlamaForCausalLM,
    PreTrainedTokenizerFast,
)

EOS = "<|endoftext|>"
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json")

# Text the toy tokenizer learns its merges from; the multi-byte characters make some
# merges split UTF-8 sequences, which the gateway's detokenizer must handle.
_CORPUS = [
    "def speculative_decode(prompt, draft, target, k=4):",
    "    tokens = draft.propose(prompt, k)  # the draft guesses",
    "    return target.verify(tokens)  # the target keeps what it agrees with",
    "Speculative decoding keeps the target's output exactly, only faster.",
    "Ünïcödé: naïve café, déjà vu, Größe, 東京, 日本語, ✓ → ∑ π ≈ 3.14159",
    "The quick brown fox jumps over the lazy dog. 0123456789 (){}[]<>=+-*/",
]


@dataclass(frozen=True)
class ToySize:
    n_layer: int = 2
    n_embd: int = 64
    n_head: int = 2
    n_positions: int = 512


def build_tokenizer(out_dir: Path, vocab_size: int = 400) -> PreTrainedTokenizerFast:
    """A byte-level BPE tokenizer trained on a few built-in lines, saved to out_dir."""
    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size, special_tokens=[EOS], initial_alphabet=pre_tokenizers.ByteLevel.alphabet()
    )
    tokenizer.train_from_iterator(_CORPUS * 4, trainer)
    fast = PreTrainedTokenizerFast(tokenizer_object=tokenizer, eos_token=EOS, bos_token=EOS, unk_token=EOS)
    fast.save_pretrained(out_dir)
    return fast


def build_model(
    out_dir: Path, tokenizer: PreTrainedTokenizerFast, size: ToySize, seed: int, init_std: float = 0.2
) -> Path:
    """A randomly initialised GPT-2 saved with its tokenizer. A large init_std makes the
    next-token distributions peaked, so greedy argmax ties are practically impossible."""
    torch.manual_seed(seed)
    config = GPT2Config(
        vocab_size=len(tokenizer),
        n_positions=size.n_positions,
        n_embd=size.n_embd,
        n_layer=size.n_layer,
        n_head=size.n_head,
        bos_token_id=tokenizer.eos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        initializer_range=init_std,
    )
    model = GPT2LMHeadModel(config)
    model.save_pretrained(out_dir)
    tokenizer.save_pretrained(out_dir)
    return out_dir


def perturbed_copy(src: Path, out_dir: Path, noise: float, seed: int) -> Path:
    """The model at src with Gaussian noise of relative size `noise` on every weight."""
    model = AutoModelForCausalLM.from_pretrained(src)
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for param in model.parameters():
            param.add_(torch.randn(param.shape, generator=generator) * noise * param.std())
    model.save_pretrained(out_dir)
    for name in TOKENIZER_FILES:
        if (src / name).exists():
            shutil.copy(src / name, out_dir / name)
    return out_dir


def foreign_tokenizer_copy(src: Path, out_dir: Path) -> Path:
    """The model at src with a tokenizer that is not its own: same vocabulary size, but
    the last two learned tokens swap ids, so the same text encodes to other ids."""
    shutil.copytree(src, out_dir)
    path = out_dir / "tokenizer.json"
    spec = json.loads(path.read_text())
    vocab = spec["model"]["vocab"]
    a, b = sorted(vocab, key=vocab.get)[-2:]
    vocab[a], vocab[b] = vocab[b], vocab[a]
    path.write_text(json.dumps(spec, ensure_ascii=False))
    return out_dir


def build_llama(out_dir: Path, tokenizer: PreTrainedTokenizerFast, seed: int, layers: int = 4) -> Path:
    """A randomly initialised Llama-3-style model saved with its tokenizer: grouped-query
    attention (4 query heads, 2 key/value heads), llama3 rope scaling, untied embeddings."""
    torch.manual_seed(seed)
    config = LlamaConfig(
        vocab_size=len(tokenizer),
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=layers,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=512,
        rope_parameters={
            "rope_type": "llama3",
            "rope_theta": 500000.0,
            "factor": 8.0,
            "low_freq_factor": 1.0,
            "high_freq_factor": 4.0,
            "original_max_position_embeddings": 64,
        },
        bos_token_id=tokenizer.eos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        initializer_range=0.2,
        tie_word_embeddings=False,
    )
    LlamaForCausalLM(config).save_pretrained(out_dir)
    tokenizer.save_pretrained(out_dir)
    return out_dir


def truncated_copy(src: Path, out_dir: Path, layers: int) -> Path:
    """The model at src keeping only its first `layers` decoder layers (a draft made by
    cutting the target short: same embeddings and head)."""
    model = AutoModelForCausalLM.from_pretrained(src)
    model.model.layers = model.model.layers[:layers]
    model.config.num_hidden_layers = layers
    model.save_pretrained(out_dir)
    for name in TOKENIZER_FILES:
        if (src / name).exists():
            shutil.copy(src / name, out_dir / name)
    return out_dir
