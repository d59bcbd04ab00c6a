"""Expert parallelism of a mixture of experts: compiled FLOPs, the collectives in the program, and training throughput.

Needs several devices: on a CPU run it with ``XLA_FLAGS=--xla_force_host_platform_device_count=8``.

1. One MoE layer (``MoeMlp``: 8 experts, k=2, embed 256, expert hidden 512, 8 x 256 tokens), forward + backward of a
   scalar loss, compiled on a mesh ``{"expert": 8}`` with the batch and the ``experts`` axis split over it. XLA's cost
   analysis gives the FLOPs per device of the ``expert_parallel`` dispatch (dropless, and ``capacity_factor`` 1.25)
   and of the ``dense`` one; each is divided by the sparse count (``3 x (6 k embed mlp + 2 E embed)`` per token,
   divided by the devices); target for ``expert_parallel``: <= 1.3. The compiled program of the expert-parallel
   dispatch must hold all-to-alls and no all-gather of expert weights (recorded as counts).
2. A small Mixtral (hidden 128, 2 layers, 8 experts, k=2, seq 128, batch 16) trained by the ``Trainer`` on all the
   devices with ``trainer.expert_axis_size`` 1, 2 and 4: tokens/s (``PONENTE_BENCH_STEPS`` timed steps, default 5).
"""

from __future__ import annotations

import re
import time
from typing import TYPE_CHECKING, Any

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import optax

import ponente.namedtensor as hax
from ponente.models import MixtralConfig, compute_next_token_loss_and_aux
from ponente.models.moe import MoeMlp
from ponente.trainer.tasks.lm import lm_batch
from ponente.trainer.trainer import Trainer, TrainerConfig

if TYPE_CHECKING:
    from benchmarks.harness import Recorder

EXPERTS, K, EMBED, MLP, BATCH, SEQ = 8, 2, 256, 512, 8, 256


def _layer_step(dispatch: str, capacity_factor: float | None, mesh: Any) -> tuple[float, str]:
    """FLOPs per device and compiled HLO of one MoE layer's forward + backward on ``mesh``."""
    Embed, Mlp, E = hax.Axis("embed", EMBED), hax.Axis("mlp", MLP), hax.Axis("experts", EXPERTS)
    layer = MoeMlp.init(Embed, Mlp, E, K, key=jax.random.key(0), dispatch=dispatch, capacity_factor=capacity_factor)
    x = hax.random.normal(jax.random.key(1), (hax.Axis("batch", BATCH), hax.Axis("position", SEQ), Embed))
    mapping = {"batch": "expert", "experts": "expert"}

    def loss(layer: MoeMlp, x: hax.NamedArray) -> jax.Array:
        return jnp.mean(jnp.square(layer(x)[0].array))

    @hax.named_jit(axis_resources=mapping)
    def step(layer: MoeMlp, x: hax.NamedArray) -> Any:
        return eqx.filter_grad(loss)(layer, hax.shard(x, mapping))

    with hax.partitioning.set_mesh(mesh):
        compiled = step.lower(layer, x).compile()
    cost = compiled.cost_analysis()
    cost = cost[0] if isinstance(cost, list) else cost
    return float(cost["flops"]), compiled.as_text()


def _expert_weight_gathers(hlo: str) -> int:
    """All-gathers whose result has the size of a whole expert weight (``experts x embed x mlp``)."""
    whole = EXPERTS * EMBED * MLP
    count = 0
    for dims in re.findall(r"= \w+\[([\d,]*)\][^ ]* all-gather", hlo):
        if dims and int(np.prod([int(d) for d in dims.split(",")])) == whole:
            count += 1
    return count


def _flops(rec: Recorder) -> None:
    devices = jax.device_count()
    mesh = hax.partitioning.make_mesh({"expert": devices})
    tokens = BATCH * SEQ
    sparse = 3 * tokens * (6 * K * EMBED * MLP + 2 * EXPERTS * EMBED) / devices
    shape = {"experts": EXPERTS, "k": K, "embed": EMBED, "mlp": MLP, "tokens": tokens, "devices": devices}
    for name, dispatch, capacity in (
        ("expert_parallel_dropless", "expert_parallel", None),
        ("expert_parallel_capacity_1.25", "expert_parallel", 1.25),
        ("dense", "dense", None),
    ):
        flops, hlo = _layer_step(dispatch, capacity, mesh)
        all_to_all = len(re.findall(r" all-to-all\(", hlo)) + len(re.findall(r" all-to-all-start\(", hlo))
        if dispatch == "expert_parallel" and (all_to_all == 0 or _expert_weight_gathers(hlo)):
            raise RuntimeError(f"{name}: expected all-to-alls and no all-gather of expert weights in the program")
        rec.record(
            f"layer_{name}",
            "flops_over_sparse",
            flops / sparse,
            "ratio",
            flops_per_device=flops,
            sparse_flops_per_device=sparse,
            all_to_all=all_to_all,
            all_gather=len(re.findall(r" all-gather(-start)?\(", hlo)),
            expert_weight_all_gathers=_expert_weight_gathers(hlo),
            **shape,
        )


def _throughput(rec: Recorder, steps: int) -> None:
    cfg = MixtralConfig(
        seq_len=128, hidden_dim=128, intermediate_dim=256, num_layers=2, num_heads=4, num_kv_heads=2, num_experts=8
    )
    vocab, batch = 1024, 16
    ids = np.random.default_rng(0).integers(0, vocab, (batch, cfg.seq_len)).astype(np.int32)
    rows = {"input_ids": ids, "segment_ids": np.zeros_like(ids)}

    def loss_fn(model: Any, b: Any, *, key: Any) -> Any:
        from ponente.trainer.tasks.lm import lm_example

        return compute_next_token_loss_and_aux(model, lm_example(b), key=key)

    for expert in (1, 2, 4):
        if jax.device_count() % expert:
            continue
        trainer = Trainer(
            TrainerConfig(
                train_batch_size=batch,
                num_train_steps=10**6,
                expert_axis_size=expert,
                compilation_cache_dir=None,
                progress_bar=False,
            ),
            optax.adamw(1e-4),
            loss_fn,
        )
        state = trainer.initial_state(lambda k: cfg.build(hax.Axis("vocab", vocab), key=k), key=jax.random.key(0))
        example = trainer.shard_batch(lm_batch(rows))
        for _ in range(2):  # compile and warm up
            state, metrics = trainer.train_step(state, example)
        jax.block_until_ready(metrics["loss"])
        start = time.perf_counter()
        for _ in range(steps):
            state, metrics = trainer.train_step(state, example)
        jax.block_until_ready(metrics["loss"])
        seconds = (time.perf_counter() - start) / steps
        rec.record(
            f"mixtral_small_expert{expert}",
            "tokens_per_s",
            batch * cfg.seq_len / seconds,
            "tokens/s",
            step_s=seconds,
            devices=jax.device_count(),
            expert_axis_size=expert,
            platform=jax.default_backend(),
        )


def run(rec: Recorder) -> None:
    """The layer's FLOPs and collectives, then the small Mixtral's tokens/s per expert-axis size."""
    import os

    if jax.device_count() < 2:
        raise RuntimeError(
            "the moe suite needs several devices; on a CPU set XLA_FLAGS=--xla_force_host_platform_device_count=8"
        )
    _flops(rec)
    _throughput(rec, int(os.environ.get("PONENTE_BENCH_STEPS", "5")))
