"""The ``sft`` entry point: packaged configs, the model it starts from, the loss mask, and end-to-end runs.

The runs fine-tune a tiny random Hugging Face Llama (written to a temporary folder, with a tokenizer trained
locally) on the shipped tiny instruction and chat sets; nothing touches the network.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path

import numpy as np
import pytest
from finetune_support import CHAT, CHAT_TEMPLATE, losses, supervised_overrides, write_tiny_llama

from ponente.trainer.config import load_config
from ponente.trainer.data import data_tokenizer, data_vocab_size, train_set
from ponente.trainer.main import sft
from ponente.trainer.main.sft import SftConfig
from ponente.trainer.run import _pretrained
from ponente.trainer.tasks.lm import LmTask

RESPONSE_MARK = "### Response:\n"
"""Where the prompt of the tests' Alpaca-style template ends (see ``finetune_support.ALPACA_TEMPLATE``)."""


@pytest.fixture(scope="module")
def tiny_llama(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_tiny_llama(tmp_path_factory.mktemp("tiny_llama"))


@pytest.mark.parametrize(
    ("paths", "data_format"),
    [
        (["sft_alpaca"], "supervised"),
        (["sft_chat"], "chat"),
        (["sft_alpaca", "tiny_instructions"], "supervised"),
        (["sft_chat", "tiny_chat"], "chat"),
    ],
)
def test_packaged_sft_configs_parse(paths: list[str], data_format: str) -> None:
    cfg = load_config(SftConfig, paths)
    assert cfg.data.format.choice_name == data_format
    assert cfg.initialize_from_hf is not None
    assert cfg.use_hf_model_config is None  # the model config comes from the checkpoint
    assert cfg.max_train_length is not None


def test_sft_needs_a_model_to_start_from_and_rows_of_two_tokens(tiny_llama: Path) -> None:
    with pytest.raises(ValueError, match=r"initialize_from_hf.*trainer.initialize_from"):
        sft.train(SftConfig())
    short = [f"initialize_from_hf={tiny_llama}", "data.train_urls=[unused.jsonl]", "max_train_length=1"]
    with pytest.raises(ValueError, match="max_train_length must be None or >= 2"):
        sft.train(load_config(SftConfig, overrides=short))


def test_model_config_comes_from_the_checkpoint_and_rows_from_max_train_length(tiny_llama: Path) -> None:
    overrides = [f"initialize_from_hf={tiny_llama}", "max_train_length=48", "data.train_urls=[unused.jsonl]"]
    cfg = load_config(SftConfig, overrides=[*overrides, f"data.tokenizer={tiny_llama}"])
    got = LmTask(cfg, use_hf_model_config=True, max_train_length=cfg.max_train_length)
    assert (got.model_config.model_type, got.model_config.hidden_dim, got.model_config.num_layers) == ("llama", 32, 2)
    assert got.model_config.seq_len == 128  # the checkpoint's max_position_embeddings; rows are shorter
    assert got.seq_len == 48
    assert got.initialize_from_hf == str(tiny_llama)
    assert got.config.model == got.model_config  # the run records the model it trains
    kept = LmTask(cfg, use_hf_model_config=False)
    assert kept.model_config == cfg.model


def test_pretrained_weights_take_the_place_of_the_initial_ones(tiny_llama: Path) -> None:
    """``replace_model`` puts a checkpoint's arrays into a state, sharded like it; shapes must match."""
    import jax
    import optax

    import ponente.namedtensor as hax
    from ponente.models.hf import load_pretrained
    from ponente.trainer import run
    from ponente.trainer.tasks.lm import lm_loss_fn
    from ponente.trainer.trainer import Trainer, TrainerConfig

    model_config = run.hf_model_config(str(tiny_llama))
    vocab_size = run.hf_vocab_size(str(tiny_llama))
    trainer = Trainer(TrainerConfig(train_batch_size=2, compilation_cache_dir=None), optax.sgd(0.1), lm_loss_fn())
    state = trainer.initial_state(lambda key: model_config.build(hax.Axis("vocab", vocab_size), key=key))
    weights = load_pretrained(tiny_llama)
    loaded = _pretrained.replace_model(state, weights, what="initialize_from_hf")
    leaves = jax.tree_util.tree_leaves
    for got, want, before in zip(leaves(loaded.model), leaves(weights), leaves(state.model), strict=True):
        np.testing.assert_array_equal(np.asarray(got), np.asarray(want))
        assert got.sharding == before.sharding
    assert int(loaded.step) == 0
    smaller = trainer.initial_state(lambda key: model_config.build(hax.Axis("vocab", vocab_size - 8), key=key))
    with pytest.raises(ValueError, match=r"initialize_from_hf: .* has shape .* in the checkpoint"):
        _pretrained.replace_model(smaller, weights, what="initialize_from_hf")


def _response_starts(tokens: list[int], tokenizer: object) -> int:
    """The index of the first response token of one example: right after the prompt's ``### Response:`` line."""
    for k in range(1, len(tokens) + 1):
        if tokenizer.decode(tokens[:k], skip_special_tokens=False).endswith(RESPONSE_MARK):  # type: ignore[attr-defined]
            return k
    return len(tokens)  # truncated inside the prompt: nothing to train on


def test_prompt_tokens_do_not_contribute_to_the_loss(tmp_path: Path, tiny_llama: Path) -> None:
    """The training loss on packed Alpaca-style rows equals a float64 NumPy mean over response tokens only.

    The response of each packed example is found independently of the data pipeline's mask (after the
    ``### Response:`` line of its decoded text); the mean over every token of the same rows differs, so a loss
    that counted prompt tokens would fail.
    """
    from ponente.models import AttentionMask
    from ponente.models.hf import load_pretrained
    from ponente.trainer.tasks.lm import lm_batch, lm_loss_fn

    cfg = load_config(SftConfig, overrides=supervised_overrides(tmp_path, tiny_llama, 1))
    dataset = train_set(cfg.data, 128, seed=0, batch_size=8)
    rows = [dataset[i] for i in range(4)]
    batch = lm_batch({k: np.stack([r[k] for r in rows]) for k in rows[0]})
    model = load_pretrained(tiny_llama)
    loss = float(lm_loss_fn(0.0, None)(model, batch, key=None))

    ids = np.stack([r["input_ids"] for r in rows])
    seg = np.stack([r["segment_ids"] for r in rows])
    mask = AttentionMask.causal().with_segment_ids(batch["segment_ids"])
    logits = np.asarray(model(batch["input_ids"], mask, pos_ids=batch["position_ids"]).array, dtype=np.float64)
    peak = logits.max(-1, keepdims=True)
    logp = logits - peak - np.log(np.exp(logits - peak).sum(-1, keepdims=True))
    tokenizer = data_tokenizer(cfg.data)
    response, every = [], []
    for b in range(ids.shape[0]):
        for s in sorted(set(seg[b].tolist()) - {-1}):
            where = np.flatnonzero(seg[b] == s)
            first = where[_response_starts(ids[b, where].tolist(), tokenizer)] if len(where) else None
            for i in where[:-1]:  # position i predicts token i + 1 of the same example
                nll = -logp[b, i, ids[b, i + 1]]
                every.append(nll)
                if first is not None and i + 1 >= first:
                    response.append(nll)
    assert response
    assert len(response) < len(every)
    np.testing.assert_allclose(loss, np.mean(response), rtol=1e-5)
    assert abs(np.mean(every) - np.mean(response)) > 1e-3


# --- end to end ----------------------------------------------------------------------------------


@pytest.mark.integration
def test_sft_fine_tunes_a_hugging_face_llama_and_exports_it(tmp_path: Path, tiny_llama: Path) -> None:
    """Loss falls on the tiny instruction set; Hugging Face exports every hf_save_steps and at the end load in
    transformers with the logits of the final checkpoint."""
    import torch
    import transformers

    import ponente.namedtensor as hax
    from ponente.models import AttentionMask
    from ponente.trainer import run

    overrides = [
        *supervised_overrides(tmp_path, tiny_llama, 20),
        f"hf_save_path={tmp_path / 'hf'}",
        "hf_save_steps=10",
    ]
    cfg = load_config(SftConfig, overrides=overrides)
    result = sft.train(cfg)
    values = [loss for _, loss in losses(tmp_path)]
    assert len(values) == 20
    assert np.mean(values[-3:]) < values[0] - 0.5, values
    assert result.hf_path == str(tmp_path / "hf")
    assert (tmp_path / "hf" / "step-10" / "model.safetensors").is_file()
    assert not (tmp_path / "hf" / "step-20").exists()  # the last step's export is the final one

    model_config = run.hf_model_config(str(tiny_llama))
    ours = run.load_model_from_checkpoint(model_config, data_vocab_size(cfg.data), result.checkpoint)
    ids = np.random.default_rng(0).integers(0, data_vocab_size(cfg.data), size=(2, 24))
    expected = np.asarray(ours(hax.named(ids, ("batch", "position")), AttentionMask.causal()).array)
    exported = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "hf", dtype=torch.float32).eval()
    with torch.no_grad():
        got = exported(torch.tensor(ids)).logits.numpy()
    np.testing.assert_allclose(got, expected, atol=1e-4)
    base = transformers.AutoModelForCausalLM.from_pretrained(tiny_llama, dtype=torch.float32).eval()
    with torch.no_grad():
        assert not np.allclose(base(torch.tensor(ids)).logits.numpy(), got, atol=1e-3)  # every weight trained


