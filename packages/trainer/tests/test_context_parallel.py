"""Context parallelism is a config change: a tiny Llama, a tiny Mistral (sliding window), a tiny DeepSeek-V3 (latent
attention, MoE) and a tiny gpt-oss (attention sinks, sliding and full layers, MoE) trained on packed documents
on 8 simulated devices with ``context_axis_size`` 4 (x data 2) give the losses and parameters of 1 device; bad
context keys fail naming the key.

Run in the multidevice session (8 simulated CPU devices), except the config checks.
"""

import jax
import numpy as np
import optax
import pytest

import ponente.namedtensor as hax
from ponente.models import DeepseekV3Config, GptOssConfig, LlamaConfig, MistralConfig
from ponente.trainer.tasks.lm import lm_batch, lm_loss_fn
from ponente.trainer.trainer import Trainer, TrainerConfig

BATCH = 4
STEPS = 2
SEQ = 512
Vocab = hax.Axis("vocab", 64)
SMALL = {"hidden_dim": 16, "intermediate_dim": 32, "num_layers": 2, "num_heads": 4, "num_kv_heads": 2}
MODELS = {
    "llama": LlamaConfig(seq_len=SEQ, **SMALL),
    "llama_ring": LlamaConfig(seq_len=SEQ, attention_context_parallel="ring", **SMALL),
    "mistral_sliding": MistralConfig(seq_len=SEQ, sliding_window=48, **SMALL),
    "mistral_sliding_ring": MistralConfig(seq_len=SEQ, sliding_window=48, attention_context_parallel="ring", **SMALL),
    # multi-head latent attention: per-head keys of 4 + 4, values of 4 (padded to 8); one dense block, then MoE
    "deepseek_v3_ring": DeepseekV3Config(
        seq_len=SEQ,
        attention_context_parallel="ring",
        **{**SMALL, "num_kv_heads": 4},
        num_experts=4,
        num_experts_per_tok=2,
        moe_intermediate_dim=8,
        n_group=2,
        topk_group=1,
        first_k_dense_replace=1,
        q_lora_rank=8,
        kv_lora_rank=8,
        qk_rope_head_dim=4,
        qk_nope_head_dim=4,
        v_head_dim=4,
    ),
}
# gpt-oss: attention sinks, alternating sliding-window (48) and full layers, MoE
MODELS["gpt_oss_ring"] = GptOssConfig(
    seq_len=SEQ,
    attention_context_parallel="ring",
    **SMALL,
    sliding_window=48,
    num_experts=4,
    num_experts_per_tok=2,
)
STACKS = {"deepseek_v3_ring": 2, "gpt_oss_ring": 2}
"""Models whose attention is traced twice (DeepSeek-V3: the dense first blocks, then the MoE blocks; gpt-oss: its
sliding-window and its full layers)."""


def batches(seq):
    """Packed documents: segment boundaries at random places in every row."""
    rng = np.random.default_rng(0)
    out = []
    for _ in range(STEPS):
        ids = rng.integers(0, Vocab.size, (BATCH, seq)).astype(np.int32)
        starts = np.zeros((BATCH, seq), np.int32)
        starts[:, rng.integers(1, seq, 6)] = 1
        out.append(lm_batch({"input_ids": ids, "segment_ids": np.cumsum(starts, axis=1).astype(np.int32)}))
    return out


def train(model, devices, context=1, loss_block_size="auto", **layout):
    config = TrainerConfig(
        train_batch_size=BATCH,
        num_train_steps=STEPS,
        compilation_cache_dir=None,
        progress_bar=False,
        context_axis_size=context,
        **layout,
    )
    loss = lm_loss_fn(context=context, block_size=loss_block_size)
    trainer = Trainer(config, optax.adam(1e-2), loss, devices=devices)
    state = trainer.initial_state(lambda key: model.build(Vocab, key=key))
    losses = []
    for batch in batches(model.seq_len):
        state, m = trainer.train_step(state, trainer.shard_batch(batch))
        losses.append(float(m["loss"]))
    return trainer, state, losses


