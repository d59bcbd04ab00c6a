"""Continuous batching over a paged cache: each request's tokens equal ``transformers`` and the request run alone.

A tiny random Llama written by ``transformers``; pages of 4 tokens and prefill chunks of 4 so that prompts span
several pages and chunks. References: ``transformers`` greedy ``generate``, and the same request run alone on an
engine without prefix caching (sampled requests: alone, by seed).
"""

from __future__ import annotations

import functools
import logging
from pathlib import Path
from typing import Any

import jax
import numpy as np
import pytest
import torch
import transformers
from finetune_support import write_tiny_llama

from ponente.trainer.inference import Engine, GenerationConfig, load_model
from ponente.trainer.inference._paged import PagePool

PROMPTS = [[5, 17, 3, 44, 8, 9, 21], [9], [60, 61, 62, 63, 64, 65, 66, 67, 68, 69, 70, 71, 72], [12, 12]]
SMALL = {"max_batch_size": 4, "max_seq_len": 64, "page_size": 4, "prefill_chunk": 4, "max_pages": 12}
"""Every engine of the tests has this shape (they share compiled programs); 12 pages of 4 cannot hold the four
prompts with 10 new tokens each at once, so busy batches preempt."""


@pytest.fixture(scope="module")
def folder(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_tiny_llama(tmp_path_factory.mktemp("tiny_llama"), max_positions=64)


@pytest.fixture(scope="module")
def model(folder: Path) -> Any:
    return load_model(str(folder))[0]


@pytest.fixture(scope="module")
def engine(model: Any) -> Engine:
    return Engine(model, **SMALL)


@pytest.fixture(scope="module")
def plain(model: Any) -> Engine:
    """The reference engine: no prefix cache, one request at a time."""
    return Engine(model, **SMALL, prefix_caching=False)


@pytest.fixture(scope="module")
def texts(folder: Path) -> tuple[Engine, Engine]:
    """Two engines with the tokenizer: several decode steps per call (the default) and one (the reference)."""
    model, tokenizer = load_model(str(folder))
    return Engine(model, tokenizer, **SMALL), Engine(model, tokenizer, **SMALL, steps_per_call=1)


@functools.cache
def _hf_model(folder: Path) -> Any:
    return transformers.AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()


def _hf_greedy(folder: Path, prompt: list[int], n: int) -> list[int]:
    hf = _hf_model(folder)
    with torch.no_grad():
        out = hf.generate(
            torch.tensor([prompt]),
            attention_mask=torch.ones((1, len(prompt)), dtype=torch.long),
            do_sample=False,
            max_new_tokens=n,
            min_new_tokens=n,
            eos_token_id=None,
            pad_token_id=0,
        )
    return np.asarray(out[0, len(prompt) :]).tolist()


def test_greedy_equals_transformers_and_each_request_alone(folder: Path, engine: Engine, plain: Engine) -> None:
    config = GenerationConfig(max_new_tokens=10)
    together = engine.generate(PROMPTS, config)
    for prompt, completion in zip(PROMPTS, together, strict=True):
        assert completion.tokens == _hf_greedy(folder, prompt, 10), prompt
        assert completion.tokens == plain.generate([prompt], config)[0].tokens


def test_sampled_requests_depend_only_on_their_seed(engine: Engine, plain: Engine) -> None:
    configs = [
        GenerationConfig(max_new_tokens=8, temperature=1.0, seed=7),
        GenerationConfig(max_new_tokens=5, temperature=0.7, top_k=5, seed=1),
        GenerationConfig(max_new_tokens=9),
        GenerationConfig(max_new_tokens=6, temperature=1.3, top_p=0.8, seed=2),
    ]
    together = engine.generate(PROMPTS, configs)
    for prompt, config, completion in zip(PROMPTS, configs, together, strict=True):
        assert completion.tokens == plain.generate([prompt], config)[0].tokens


def test_a_short_request_sent_after_a_long_one_completes_first(engine: Engine, plain: Engine) -> None:
    done: list[str] = []
    results: dict[str, Any] = {}

    def finish(name: str) -> Any:
        def on_done(completion: Any) -> None:
            done.append(name)
            results[name] = completion

        return on_done

    long_config, short_config = GenerationConfig(max_new_tokens=30), GenerationConfig(max_new_tokens=2)
    streamed: list[int] = []
    engine.submit(PROMPTS[2], long_config, on_done=finish("long"), on_token=lambda *args: streamed.append(args[1]))
    while not streamed:  # the long request is decoding when the short one arrives
        engine.step()
    engine.submit(PROMPTS[0], short_config, on_done=finish("short"))
    while engine.busy:
        engine.step()
    assert done == ["short", "long"]
    assert results["long"].tokens == plain.generate([PROMPTS[2]], long_config)[0].tokens
    assert results["short"].tokens == plain.generate([PROMPTS[0]], short_config)[0].tokens


def test_prefix_cache_reuses_pages_with_the_same_tokens(folder: Path, engine: Engine, plain: Engine) -> None:
    shared = [30, 31, 32, 33, 34, 35, 36, 37, 38]  # two full pages of 4
    prompts = [[*shared, 40, 41], [*shared, 50], [*shared[:4], 7, 7, 7]]
    config = GenerationConfig(max_new_tokens=6)
    engine.reset_prefix_cache()
    first = engine.generate([prompts[0]], config)[0]
    hits = engine.prefix_cache_hits
    others = engine.generate(prompts[1:], config)
    assert engine.prefix_cache_hits - hits == 2 + 1  # two pages for the second prompt, one for the third
    for prompt, completion in zip(prompts, [first, *others], strict=True):
        assert completion.tokens == plain.generate([prompt], config)[0].tokens
        assert completion.tokens == _hf_greedy(folder, prompt, 6)
    engine.reset_prefix_cache()
    hits = engine.prefix_cache_hits
    engine.generate([prompts[1]], config)
    assert engine.prefix_cache_hits == hits  # nothing cached any more


def test_a_small_pool_preempts_and_recomputes_without_changing_the_tokens(engine: Engine, plain: Engine) -> None:
    assert engine._batch is not None
    before = engine._batch.preemptions
    config = GenerationConfig(max_new_tokens=12, temperature=0.9, seed=5)
    together = engine.generate(PROMPTS, config)
    assert engine._batch.preemptions > before
    assert engine._batch.peak_pages <= 12
    for prompt, completion in zip(PROMPTS, together, strict=True):
        assert completion.tokens == plain.generate([prompt], config)[0].tokens


def test_no_compilation_in_steady_state(engine: Engine, caplog: pytest.LogCaptureFixture) -> None:
    configs = [GenerationConfig(max_new_tokens=n) for n in (3, 7, 5, 4)]
    engine.generate(PROMPTS, configs)  # every bucket of this workload compiles here
    with jax.log_compiles(True), caplog.at_level(logging.WARNING, logger="jax"):
        engine.generate(PROMPTS, configs)
        engine.generate(PROMPTS[::-1], configs)
    compiled = [r.getMessage() for r in caplog.records if r.getMessage().startswith("Compiling")]
    assert not [m for m in compiled if "_paged_step" in m], compiled  # _paged_step and _paged_steps
    assert engine._batch is not None
    assert engine._batch.calls < engine._batch.steps


def _same(got: Any, want: Any) -> None:
    assert (got.tokens, got.text, got.finish_reason) == (want.tokens, want.text, want.finish_reason)
    assert got.logprobs == want.logprobs


def test_several_steps_per_call_equal_one_step_per_call(texts: tuple[Engine, Engine]) -> None:
    multi, single = texts
    assert multi._batch is not None
    assert single._batch is not None
    stop = single.generate([PROMPTS[0]], GenerationConfig(max_new_tokens=10))[0].tokens[4]
    configs = [
        GenerationConfig(max_new_tokens=10, stop_token_ids=(stop,), logprobs=True),  # stops inside a block
        GenerationConfig(max_new_tokens=5, temperature=0.7, top_k=5, seed=1, logprobs=True),
        GenerationConfig(max_new_tokens=13, logprobs=True),
        GenerationConfig(max_new_tokens=11, temperature=1.3, top_p=0.8, seed=2, logprobs=True),
    ]
    calls, steps = multi._batch.calls, multi._batch.steps
    got = multi.generate(PROMPTS, configs)
    assert multi._batch.calls - calls < multi._batch.steps - steps  # blocks of several steps ran
    single_steps = single._batch.steps
    want = single.generate(PROMPTS, configs)
    assert single._batch.calls - single._batch.steps == 0
    assert single._batch.steps > single_steps
    assert got[0].finish_reason == "stop"
    assert got[0].tokens[-1] == stop
    assert len(got[0].tokens) < 10
    for g, w in zip(got, want, strict=True):
        _same(g, w)


def test_a_stop_token_or_string_inside_a_block_gives_the_one_step_completion(texts: tuple[Engine, Engine]) -> None:
    """One request alone: its first token comes from the prefill, tokens 1-8 from one block of 8 steps."""
    multi, single = texts
    assert multi._batch is not None
    reference = single.generate([PROMPTS[2]], GenerationConfig(max_new_tokens=16))[0].tokens
    at = next(i for i in range(2, 8) if reference[i] not in reference[:i])
    start = len(multi.tokenizer.decode(reference[:3]))
    stop_string = multi.tokenizer.decode(reference)[start : start + 2]
    streamed: list[str] = []
    for config in (
        GenerationConfig(max_new_tokens=16, stop_token_ids=(reference[at],), logprobs=True),
        GenerationConfig(max_new_tokens=16, stop_strings=(stop_string,), logprobs=True),
    ):
        streamed.clear()
        calls, steps = multi._batch.calls, multi._batch.steps
        got = multi.generate([PROMPTS[2]], config, on_token=lambda i, t, delta, lp: streamed.append(delta))[0]
        assert multi._batch.calls - calls < multi._batch.steps - steps
        want = single.generate([PROMPTS[2]], config)[0]
        assert got.finish_reason == "stop"
        assert 2 < len(got.tokens) < 9
        assert "".join(streamed) == got.text
        _same(got, want)


def test_without_free_pages_a_call_runs_one_step(engine: Engine, plain: Engine) -> None:
    """Two prompts of 18 tokens with 14 new ones need 16 pages of the 12. Once both decode (the first at 23 tokens,
    the second at 18: 11 pages), their next 8 tokens need 4 more pages and the pool has 1: the call runs one step
    (a later one preempts the second, which then runs alone, in blocks); the tokens do not change."""
    assert engine._batch is not None
    prompts = [list(range(100, 118)), list(range(200, 218))]
    config = GenerationConfig(max_new_tokens=14, temperature=0.8, seed=3)
    engine.reset_prefix_cache()
    fallbacks, calls, steps = engine._batch.fallbacks, engine._batch.calls, engine._batch.steps
    together = engine.generate(prompts, config)
    assert engine._batch.fallbacks > fallbacks
    assert engine._batch.calls - calls < engine._batch.steps - steps
    assert engine._batch.peak_pages <= 12
    for prompt, completion in zip(prompts, together, strict=True):
        assert completion.tokens == plain.generate([prompt], config)[0].tokens


def test_update_weights_then_outputs_equal_transformers_on_the_new_weights(tmp_path: Path, model: Any) -> None:
    engine = Engine(model, **SMALL)
    other = write_tiny_llama(tmp_path / "other", seed=1, max_positions=64)
    config = GenerationConfig(max_new_tokens=8)
    engine.generate(PROMPTS, config)  # fills the prefix cache with the old weights' pages
    engine.update_weights(load_model(str(other))[0])
    for prompt, completion in zip(PROMPTS, engine.generate(PROMPTS, config), strict=True):
        assert completion.tokens == _hf_greedy(other, prompt, 8)


def test_bad_settings_name_the_key(model: Any) -> None:
    for kwargs, key in (
        ({"page_size": 0}, "page_size"),
        ({"prefill_chunk": 0}, "prefill_chunk"),
        ({"max_pages": 0}, "max_pages"),
        ({"max_pages": 4, "kv_cache_bytes": 1 << 20}, "max_pages, kv_cache_bytes"),
        ({"kv_cache_bytes": 10}, "kv_cache_bytes"),
    ):
        with pytest.raises(ValueError, match=key):
            Engine(model, **{**SMALL, **kwargs})
    small = Engine(model, **SMALL)
    with pytest.raises(ValueError, match=r"prompts\[0\]: 7 tokens and 42 new ones need 13 cache pages.*max_pages=12"):
        small.generate([PROMPTS[0]], GenerationConfig(max_new_tokens=42))


def test_page_pool_counts_references_and_evicts_the_least_recently_used() -> None:
    pool = PagePool(3)
    a, b, c = pool.allocate(), pool.allocate(), pool.allocate()
    assert pool.allocate() is None
    pool.register(1, a)
    pool.register(2, b)
    pool.release(a)
    pool.release(b)
    pool.release(c)  # not cached: free again
    assert pool.available == 3
    assert pool.cached == 2
    assert pool.lookup([1]) == [a]
    pool.release(a)  # the first prefix is now the most recently used
    assert pool.allocate() == c
    assert pool.allocate() == b
    assert pool.lookup([2]) == []
    assert pool.evictions == 1
    assert pool.reset_prefix_cache() == 1
    assert pool.available == 1


def test_a_latent_cache_runs_in_the_continuous_batch(tmp_path: Path) -> None:
    """DeepSeek-V3's multi-head latent attention caches latents as keys and rotary keys as values (another last axis):
    its pages hold both, and each request's greedy tokens equal ``transformers``' ``generate`` (decoding steps attend
    in the latent space, prompt chunks of 4 too)."""
    hf_config = transformers.DeepseekV3Config(
        vocab_size=64,
        max_position_embeddings=64,
        hidden_size=32,
        intermediate_size=48,
        moe_intermediate_size=12,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=4,
        n_routed_experts=4,
        num_experts_per_tok=2,
        n_group=1,
        topk_group=1,
        first_k_dense_replace=1,
        q_lora_rank=16,
        kv_lora_rank=12,
        qk_rope_head_dim=4,
        qk_nope_head_dim=8,
        v_head_dim=6,
        initializer_range=0.2,
        num_nextn_predict_layers=0,
        bos_token_id=None,
        eos_token_id=None,
        pad_token_id=0,
    )
    torch.manual_seed(0)
    hf = transformers.DeepseekV3ForCausalLM(hf_config).eval()
    hf.save_pretrained(tmp_path)
    model = load_model(str(tmp_path))[0]
    engine = Engine(model, **SMALL)
    assert engine.continuous
    # per token and layer: a latent of 12 and a rotary key of 4, float32
    assert engine.kv_bytes_per_token == 2 * (12 + 4) * 4
    prompts = [[p % 64 for p in prompt] for prompt in PROMPTS[:3]]
    completions = engine.generate(prompts, GenerationConfig(max_new_tokens=8))
    for prompt, completion in zip(prompts, completions, strict=True):
        with torch.no_grad():
            out = hf.generate(
                torch.tensor([prompt]),
                attention_mask=torch.ones((1, len(prompt)), dtype=torch.long),
                do_sample=False,
                max_new_tokens=8,
                min_new_tokens=8,
            )
        assert completion.tokens == out[0, len(prompt) :].tolist()
