"""Optimizer-state memory of LoRA vs full fine-tuning of the same Llama: the base holds no optimizer state.

For each shape the suite builds the Trainer's initial state twice with the same AdamW optimizer: full
fine-tuning (every floating parameter trains) and LoRA (``ponente.models.lora.loraize`` with the default
``LoraConfig``: rank 8 on every linear of the attention and the MLP, the base frozen by
``Trainer.initial_state(..., is_trainable=lora_trainable_filter(model))``). Recorded per shape: the bytes of the
optimizer state (``opt_state``) of each and their ratio, the trainable parameter counts, the bytes of the whole
state (model + optimizer state; the frozen base is in both), and the ratio expected if the optimizer state is
proportional to the trainable parameters alone (adapter parameters / all parameters of the full model). Target:
the two ratios agree within 1 % (AdamW's step counter is the only state not proportional to the parameters).

Shapes: ``small`` (hidden 256, 4 layers, vocab 4096) is built for real, so its bytes are those of arrays on the
device; ``llama2-7b`` (Llama-2-7B: hidden 4096, MLP 11008, 32 layers, 32 heads, vocab 32000) is built abstractly:
``ponente.trainer.state.init_state`` (what ``Trainer.initial_state`` compiles) under ``equinox.filter_eval_shape``,
so no memory is allocated and it runs on any machine.
Knob: ``PONENTE_BENCH_LORA_SHAPES`` (comma-separated subset of ``small,llama2-7b``; default both).
"""

from __future__ import annotations

import os
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import equinox as eqx
import jax
import numpy as np
import optax

import ponente.namedtensor as hax
from ponente.models import LlamaConfig
from ponente.models.lora import LoraConfig, lora_trainable_filter, loraize
from ponente.trainer.state import init_state
from ponente.trainer.trainer import Trainer, TrainerConfig

if TYPE_CHECKING:
    from benchmarks.harness import Recorder

SHAPES: dict[str, tuple[LlamaConfig, int, bool]] = {
    "small": (
        LlamaConfig(seq_len=128, hidden_dim=256, intermediate_dim=688, num_layers=4, num_heads=8, num_kv_heads=8),
        4096,
        False,
    ),
    "llama2-7b": (
        LlamaConfig(
            seq_len=4096, hidden_dim=4096, intermediate_dim=11008, num_layers=32, num_heads=32, num_kv_heads=32
        ),
        32000,
        True,
    ),
}
"""name -> (model config, vocabulary size, build abstractly under ``jax.eval_shape``)."""


def _bytes(tree: Any) -> int:
    """Bytes of the array leaves of a pytree (concrete arrays or ``jax.ShapeDtypeStruct``)."""
    leaves = jax.tree_util.tree_leaves(tree)
    return sum(int(np.prod(x.shape)) * np.dtype(x.dtype).itemsize for x in leaves if hasattr(x, "dtype"))


def _count(tree: Any) -> int:
    """Number of elements of the floating-point leaves of a pytree."""
    leaves = jax.tree_util.tree_leaves(tree)
    return sum(int(np.prod(x.shape)) for x in leaves if hasattr(x, "dtype") and np.issubdtype(x.dtype, np.floating))


def _state(
    trainer: Trainer,
    optimizer: optax.GradientTransformation,
    init: Callable[[jax.Array], Any],
    trainable: Any,
    abstract: bool,
) -> Any:
    """The initial training state: ``Trainer.initial_state``, or abstractly the ``init_state`` it runs."""
    key = jax.random.PRNGKey(0)
    if not abstract:
        return trainer.initial_state(init, key=key, is_trainable=trainable)
    # Trainer.initial_state enters its mesh, which cannot happen under a trace; its compiled body is init_state
    return eqx.filter_eval_shape(lambda: init_state(init(key), optimizer, key, is_trainable=trainable))


def run(rec: Recorder) -> None:
    """Record the optimizer-state bytes of LoRA and full fine-tuning for each shape, and their ratio.

    Raises:
        ValueError: if ``PONENTE_BENCH_LORA_SHAPES`` names an unknown shape.
    """
    chosen = [s.strip() for s in os.environ.get("PONENTE_BENCH_LORA_SHAPES", ",".join(SHAPES)).split(",")]
    unknown = [s for s in chosen if s not in SHAPES]
    if unknown:
        raise ValueError(f"PONENTE_BENCH_LORA_SHAPES: unknown shapes {unknown}; choose among {list(SHAPES)}")
    lora = LoraConfig()
    optimizer = optax.adamw(1e-4, weight_decay=0.0)
    trainer = Trainer(
        TrainerConfig(train_batch_size=1, num_train_steps=1, compilation_cache_dir=None, progress_bar=False),
        optimizer,
        lambda model, batch, *, key: 0.0,  # never called: only the initial states are built
    )
    for name in chosen:
        cfg, vocab, abstract = SHAPES[name]
        Vocab = hax.Axis("vocab", vocab)

        def full_init(key: jax.Array, cfg: LlamaConfig = cfg, Vocab: hax.Axis = Vocab) -> Any:
            return cfg.build(Vocab, key=key)

        def lora_init(key: jax.Array, cfg: LlamaConfig = cfg, Vocab: hax.Axis = Vocab) -> Any:
            base_key, lora_key = jax.random.split(key)
            return loraize(cfg.build(Vocab, key=base_key), lora, key=lora_key)

        # the filter only depends on the model's structure: take it from an abstract build
        trainable = lora_trainable_filter(jax.eval_shape(lora_init, jax.random.PRNGKey(0)))
        full = _state(trainer, optimizer, full_init, True, abstract)
        adapted = _state(trainer, optimizer, lora_init, trainable, abstract)
        full_bytes, lora_bytes = _bytes(full.opt_state), _bytes(adapted.opt_state)
        all_params = _count(full.model)
        adapter_params = _count(eqx.filter(adapted.model, trainable))
        extra = {
            "hidden": cfg.hidden_dim,
            "layers": cfg.num_layers,
            "vocab": vocab,
            "lora_r": lora.r,
            "target_modules": "attention+mlp" if lora.target_modules is None else str(lora.target_modules),
            "optimizer": "adamw",
            "abstract": abstract,
        }
        rec.record(f"{name}/full", "opt_state_memory", full_bytes, "bytes", trainable_params=all_params, **extra)
        rec.record(f"{name}/lora", "opt_state_memory", lora_bytes, "bytes", trainable_params=adapter_params, **extra)
        expected = adapter_params / all_params
        rec.record(f"{name}/full", "state_memory", _bytes(full.model) + full_bytes, "bytes", **extra)
        rec.record(f"{name}/lora", "state_memory", _bytes(adapted.model) + lora_bytes, "bytes", **extra)
        rec.record(name, "adapter_param_ratio", expected, "lora/full", **extra)
        rec.record(
            name, "opt_state_memory_ratio", lora_bytes / full_bytes, "lora/full", target=f"~ {expected:.5f}", **extra
        )