def leaves(tree):
    return [np.asarray(x) for x in jax.tree_util.tree_leaves(tree)]


@pytest.mark.multidevice
@pytest.mark.parametrize("name", list(MODELS))
def test_context_parallel_trains_like_one_device(name, monkeypatch):
    assert len(jax.devices()) == 8, "run with XLA_FLAGS=--xla_force_host_platform_device_count=8"
    import ponente.models.attention._layer as layer

    calls = []
    split = layer.context_parallel_attention

    def spy(*args, **kwargs):
        calls.append((kwargs["mode"], kwargs["blockwise"]))
        return split(*args, **kwargs)

    monkeypatch.setattr(layer, "context_parallel_attention", spy)
    model = MODELS[name]
    _, ref_state, ref_losses = train(model, jax.devices()[:1])
    assert not calls  # one device: nothing split
    trainer, state, losses = train(model, jax.devices(), context=4)
    # each device attends its own rows, traced once per stack (the layers are scanned), in the mode asked for; at seq
    # 512 on a CPU, ``auto`` is the blockwise kernel
    assert calls == [(model.attention_context_parallel, True)] * STACKS.get(name, 1)
    assert trainer.mesh.shape["context"] == 4
    assert trainer.mesh.shape["data"] == 2
    np.testing.assert_allclose(losses, ref_losses, rtol=0, atol=1e-4)
    for got, want in zip(leaves(state.model), leaves(ref_state.model), strict=True):
        np.testing.assert_allclose(got, want, atol=1e-4)


@pytest.mark.multidevice
@pytest.mark.parametrize("mode", ["allgather", "ring"])
def test_context_composes_with_tensor_parallelism(mode):
    """context 2 x model 2 (tensor parallel MLP and key/value heads) x data 2, at a shorter length; with
    ``allgather``, the blockwise cross-entropy (16 vocabulary entries per block) on the permuted positions."""
    model = LlamaConfig(seq_len=64, attention_context_parallel=mode, **SMALL)
    block = 16 if mode == "allgather" else None
    _, ref_state, ref_losses = train(model, jax.devices()[:1], loss_block_size=None)
    trainer, state, losses = train(
        model,
        jax.devices(),
        context=2,
        loss_block_size=block,
        model_axis_size=2,
        tensor_parallel_axes=["mlp", "kv_heads"],
    )
    assert trainer.mesh.shape["model"] == 2
    np.testing.assert_allclose(losses, ref_losses, rtol=0, atol=1e-4)
    for got, want in zip(leaves(state.model), leaves(ref_state.model), strict=True):
        np.testing.assert_allclose(got, want, atol=1e-4)


def _bytes(tree):
    out = []
    for leaf in jax.tree_util.tree_leaves(tree):
        if isinstance(leaf, jax.Array) and jax.dtypes.issubdtype(leaf.dtype, jax.dtypes.prng_key):
            leaf = jax.random.key_data(leaf)
        if isinstance(leaf, jax.Array):
            out.append(np.asarray(leaf).tobytes())
    return out


@pytest.mark.multidevice
def test_resume_with_context_parallelism_is_bitwise(tmp_path):
    """2 steps straight vs 1 step, a checkpoint, a fresh load and 1 step, context 4 x data 2: the same bits."""
    from ponente.trainer.checkpoint import load_checkpoint, save_checkpoint

    model = LlamaConfig(seq_len=64, **SMALL)
    config = TrainerConfig(
        train_batch_size=BATCH,
        num_train_steps=STEPS,
        compilation_cache_dir=None,
        progress_bar=False,
        context_axis_size=4,
    )
    trainer = Trainer(config, optax.adam(1e-2), lm_loss_fn(context=4), devices=jax.devices())

    def build(key):
        return model.build(Vocab, key=key)

    data = [trainer.shard_batch(b) for b in batches(model.seq_len)]
    straight = trainer.initial_state(build)
    straight_losses = []
    for batch in data:
        straight, metrics = trainer.train_step(straight, batch)
        straight_losses.append(float(metrics["loss"]))
    resumed, metrics = trainer.train_step(trainer.initial_state(build), data[0])
    losses = [float(metrics["loss"])]
    save_checkpoint(resumed, tmp_path / "step-1", step=1)
    resumed = load_checkpoint(trainer.initial_state(build), tmp_path / "step-1")
    for batch in data[1:]:
        resumed, metrics = trainer.train_step(resumed, batch)
        losses.append(float(metrics["loss"]))
    assert losses == straight_losses
    assert _bytes(resumed) == _bytes(straight)


