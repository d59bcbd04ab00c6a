"""Weight-decay masks on real GPT-2 and Llama models, against hand-listed parameter paths."""

from __future__ import annotations

import equinox as eqx
import jax
import pytest

import ponente.namedtensor as hax
from ponente.models import Gpt2Config, LlamaConfig
from ponente.trainer.optim import AdamConfig, param_paths, weight_decay_mask

Vocab = hax.Axis("vocab", 11)

GPT2_LINEAR_WEIGHTS = {
    f"transformer.h.stacked.{name}.weight" for name in ("attn.c_attn", "attn.c_proj", "mlp.c_fc", "mlp.c_proj")
}
LLAMA_LINEAR_WEIGHTS = {
    f"transformer.layers.stacked.{name}.weight"
    for name in (
        "self_attn.q_proj",
        "self_attn.k_proj",
        "self_attn.v_proj",
        "self_attn.o_proj",
        "mlp.gate_proj",
        "mlp.up_proj",
        "mlp.down_proj",
    )
} | {"lm_head.weight"}


# the masks depend on the tree structure only: build abstract models (shapes, no arrays), which is fast


@pytest.fixture(scope="module")
def gpt2_params():
    cfg = Gpt2Config(seq_len=8, hidden_dim=16, intermediate_dim=32, num_layers=2, num_heads=2, num_kv_heads=2)
    return eqx.filter_eval_shape(cfg.build, Vocab, key=jax.random.key(0))


@pytest.fixture(scope="module")
def llama_params():
    cfg = LlamaConfig(seq_len=8, hidden_dim=16, intermediate_dim=32, num_layers=2, num_heads=2, num_kv_heads=1)
    return eqx.filter_eval_shape(cfg.build, Vocab, key=jax.random.key(0))


def _decayed(params, **kwargs) -> set[str]:
    mask = weight_decay_mask(params, **kwargs)
    flags = jax.tree.leaves(mask)
    paths = param_paths(params)
    assert len(flags) == len(paths)
    assert all(isinstance(f, bool) for f in flags)
    return {p for p, f in zip(paths, flags) if f}


def test_default_mask_decays_only_linear_weights(gpt2_params, llama_params):
    assert _decayed(gpt2_params) == GPT2_LINEAR_WEIGHTS
    assert _decayed(llama_params) == LLAMA_LINEAR_WEIGHTS


def test_mask_is_a_prefix_of_the_param_tree(gpt2_params):
    mask = weight_decay_mask(gpt2_params)
    # optax masks must line up with the parameters: mapping over both must succeed
    jax.tree.map(lambda m, p: p if m else None, mask, gpt2_params)
    assert len(param_paths(gpt2_params)) == 16


def test_regex_string_replaces_the_default(gpt2_params):
    assert _decayed(gpt2_params, modules=r".*c_fc") == {
        "transformer.h.stacked.mlp.c_fc.weight",
        "transformer.h.stacked.mlp.c_fc.bias",
    }
    # owner-relative paths: every LayerNorm weight, wherever it is
    assert _decayed(gpt2_params, modules=r"LayerNorm\.weight") == {
        "transformer.h.stacked.ln_1.weight",
        "transformer.h.stacked.ln_2.weight",
        "transformer.ln_f.weight",
    }


def test_regex_list_with_default(gpt2_params):
    assert _decayed(gpt2_params, modules=["wte", "wpe"]) == {"transformer.wte.weight", "transformer.wpe.weight"}
    assert _decayed(gpt2_params, modules=["wte"], use_default=True) == GPT2_LINEAR_WEIGHTS | {"transformer.wte.weight"}


def test_default_off_decays_everything(llama_params):
    assert _decayed(llama_params, use_default=False) == set(param_paths(llama_params))


def test_bad_regex_is_named(gpt2_params):
    with pytest.raises(ValueError, match=r"invalid regular expression '\(unclosed'"):
        weight_decay_mask(gpt2_params, modules=["(unclosed"])


def test_config_mask_function(llama_params):
    cfg = AdamConfig(weight_decay_modules=["embed_tokens"], default_weight_decay_mask=True)
    mask_fn = cfg.build_weight_decay_mask()
    flags = dict(zip(param_paths(llama_params), jax.tree.leaves(mask_fn(llama_params))))
    assert {p for p, f in flags.items() if f} == LLAMA_LINEAR_WEIGHTS | {"transformer.embed_tokens.weight"}
