"""Shared helpers: tiny Hugging Face PyTorch models (transformers must be importable; tests fail without it)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import numpy as np
import pytest
import torch
import transformers


@pytest.fixture(autouse=True)
def _torch_seed() -> None:
    torch.manual_seed(0)


def _hf_logits(hf_model: Any, ids: np.ndarray) -> np.ndarray:
    """Logits of a transformers model for a (batch, position) id array, as float32 NumPy."""
    with torch.no_grad():
        return hf_model(torch.tensor(ids)).logits.float().numpy()


def _tiny_gpt2(**overrides: Any) -> Any:
    """A random transformers GPT-2 with a tiny config."""
    kwargs: dict[str, Any] = {"vocab_size": 97, "n_positions": 16, "n_embd": 32, "n_layer": 2, "n_head": 4}
    kwargs.update(overrides)
    return transformers.GPT2LMHeadModel(transformers.GPT2Config(**kwargs)).eval()


def _tiny_llama(**overrides: Any) -> Any:
    """A random transformers Llama with a tiny config."""
    kwargs: dict[str, Any] = {
        "vocab_size": 97,
        "max_position_embeddings": 16,
        "hidden_size": 32,
        "intermediate_size": 64,
        "num_hidden_layers": 2,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
    }
    kwargs.update(overrides)
    return transformers.LlamaForCausalLM(transformers.LlamaConfig(**kwargs)).eval()


@pytest.fixture
def hf_logits() -> Callable[[Any, np.ndarray], np.ndarray]:
    """``hf_logits(model, ids)``: logits of a transformers model as float32 NumPy."""
    return _hf_logits


@pytest.fixture
def tiny_gpt2() -> Callable[..., Any]:
    """``tiny_gpt2(**overrides)``: a random transformers GPT-2 (vocab 97, 2 layers, width 32, 4 heads)."""
    return _tiny_gpt2


@pytest.fixture
def tiny_llama() -> Callable[..., Any]:
    """``tiny_llama(**overrides)``: a random transformers Llama (vocab 97, 2 layers, width 32, 4 heads, 2 kv heads)."""
    return _tiny_llama
