"""Greedy generation of the engine on exported Hugging Face checkpoints equals ``transformers`` ``generate``.

Qwen3 (sliding and full layers), Gemma 2 (local/global layers, soft caps) and Mixtral (mixture of experts), tiny
random configs written with ``save_pretrained`` and read back by :func:`load_model`; prompts of different lengths
are batched by the engine and run one by one (no padding) by ``transformers``. Llama's is in ``test_inference``.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
import transformers

from ponente.trainer.inference import Engine, GenerationConfig, load_model

SIZES: dict[str, Any] = {
    "vocab_size": 97,
    "hidden_size": 32,
    "intermediate_size": 48,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "max_position_embeddings": 64,
    "initializer_range": 0.3,
    "bos_token_id": None,
    "eos_token_id": None,
    "pad_token_id": 0,
}
MODELS: dict[str, Callable[[], Any]] = {
    "qwen3": lambda: transformers.Qwen3ForCausalLM(
        transformers.Qwen3Config(
            **SIZES,
            head_dim=8,
            use_sliding_window=True,
            sliding_window=4,
            layer_types=["sliding_attention", "full_attention"],
        )
    ),
    "gemma2": lambda: transformers.Gemma2ForCausalLM(
        transformers.Gemma2Config(
            **SIZES,
            head_dim=8,
            sliding_window=4,
            query_pre_attn_scalar=8,
            attn_logit_softcapping=5.0,
            final_logit_softcapping=3.0,
        )
    ),
    "mixtral": lambda: transformers.MixtralForCausalLM(
        transformers.MixtralConfig(**SIZES, num_local_experts=4, num_experts_per_tok=2)
    ),
}
PROMPTS = [[5, 17, 3, 44, 8, 9], [9], [60, 61, 62, 63, 64, 65, 66, 67, 68, 69, 70], [12, 12]]
NEW_TOKENS = 12


@pytest.mark.parametrize("name", sorted(MODELS))
def test_engine_greedy_equals_transformers_generate(name: str, tmp_path: Path) -> None:
    torch.manual_seed(0)
    hf = MODELS[name]().eval()
    hf.save_pretrained(tmp_path)
    model, _ = load_model(str(tmp_path))
    done = Engine(model, max_batch_size=4).generate(PROMPTS, GenerationConfig(max_new_tokens=NEW_TOKENS))
    for prompt, completion in zip(PROMPTS, done, strict=True):
        with torch.no_grad():
            out = hf.generate(
                torch.tensor([prompt]),
                attention_mask=torch.ones((1, len(prompt)), dtype=torch.long),
                do_sample=False,
                max_new_tokens=NEW_TOKENS,
                min_new_tokens=NEW_TOKENS,
            )
        assert completion.tokens == np.asarray(out[0, len(prompt) :]).tolist(), f"{name}: prompt {prompt}"