@pytest.mark.integration
def test_sft_on_chat_data_and_from_a_ponente_checkpoint(tmp_path: Path, tiny_llama: Path) -> None:
    """Chat data trains (loss falls); a second run starts from the first run's checkpoint with ``model`` given."""
    chat = [
        f"data.train_urls=[{CHAT}]",
        f"data.validation_urls=[{CHAT}]",
        "data.format=chat",
        "data.prompt_template=null",
        f"data.chat_template={CHAT_TEMPLATE}",
        "trainer.steps_per_eval=10",
    ]
    first_dir = tmp_path / "first"
    cfg = load_config(SftConfig, overrides=[*supervised_overrides(first_dir, tiny_llama, 20), *chat])
    first = sft.train(cfg)
    values = [loss for _, loss in losses(first_dir)]
    assert np.mean(values[-3:]) < values[0] - 0.5, values
    assert set(first.eval_loss)
    assert all(np.isfinite(v) for v in first.eval_loss.values())

    from ponente.trainer import run

    second_dir = tmp_path / "second"
    overrides = [o for o in supervised_overrides(second_dir, tiny_llama, 2) if not o.startswith("initialize_from_hf")]
    cfg2 = load_config(SftConfig, overrides=[*overrides, *chat, f"trainer.initialize_from={first.checkpoint}"])
    cfg2 = dataclasses.replace(cfg2, model=run.hf_model_config(str(tiny_llama)))
    second = sft.train(cfg2)
    # the first step of the second run starts where the first run ended, far below the random model's loss
    assert losses(second_dir)[0][1] < values[0] - 0.5
    assert second.steps == 2
