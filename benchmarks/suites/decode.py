"""Decode throughput of the generation engine: vs ``transformers`` ``generate`` and vs the no-cache sampler.

One random model per architecture of ``PONENTE_BENCH_DECODE_ARCHS`` (comma-separated, default ``llama``; also
``gemma2``: local/global layers with a 256-token window, attention and final soft caps; ``gpt2``: learned positions;
``deepseek_v3``: multi-head latent attention with a latent cache of 64 + 16 per token (heads of 32 + 16 for keys,
32 for values), 8 experts of 128, top-2, the first block dense;
``PONENTE_BENCH_DECODE_SIZE``: ``small`` = hidden 256, 4 layers, 8 heads / 4 KV heads (GPT-2: 8 heads;
DeepSeek-V3: 8 / 8), vocab 4096, 512 positions; ``tiny`` = hidden 64, 2 layers) is written with ``transformers``'
``save_pretrained`` and loaded into Ponente with ``ponente.models.hf.load_pretrained``, so both sides run the same
weights in float32. Records of
other architectures than Llama carry the architecture as a name prefix (``gemma2-engine-vs-sample-tokens``).

- ``engine-vs-transformers``: batch 8, prompts of 16 random tokens, greedy, 128 new tokens (no stop token):
  ``Engine.generate`` vs ``transformers`` ``generate(do_sample=False, min_new_tokens=128)`` with its KV cache;
  generated tokens/s of each (compilation excluded: one warm-up call), the outputs checked equal, and the ratio
  (target >= 1).
- ``engine-vs-sample-tokens``: one prompt of 384 tokens continued by 128 (the 512-token window of the no-cache
  ``ponente.trainer.sample.sample_tokens``, which runs the whole window per token): tokens/s of both and the
  ratio (target >= 20).

- ``deepseek_v3-latent-vs-expanded`` (DeepSeek-V3 only): the 384 + 128 run of the engine with
  ``mla_absorb: auto`` (decoding steps attend in the latent space, ``kv_b_proj`` absorbed) vs ``never`` (every step
  expands the cached latents per head): tokens/s of both, the outputs checked equal, and the ratio.

Each side is timed ``PONENTE_BENCH_REPEAT`` times (default 3), alternating, and the median counts.
"""

from __future__ import annotations

import os
import statistics
import tempfile
import time
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import jax
import numpy as np

if TYPE_CHECKING:
    from benchmarks.harness import Recorder

SIZES = {
    "small": {"hidden_size": 256, "intermediate_size": 704, "num_hidden_layers": 4, "heads": 8, "kv": 4},
    "tiny": {"hidden_size": 64, "intermediate_size": 176, "num_hidden_layers": 2, "heads": 4, "kv": 2},
}
VOCAB = 4096
POSITIONS = 512
NEW_TOKENS = 128


def _hf_model(size: str, arch: str = "llama") -> Any:
    import torch
    import transformers

    s = SIZES[size]
    common: dict[str, Any] = {"vocab_size": VOCAB, "bos_token_id": None, "eos_token_id": None, "pad_token_id": 0}
    if arch == "gpt2":
        config: Any = transformers.GPT2Config(
            n_embd=s["hidden_size"],
            n_layer=s["num_hidden_layers"],
            n_head=s["heads"],
            n_positions=POSITIONS,
            **common,
        )
        cls: Any = transformers.GPT2LMHeadModel
    else:
        sizes: dict[str, Any] = {
            "hidden_size": s["hidden_size"],
            "intermediate_size": s["intermediate_size"],
            "num_hidden_layers": s["num_hidden_layers"],
            "num_attention_heads": s["heads"],
            "num_key_value_heads": s["kv"],
            "max_position_embeddings": POSITIONS,
        }
        if arch == "gemma2":
            head_dim = s["hidden_size"] // s["heads"]
            config = transformers.Gemma2Config(
                head_dim=head_dim, query_pre_attn_scalar=head_dim, sliding_window=POSITIONS // 2, **sizes, **common
            )
            cls = transformers.Gemma2ForCausalLM
        elif arch == "llama":
            config = transformers.LlamaConfig(**sizes, **common)
            cls = transformers.LlamaForCausalLM
        elif arch == "deepseek_v3":
            deepseek: dict[str, Any] = {
                **sizes,
                "num_key_value_heads": s["heads"],
                "kv_lora_rank": 64,
                "qk_nope_head_dim": 32,
                "qk_rope_head_dim": 16,
                "v_head_dim": 32,
                "q_lora_rank": 64,
                "n_routed_experts": 8,
                "num_experts_per_tok": 2,
                "n_group": 2,
                "topk_group": 1,
                "moe_intermediate_size": 128,
                "first_k_dense_replace": 1,
                "num_nextn_predict_layers": 0,
            }
            config = transformers.DeepseekV3Config(**deepseek, **common)
            cls = transformers.DeepseekV3ForCausalLM
        else:
            raise ValueError(
                f"PONENTE_BENCH_DECODE_ARCHS: unknown architecture {arch!r} (llama, gemma2, gpt2, deepseek_v3)"
            )
    torch.manual_seed(0)
    model = cls(config)
    with torch.no_grad():  # decisive logits: greedy outputs comparable across implementations
        model.get_output_embeddings().weight.mul_(10.0)
    return model.eval()