@pytest.mark.multidevice
def test_context_composes_with_expert_parallelism():
    """A tiny Mixtral with context 2 x expert 2 trains like 1 device.

    On 4 of the 8 simulated devices: with all 8 (context 2 x expert 2 x data 2) XLA:CPU deadlocks within a few
    steps. Its thunk executor hands a program's independent collectives to its worker pool, which has one thread per
    simulated device; each collective blocks its worker in the rendezvous, and once every worker waits, the devices
    still to arrive never get to run (1 in 5 test runs; 7 of 7 300-step loops within their first steps). A mesh of
    4 (4,500 steps), or of 8 out of 16 simulated devices (1,800 steps), never hung. GPUs and TPUs issue
    collectives in program order on streams, so this is the CPU backend's limitation.
    """
    from ponente.models import MixtralConfig

    model = MixtralConfig(seq_len=64, num_experts=4, num_experts_per_tok=2, **SMALL)
    _, ref_state, ref_losses = train(model, jax.devices()[:1])
    trainer, state, losses = train(model, jax.devices()[:4], context=2, expert_axis_size=2)
    assert (trainer.mesh.shape["context"], trainer.mesh.shape["expert"], trainer.mesh.shape["data"]) == (2, 2, 1)
    np.testing.assert_allclose(losses, ref_losses, rtol=0, atol=1e-4)
    for got, want in zip(leaves(state.model), leaves(ref_state.model), strict=True):
        np.testing.assert_allclose(got, want, atol=1e-4)


def test_context_keys_fail_naming_the_key():
    from ponente.models import Gpt2Config
    from ponente.trainer.run import check_context_parallel

    with pytest.raises(ValueError, match=r"trainer\.context_axis_size=4: the sequence length 100 .* 2 x 4 = 8"):
        check_context_parallel(MODELS["llama"], TrainerConfig(context_axis_size=4), 100)
    check_context_parallel(MODELS["llama"], TrainerConfig(context_axis_size=4), SEQ)
    check_context_parallel(Gpt2Config(seq_len=64), TrainerConfig(context_axis_size=2), 64)

    class NoPosition:
        pass

    with pytest.raises(ValueError, match=r"trainer\.context_axis_size=2: model type NoPosition has no 'position'"):
        check_context_parallel(NoPosition(), TrainerConfig(context_axis_size=2), 64)
    with pytest.raises(ValueError, match=r"attention_context_parallel 'rings' is not supported"):
        LlamaConfig(attention_context_parallel="rings")
    with pytest.raises(ValueError, match=r"trainer\.context_axis_size must be >= 1"):
        TrainerConfig(context_axis_size=0)
    from ponente.trainer.run._startup import resolve_train_batch_size

    # batch -1: one sequence per data shard; the 4 devices of a context group share a sequence
    auto = TrainerConfig(train_batch_size=-1, per_device_parallelism=1, context_axis_size=4)
    assert resolve_train_batch_size(auto, 8).train_batch_size == 2
    assert TrainerConfig(context_axis_size=2).compute_axis_mapping["position"] == "context"
    assert "position" not in TrainerConfig(context_axis_size=2).parameter_axis_mapping


def test_the_server_refuses_context_parallelism():
    from ponente.trainer.main.serve import ServeConfig

    with pytest.raises(ValueError, match=r"^context_axis_size=2: context parallelism is for training only"):
        ServeConfig(hf_checkpoint="model", context_axis_size=2)
    assert ServeConfig(hf_checkpoint="model").context_axis_size == 1
