"""Load a Hugging Face causal LM from a local folder (and build the tiny committed one)."""

from __future__ import annotations

import hashlib
from pathlib import Path

import torch

from worker.data.charcount import FIXTURES

TINY_MODEL_DIR = FIXTURES / "tiny-qwen2"


def build_tiny_model(out: Path, vocab_size: int, seed: int) -> None:
    """A 2-layer, hidden-64 Qwen2 with seeded weights, saved as config.json + model.safetensors."""
    from transformers import AutoModelForCausalLM, Qwen2Config

    config = Qwen2Config(
        vocab_size=vocab_size,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=512,
        tie_word_embeddings=True,
        pad_token_id=0,
        eos_token_id=3,
        bos_token_id=None,
    )
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    model.save_pretrained(str(out), safe_serialization=True)


def load_model(
    path: str | Path = TINY_MODEL_DIR, attn: str = "sdpa", batch_invariant: bool = False
) -> torch.nn.Module:
    """The model in float32, with the same bytes on every rank and every run; batch_invariant:
    the forward of `worker.batch_invariant` (same bits whatever the batch, cache or prefill)."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(
        str(path), dtype=torch.float32, attn_implementation=attn, use_safetensors=True
    )
    model.config.use_cache = False
    return _batch_invariant(model) if batch_invariant else model


def _batch_invariant(model: torch.nn.Module) -> torch.nn.Module:
    from worker.batch_invariant import make_batch_invariant

    return make_batch_invariant(model)


def load_value_model(
    path: str | Path = TINY_MODEL_DIR, attn: str = "sdpa", seed: int = 0,
    batch_invariant: bool = False,
) -> torch.nn.Module:  # fmt: skip
    """The causal LM's trunk with a Linear(hidden, 1) value head on the last hidden state.

    A token-classification model with one label: its `.logits` [.., T, 1] are the values, so the
    engine and TrainingWorker serve it unchanged. The head is seeded on its own (not from the
    global RNG) and dropout is off, so every rank and trainer builds the same critic.
    """
    from transformers import AutoConfig, AutoModelForTokenClassification

    config = AutoConfig.from_pretrained(str(path), num_labels=1)
    config.classifier_dropout = 0.0
    model = AutoModelForTokenClassification.from_pretrained(
        str(path),
        config=config,
        dtype=torch.float32,
        attn_implementation=attn,
        use_safetensors=True,  # never a pickled .bin
    )
    model.config.use_cache = False
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        std = getattr(model.config, "initializer_range", 0.02)
        model.score.weight.copy_(torch.randn(model.score.weight.shape, generator=gen) * std)
        if model.score.bias is not None:
            model.score.bias.zero_()
    return _batch_invariant(model) if batch_invariant else model


def file_sha256(path: str | Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


def weights_sha256(model_dir: str | Path) -> str:
    """Hash of every safetensors file of a model folder, so a manifest pins the initial weights."""
    h = hashlib.sha256()
    for f in sorted(Path(model_dir).glob("*.safetensors")):
        h.update(f.name.encode())
        h.update(file_sha256(f).encode())
    return h.hexdigest()