def _alternating_medians(fns: dict[str, Callable[[], Any]], repeat: int) -> dict[str, float]:
    times: dict[str, list[float]] = {name: [] for name in fns}
    for r in range(repeat):
        for name in list(fns)[r % len(fns) :] + list(fns)[: r % len(fns)]:
            start = time.perf_counter()
            fns[name]()
            times[name].append(time.perf_counter() - start)
    return {name: statistics.median(t) for name, t in times.items()}


def run(rec: Recorder) -> None:
    """Measure decode tokens/s of the engine, of ``transformers`` and of the no-cache sampler."""
    size = os.environ.get("PONENTE_BENCH_DECODE_SIZE", "small")
    repeat = int(os.environ.get("PONENTE_BENCH_REPEAT", "3"))
    for arch in os.environ.get("PONENTE_BENCH_DECODE_ARCHS", "llama").split(","):
        _run_arch(rec, arch.strip(), size, repeat)


def _run_arch(rec: Recorder, arch: str, size: str, repeat: int) -> None:
    """Both measurements for one architecture."""
    import torch

    from ponente.models import LmHeadModel
    from ponente.models.hf import load_pretrained
    from ponente.trainer.inference import Engine, GenerationConfig
    from ponente.trainer.sample import sample_tokens

    prefix = "" if arch == "llama" else f"{arch}-"
    hf = _hf_model(size, arch)
    with tempfile.TemporaryDirectory() as folder:
        hf.save_pretrained(folder)
        model = load_pretrained(folder)
        # DeepSeek-V3: the same weights with every cached step expanding the latents (the latent-space comparison)
        expanded = load_pretrained(folder, config_overrides={"mla_absorb": "never"}) if arch == "deepseek_v3" else None
    if not isinstance(model, LmHeadModel):
        raise TypeError(f"{arch}: expected a language model, got {type(model).__name__}")
    rng = np.random.RandomState(0)
    extra = {"size": size, "arch": arch, "backend": jax.default_backend(), "torch_threads": torch.get_num_threads()}

    # batch 8, short prompts, 128 greedy tokens: the engine vs transformers' generate (both with a KV cache)
    prompts = rng.randint(1, VOCAB, size=(8, 16))
    engine = Engine(model, max_batch_size=8)
    config = GenerationConfig(max_new_tokens=NEW_TOKENS)
    ours: list[Any] = []
    theirs: list[Any] = []

    def engine_batch() -> None:
        ours[:] = engine.generate([list(p) for p in prompts], config)

    def hf_batch() -> None:
        with torch.no_grad():
            out = hf.generate(
                torch.tensor(prompts),
                attention_mask=torch.ones(prompts.shape, dtype=torch.long),
                do_sample=False,
                max_new_tokens=NEW_TOKENS,
                min_new_tokens=NEW_TOKENS,
            )
        theirs[:] = out[:, prompts.shape[1] :].tolist()

    engine_batch()
    hf_batch()  # warm-up (compilation, allocations)
    same = sum(c.tokens == t for c, t in zip(ours, theirs, strict=True))
    medians = _alternating_medians({"engine": engine_batch, "transformers": hf_batch}, repeat)
    tokens = prompts.shape[0] * NEW_TOKENS
    for name, seconds in medians.items():
        rec.record(f"{prefix}batch8-{name}", "tokens_per_s", tokens / seconds, "tokens/s", **extra)
    rec.record(
        f"{prefix}engine-vs-transformers",
        "ratio",
        medians["transformers"] / medians["engine"],
        "x",
        target=">= 1",
        rows_equal=f"{same}/{len(ours)}",
        **extra,
    )

    # one 384-token prompt + 128 tokens: the engine vs the no-cache sampler over its 512-token window
    prompt = [int(t) for t in rng.randint(1, VOCAB, size=POSITIONS - NEW_TOKENS)]
    single = Engine(model, max_batch_size=1)
    key = jax.random.PRNGKey(0)

    def engine_one() -> None:
        single.generate([prompt], config)

    def no_cache() -> None:
        sample_tokens(model, prompt, num_tokens=NEW_TOKENS, key=key, temperature=0.0)

    engine_one()
    no_cache()
    medians = _alternating_medians({"engine": engine_one, "sample_tokens": no_cache}, repeat)
    for name, seconds in medians.items():
        rec.record(f"{prefix}context512-{name}", "tokens_per_s", NEW_TOKENS / seconds, "tokens/s", **extra)
    rec.record(
        f"{prefix}engine-vs-sample-tokens",
        "ratio",
        medians["sample_tokens"] / medians["engine"],
        "x",
        target=">= 20",
        **extra,
    )
    if expanded is None:
        return
    if not isinstance(expanded, LmHeadModel):
        raise TypeError(f"{arch}: expected a language model, got {type(expanded).__name__}")
    outputs: dict[str, list[int]] = {}
    engines = {"latent": single, "expanded": Engine(expanded, max_batch_size=1)}

    def one(name: str) -> Callable[[], None]:
        def go() -> None:
            outputs[name] = engines[name].generate([prompt], config)[0].tokens

        return go

    fns = {name: one(name) for name in engines}
    for fn in fns.values():
        fn()
    medians = _alternating_medians(fns, repeat)
    for name, seconds in medians.items():
        rec.record(f"{prefix}context512-{name}", "tokens_per_s", NEW_TOKENS / seconds, "tokens/s", **extra)
    rec.record(
        f"{prefix}latent-vs-expanded",
        "ratio",
        medians["expanded"] / medians["latent"],
        "x",
        same_tokens=outputs["latent"] == outputs["expanded"],
        **extra,
    )
