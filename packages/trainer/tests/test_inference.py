"""The generation engine against independent references: the model's full forward, transformers, NumPy."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from finetune_support import write_tiny_llama

import ponente.namedtensor as hax
from ponente.models import LlamaConfig, LlamaLMHeadModel
from ponente.trainer.inference import (
    Engine,
    GenerationConfig,
    SamplingParams,
    eos_token_ids,
    load_model,
    sample_next,
)

PROMPTS = [[5, 17, 3, 44], [9], [60, 61, 62, 63, 64, 65, 66, 67, 68, 69, 70], [12, 12]]


@pytest.fixture(scope="module")
def model() -> Any:
    config = LlamaConfig(seq_len=64, hidden_dim=32, intermediate_dim=64, num_layers=2, num_heads=4, num_kv_heads=2)
    return config.build(hax.Axis("vocab", 97), key=jax.random.PRNGKey(0))


@pytest.fixture(scope="module")
def hf_folder(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_tiny_llama(tmp_path_factory.mktemp("tiny_llama"))


@pytest.fixture(scope="module")
def hf_engine(hf_folder: Path) -> Engine:
    model, tokenizer = load_model(str(hf_folder))
    return Engine(model, tokenizer, max_batch_size=4)


@eqx.filter_jit
def _forward(model: Any, ids: jax.Array) -> jax.Array:
    return model(hax.named(ids, "position")).array


def full_forward_logits(model: Any, ids: list[int]) -> np.ndarray:
    """The model's logits over ``ids`` (one full causal forward, no cache): ``(len(ids), vocab)``.

    The ids are right-padded to the model's ``seq_len`` (one compilation); causal attention keeps the padding out
    of the logits of the real positions.
    """
    padded = np.zeros(model.config.seq_len, np.int32)
    padded[: len(ids)] = ids
    return np.asarray(_forward(model, jnp.asarray(padded)), np.float64)[: len(ids)]


def greedy_by_full_forward(model: Any, prompt: list[int], n: int) -> list[int]:
    """Greedy continuation re-running the whole sequence per token (the path the engine's cache replaces)."""
    ids = list(prompt)
    for _ in range(n):
        ids.append(int(np.argmax(full_forward_logits(model, ids)[-1])))
    return ids[len(prompt) :]


def test_greedy_equals_the_full_forward_loop(model: Any) -> None:
    engine = Engine(model, max_batch_size=4)
    done = engine.generate(PROMPTS, GenerationConfig(max_new_tokens=12))
    for prompt, completion in zip(PROMPTS, done, strict=True):
        assert completion.prompt_tokens == prompt
        assert completion.tokens == greedy_by_full_forward(model, prompt, 12)
        assert completion.finish_reason == "length"
        assert completion.logprobs is None
        assert completion.text == ""


def test_batched_prompts_equal_one_by_one(model: Any) -> None:
    engine = Engine(model, max_batch_size=3)  # 4 prompts: two batches, sorted by length
    for config in (
        GenerationConfig(max_new_tokens=9),
        GenerationConfig(max_new_tokens=9, temperature=1.0, top_k=20, seed=7),
    ):
        batched = engine.generate(PROMPTS, config)
        alone = [engine.generate([p], config)[0] for p in PROMPTS]
        assert [c.tokens for c in batched] == [c.tokens for c in alone]


def test_per_prompt_configs_and_budgets(model: Any) -> None:
    engine = Engine(model, max_batch_size=4)
    configs = [GenerationConfig(max_new_tokens=n, logprobs=n % 2 == 0) for n in (3, 8, 1, 6)]
    done = engine.generate(PROMPTS, configs)
    assert [len(c.tokens) for c in done] == [3, 8, 1, 6]
    assert [c.logprobs is not None for c in done] == [False, True, False, True]
    assert [c.tokens for c in done] == [greedy_by_full_forward(model, p, n) for p, n in zip(PROMPTS, (3, 8, 1, 6))]
    with pytest.raises(ValueError, match="config: 2 configs for 4 prompts"):
        engine.generate(PROMPTS, configs[:2])


def test_seeds_are_reproducible(model: Any) -> None:
    engine = Engine(model, max_batch_size=4)
    config = GenerationConfig(max_new_tokens=16, temperature=1.0, seed=3)
    first = [c.tokens for c in engine.generate(PROMPTS, config)]
    assert [c.tokens for c in engine.generate(PROMPTS, config)] == first
    other = [c.tokens for c in engine.generate(PROMPTS, GenerationConfig(max_new_tokens=16, temperature=1.0, seed=4))]
    assert other != first
    greedy = [c.tokens for c in engine.generate(PROMPTS, GenerationConfig(max_new_tokens=16))]
    assert first != greedy
    # top_k=1 keeps only the most likely token: sampling is then greedy
    top1 = engine.generate(PROMPTS, GenerationConfig(max_new_tokens=16, temperature=1.0, top_k=1, seed=3))
    assert [c.tokens for c in top1] == greedy


@pytest.mark.parametrize("tempered", [False, True])
def test_logprobs_equal_the_log_softmax_of_the_full_forward(model: Any, tempered: bool) -> None:
    """``logprobs``: the model's ``log_softmax(logits)`` at the sampled tokens; with ``tempered_logprobs`` (what
    ``ponente-rl`` asks for) that of ``logits / temperature``."""
    engine = Engine(model, max_batch_size=4)
    config = GenerationConfig(max_new_tokens=8, temperature=0.7, seed=1, logprobs=True, tempered_logprobs=tempered)
    for prompt, completion in zip(PROMPTS, engine.generate(PROMPTS, config), strict=True):
        logits = full_forward_logits(model, prompt + completion.tokens) / (0.7 if tempered else 1.0)
        logits -= logits.max(axis=-1, keepdims=True)
        log_softmax = logits - np.log(np.exp(logits).sum(axis=-1, keepdims=True))
        n = len(prompt)
        expected = [log_softmax[n - 1 + i, t] for i, t in enumerate(completion.tokens)]
        assert completion.logprobs is not None
        np.testing.assert_allclose(completion.logprobs, expected, atol=2e-5)


def test_tempered_logprobs_per_row_before_top_p_and_greedy_rows_untempered() -> None:
    """Rows of one batch: tempered (also with ``top_p``: the log-prob is still that of the whole tempered
    distribution), untempered, and greedy with ``tempered_logprobs`` (the model's distribution)."""
    logits = np.random.default_rng(0).normal(0, 3, (4, 50)).astype(np.float32)
    rows = [
        GenerationConfig(temperature=0.7, seed=1, tempered_logprobs=True),
        GenerationConfig(temperature=0.7, seed=1),
        GenerationConfig(temperature=0.0, tempered_logprobs=True),
        GenerationConfig(temperature=0.5, top_p=0.9, seed=2, tempered_logprobs=True),
    ]
    tokens, logprobs = sample_next(jnp.asarray(logits), SamplingParams.of(rows), jnp.zeros(4, jnp.int32))
    tokens = np.asarray(tokens)
    for r, temperature in enumerate((0.7, 1.0, 1.0, 0.5)):
        z = logits[r].astype(np.float64) / temperature
        expected = z[tokens[r]] - z.max() - np.log(np.exp(z - z.max()).sum())
        assert float(logprobs[r]) == pytest.approx(expected, abs=1e-5)
    assert tokens[2] == np.argmax(logits[2])
    # untempered rows are bitwise the log-softmax of the logits, whatever the other rows ask
    plain = jax.nn.log_softmax(jnp.asarray(logits), axis=-1)[np.arange(4), tokens]
    assert float(logprobs[1]) == float(plain[1])
    assert float(logprobs[2]) == float(plain[2])


def test_sample_next_keeps_only_the_tokens_top_k_and_top_p_allow() -> None:
    probs = np.array([0.05, 0.5, 0.15, 0.3])
    logits = jnp.asarray(np.log(probs), jnp.float32)[None, :].repeat(2000, axis=0)

    def draws(**kwargs: Any) -> np.ndarray:
        configs = [GenerationConfig(temperature=1.0, seed=s, **kwargs) for s in range(2000)]
        tokens, logprobs = sample_next(logits, SamplingParams.of(configs), jnp.zeros(2000, jnp.int32))
        np.testing.assert_allclose(np.asarray(logprobs), np.log(probs)[np.asarray(tokens)], atol=1e-6)
        return np.bincount(np.asarray(tokens), minlength=4) / 2000

    # top_p=0.7: 0.5 + 0.3 reach it, so tokens 1 and 3 stay, renormalized to 5/8 and 3/8
    np.testing.assert_allclose(draws(top_p=0.7), [0, 5 / 8, 0, 3 / 8], atol=0.04)
    # top_k=3 drops the least likely token
    np.testing.assert_allclose(draws(top_k=3), np.array([0, 0.5, 0.15, 0.3]) / 0.95, atol=0.04)
    np.testing.assert_allclose(draws(), probs, atol=0.04)


def test_greedy_equals_transformers_generate(hf_folder: Path, hf_engine: Engine) -> None:
    import torch
    import transformers

    hf = transformers.AutoModelForCausalLM.from_pretrained(hf_folder)
    hf.eval()
    stops = eos_token_ids(str(hf_folder))
    assert stops == (3,)
    texts = ["### Instruction:\nWrite a poem", "Hello", "The capital of France is a city"]
    done = hf_engine.generate(texts, GenerationConfig(max_new_tokens=20, stop_token_ids=stops))
    for text, completion in zip(texts, done, strict=True):
        ids = hf_engine.encode(text)
        with torch.no_grad():
            out = hf.generate(torch.tensor([ids]), do_sample=False, max_new_tokens=20, attention_mask=None)
        expected = out[0, len(ids) :].tolist()
        assert completion.tokens == expected
        assert completion.finish_reason == ("stop" if expected[-1] == 3 else "length")


def test_stop_strings_cut_the_text_and_streaming_adds_up(hf_engine: Engine) -> None:
    prompt = "### Instruction:\nWrite a poem"
    free = hf_engine.generate([prompt], GenerationConfig(max_new_tokens=24))[0]
    assert len(free.text) > 6
    stop = free.text[4:6]
    cut = free.text.index(stop)
    streamed: list[tuple[int, int, str, float]] = []
    config = GenerationConfig(max_new_tokens=24, stop_strings=(stop,), logprobs=True)
    done = hf_engine.generate([prompt], config, on_token=lambda *a: streamed.append(a))[0]
    assert done.text == free.text[:cut]
    assert done.finish_reason == "stop"
    assert done.tokens == free.tokens[: len(done.tokens)]
    assert [s[1] for s in streamed] == done.tokens
    assert "".join(s[2] for s in streamed) == done.text
    assert done.logprobs is not None
    assert [s[3] for s in streamed] == pytest.approx(done.logprobs)


def test_stop_token_ids_end_the_completion(hf_engine: Engine) -> None:
    prompt = "Hello"
    free = hf_engine.generate([prompt], GenerationConfig(max_new_tokens=16))[0]
    stop_id = free.tokens[5]
    first = free.tokens.index(stop_id)
    done = hf_engine.generate([prompt], GenerationConfig(max_new_tokens=16, stop_token_ids=(stop_id,)))[0]
    assert done.tokens == free.tokens[: first + 1]
    assert done.finish_reason == "stop"
    tokenizer = hf_engine.tokenizer
    assert done.text == tokenizer.decode(free.tokens[:first], skip_special_tokens=True)


def test_streaming_deltas_add_up_for_a_batch(hf_engine: Engine) -> None:
    texts = ["Hello", "### Instruction:\nWrite", "A", "The capital", "Once"]
    deltas: dict[int, str] = {}
    counts: dict[int, int] = {}

    def on_token(index: int, token: int, delta: str, logprob: float) -> None:
        deltas[index] = deltas.get(index, "") + delta
        counts[index] = counts.get(index, 0) + 1

    done = hf_engine.generate(texts, GenerationConfig(max_new_tokens=10, temperature=0.9, seed=5), on_token=on_token)
    assert [deltas[i] for i in range(len(texts))] == [c.text for c in done]
    assert [counts[i] for i in range(len(texts))] == [len(c.tokens) for c in done]
    assert [c.text for c in done] == [hf_engine.tokenizer.decode(c.tokens, skip_special_tokens=True) for c in done]


def test_max_seq_len_caps_the_completion(model: Any) -> None:
    engine = Engine(model, max_batch_size=2, max_seq_len=12)
    done = engine.generate(PROMPTS[:2], GenerationConfig(max_new_tokens=50))
    assert [len(c.tokens) for c in done] == [8, 11]
    assert all(c.finish_reason == "length" for c in done)
    assert done[0].tokens == greedy_by_full_forward(model, PROMPTS[0], 8)


def test_errors_name_the_prompt_or_key(model: Any) -> None:
    engine = Engine(model, max_seq_len=16)
    with pytest.raises(ValueError, match=r"prompts\[1\]: empty"):
        engine.generate([[1], []])
    with pytest.raises(ValueError, match=r"prompts\[0\]: 16 tokens; the engine's max_seq_len is 16"):
        engine.generate([list(range(16))])
    with pytest.raises(ValueError, match="need a tokenizer"):
        engine.generate(["text"])
    with pytest.raises(ValueError, match="outside the vocabulary"):
        engine.generate([[97]])
    with pytest.raises(ValueError, match="stop_strings: need a tokenizer"):
        engine.generate([[1]], GenerationConfig(stop_strings=("x",)))
    for kwargs, key in (
        ({"max_new_tokens": 0}, "max_new_tokens"),
        ({"temperature": -1.0}, "temperature"),
        ({"top_k": 0}, "top_k"),
        ({"top_p": 1.5}, "top_p"),
        ({"stop_strings": ("",)}, "stop_strings"),
    ):
        with pytest.raises(ValueError, match=key):
            GenerationConfig(**kwargs)


REAL_VOCAB = 90  # the model's vocabulary axis has 97 entries: 90..96 play the padding beyond the tokenizer's ids


class LoudPadding(LlamaLMHeadModel):
    """A Llama whose ids ``>= REAL_VOCAB`` get huge logits (a padded vocabulary the model itself does not mask)."""

    def decode(self, tokens: Any, cache: Any, pos_ids: Any, **kwargs: Any) -> Any:
        logits, cache = super().decode(tokens, cache, pos_ids, **kwargs)
        loud = hax.named(jnp.where(jnp.arange(self.Vocab.size) >= REAL_VOCAB, 1e4, 0.0), self.Vocab)
        return logits + loud, cache


class FakeTokenizer:
    def get_vocab(self, with_added_tokens: bool = True) -> dict[str, int]:
        return {f"t{i}": i for i in range(REAL_VOCAB)}


@pytest.mark.parametrize("sampling", [{}, {"temperature": 1.0, "seed": 3}, {"temperature": 2.0, "top_k": 20}])
def test_padded_vocabulary_ids_are_never_sampled(model: Any, sampling: dict[str, Any]) -> None:
    loud = LoudPadding(transformer=model.transformer, lm_head=model.lm_head, config=model.config, vocab_size=None)
    config = GenerationConfig(max_new_tokens=6, logprobs=True, **sampling)
    unmasked = Engine(loud, max_batch_size=4).generate(PROMPTS, config)
    assert all(t >= REAL_VOCAB for c in unmasked for t in c.tokens)  # without the mask, padding wins every draw
    masked = Engine(loud, max_batch_size=4, vocab_size=REAL_VOCAB).generate(PROMPTS, config)
    assert all(t < REAL_VOCAB for c in masked for t in c.tokens)
    if not sampling:  # greedy: the best real id, with its probability among the real ids
        for prompt, completion in zip(PROMPTS, masked, strict=True):
            logits = full_forward_logits(model, prompt)[-1][:REAL_VOCAB]
            assert completion.tokens[0] == int(np.argmax(logits))
            expected = logits - np.log(np.exp(logits - logits.max()).sum()) - logits.max()
            assert completion.logprobs is not None
            np.testing.assert_allclose(completion.logprobs[0], expected[completion.tokens[0]], atol=1e-4)


def test_the_tokenizer_bounds_the_sampled_ids(model: Any) -> None:
    assert Engine(model, FakeTokenizer()).vocab_size == REAL_VOCAB
    assert Engine(model).vocab_size == 97
    assert Engine(model, FakeTokenizer(), vocab_size=95).vocab_size == 95
    with pytest.raises(ValueError, match=r"vocab_size: must be in \[1, 97\]"):
        Engine(model, vocab_size=98)
    with pytest.raises(ValueError, match="steps_per_call: must be >= 1"):
        Engine(model, steps_per_call=0)


@pytest.mark.parametrize("steps_per_call", [1, 3])
def test_steps_per_call_does_not_change_the_completions(model: Any, steps_per_call: int) -> None:
    config = GenerationConfig(max_new_tokens=7, temperature=0.8, seed=11, logprobs=True)
    reference = Engine(model, max_batch_size=4).generate(PROMPTS, config)  # continuous batching: a second code path
    done = Engine(model, max_batch_size=4, steps_per_call=steps_per_call, continuous=False).generate(PROMPTS, config)
    assert [c.tokens for c in done] == [c.tokens for c in reference]
    for a, b in zip(done, reference, strict=True):
        np.testing.assert_allclose(np.asarray(a.logprobs), np.asarray(b.logprobs), atol=1e-5)
