"""Training a small transformer on 8 simulated devices with FSDP, tensor parallelism and both.

Run with ``XLA_FLAGS=--xla_force_host_platform_device_count=8 python -m pytest -m multidevice``.
Every configuration must give the losses of a one-device run (within 1e-5), and its parameters and
activations must carry the shardings the mappings ask for.
"""

import pathlib
import re

import equinox as eqx
import jax
import numpy as np
import pytest

import ponente.namedtensor as hax
import ponente.namedtensor.partitioning as P
from ponente.namedtensor import Axis, NamedArray
from ponente.namedtensor.nn import Embedding, Linear, RmsNorm, Stacked
from ponente.namedtensor.nn.attention import causal_mask, dot_product_attention
from ponente.namedtensor.nn.functional import one_hot
from ponente.namedtensor.nn.loss import cross_entropy_loss

pytestmark = pytest.mark.multidevice

Vocab, Embed, Heads, Head = Axis("vocab", 32), Axis("embed", 16), Axis("heads", 8), Axis("head", 2)
Mlp, Layers, Batch = Axis("mlp", 32), Axis("layers", 2), Axis("batch", 8)
Pos, KPos = Axis("position", 4), Axis("key_position", 4)

# shard shapes of the MLP hidden activation (batch, position, mlp), recorded while compiling
ACTIVATION_SHARDS: list[tuple[int, ...]] = []


class Block(eqx.Module):
    ln1: RmsNorm
    q: Linear
    k: Linear
    v: Linear
    o: Linear
    ln2: RmsNorm
    up: Linear
    down: Linear

    @staticmethod
    def init(*, key: jax.Array) -> "Block":
        k = jax.random.split(key, 6)
        return Block(
            RmsNorm.init(Embed, use_bias=False),
            Linear.init(Embed, (Heads, Head), key=k[0]),
            Linear.init(Embed, (Heads, Head), key=k[1]),
            Linear.init(Embed, (Heads, Head), key=k[2]),
            Linear.init((Heads, Head), Embed, key=k[3]),
            RmsNorm.init(Embed, use_bias=False),
            Linear.init(Embed, Mlp, key=k[4]),
            Linear.init(Mlp, Embed, key=k[5]),
        )

    def __call__(self, x: NamedArray, mask: NamedArray) -> NamedArray:
        h = self.ln1(x)
        keys = self.k(h).rename({"position": "key_position"})
        values = self.v(h).rename({"position": "key_position"})
        x = x + self.o(dot_product_attention("key_position", "head", self.q(h), keys, values, mask=mask))
        hidden = hax.nn.gelu(self.up(self.ln2(x)))
        jax.debug.inspect_array_sharding(
            hidden.array, callback=lambda s: ACTIVATION_SHARDS.append(tuple(s.shard_shape(hidden.array.shape)))
        )
        return P.auto_sharded(x + self.down(hidden))


class Tiny(eqx.Module):
    embed: Embedding
    blocks: Stacked[Block]
    ln: RmsNorm

    @staticmethod
    def init(key: jax.Array) -> "Tiny":
        k1, k2 = jax.random.split(key)
        blocks = Stacked.init(Layers, Block, gradient_checkpointing=True)(key=jax.random.split(k2, Layers.size))
        return Tiny(Embedding.init(Vocab, Embed, key=k1), blocks, RmsNorm.init(Embed, use_bias=False))

    def __call__(self, ids: NamedArray) -> NamedArray:
        x = self.blocks.fold(self.embed.embed(ids), causal_mask(Pos, KPos))
        return self.embed.unembed(self.ln(x))


def loss_fn(model: Tiny, ids: NamedArray, targets: NamedArray) -> jax.Array:
    return cross_entropy_loss(model(ids), Vocab, one_hot(targets, Vocab)).scalar()


def sgd_step(model: Tiny, ids: NamedArray, targets: NamedArray) -> tuple[Tiny, jax.Array]:
    loss, grads = eqx.filter_value_and_grad(loss_fn)(model, ids, targets)
    return eqx.apply_updates(model, jax.tree_util.tree_map(lambda g: -0.5 * g, grads)), loss


def _data() -> tuple[NamedArray, NamedArray]:
    tokens = np.random.default_rng(0).integers(0, Vocab.size, size=(Batch.size, Pos.size + 1))
    return hax.named(tokens[:, :-1], ("batch", "position")), hax.named(tokens[:, 1:], ("batch", "position"))


def train(mesh_axes, param_mapping, compute_mapping, devices=None, steps=3):
    ACTIVATION_SHARDS.clear()
    mesh = P.make_mesh(mesh_axes, devices=devices)
    with jax.set_mesh(mesh):
        model = P.named_jit(Tiny.init, axis_resources=param_mapping)(jax.random.key(0))
        ids, targets = P.shard(_data(), compute_mapping)
        step = P.named_jit(
            sgd_step,
            compute_mapping,
            in_axis_resources=param_mapping,
            out_axis_resources=param_mapping,
            donate_args=(True, False, False),
        )
        losses = []
        for _ in range(steps):
            model, loss = step(model, ids, targets)
            losses.append(float(loss))
    return model, losses, mesh


@pytest.fixture(scope="module")
def reference_losses():
    if len(jax.devices()) < 8:
        pytest.fail("multidevice tests need XLA_FLAGS=--xla_force_host_platform_device_count=8")
    _, losses, _ = train({"data": 1, "model": 1}, {}, {}, devices=jax.devices()[:1])
    assert losses[-1] < losses[0]  # it trains
    return losses


def _shard_shape(x: NamedArray) -> tuple[int, ...]:
    shapes = {tuple(s.data.shape) for s in x.array.addressable_shards}
    assert len(shapes) == 1
    return shapes.pop()


CONFIGS = {
    "fsdp": ({"data": 8, "model": 1}, {"embed": "data"}, {"batch": "data"}),
    "tensor_parallel": (
        {"data": 1, "model": 8},
        {"mlp": "model", "heads": "model"},
        {"mlp": "model", "heads": "model"},
    ),
    "both": (
        {"data": 2, "model": 4},
        {"embed": "data", "mlp": "model", "heads": "model"},
        {"batch": "data", "mlp": "model", "heads": "model"},
    ),
}

# expected shard shapes: up.weight (layers, mlp, embed), q.weight (layers, heads, head, embed),
# embedding table (vocab, embed), MLP hidden activation (batch, position, mlp)
EXPECTED = {
    "fsdp": {"up": (2, 32, 2), "q": (2, 8, 2, 2), "table": (32, 2), "hidden": (1, 4, 32)},
    "tensor_parallel": {"up": (2, 4, 16), "q": (2, 1, 2, 16), "table": (32, 16), "hidden": (8, 4, 4)},
    "both": {"up": (2, 8, 8), "q": (2, 2, 2, 8), "table": (32, 8), "hidden": (4, 4, 8)},
}


@pytest.mark.parametrize("name", list(CONFIGS))
def test_sharded_training_matches_one_device(name, reference_losses):
    mesh_axes, param_mapping, compute_mapping = CONFIGS[name]
    model, losses, mesh = train(mesh_axes, param_mapping, compute_mapping)
    np.testing.assert_allclose(losses, reference_losses, rtol=1e-5, atol=1e-5)
    expected = EXPECTED[name]
    up = model.blocks.stacked.up.weight
    assert up.axis_names == ("layers", "mlp", "embed")
    assert _shard_shape(up) == expected["up"]
    assert _shard_shape(model.blocks.stacked.q.weight) == expected["q"]
    assert _shard_shape(model.embed.weight) == expected["table"]
    assert ACTIVATION_SHARDS
    assert set(ACTIVATION_SHARDS) == {expected["hidden"]}
    assert up.array.sharding.mesh == mesh


def test_uneven_sharding_is_a_clear_error():
    mesh = P.make_mesh({"data": 8})
    with pytest.raises(ValueError, match="cannot shard axis 'vocab' of size 10 over mesh axes \\('data',\\)"):
        P.shard(hax.zeros({"vocab": 10}), {"vocab": "data"}, mesh)
    rounded = P.round_axis_for_partitioning(Axis("vocab", 10), {"vocab": "data"}, mesh=mesh)
    assert rounded.size == 16
    assert _shard_shape(P.shard(hax.zeros(rounded), {"vocab": "data"}, mesh)) == (2,)


def _page_blocks(page: pathlib.Path) -> list[str]:
    return re.findall(r"^```python\n(.*?)^```", page.read_text(), re.S | re.M)


def test_canonical_fsdp_recipe_from_the_docs(reference_losses):
    page = pathlib.Path(__file__).parents[3] / "docs" / "namedtensor" / "docs" / "guide-partitioning.md"
    text = page.read_text()
    assert "<!-- canonical-fsdp-recipe -->\n```python" in text
    namespace: dict = {"__name__": "__docs__"}
    for code in _page_blocks(page):
        exec(compile(code, str(page), "exec", dont_inherit=True), namespace)
        if "param_mapping = " in code and "losses" in code and "recipe" not in namespace:
            namespace["recipe"] = (namespace["model"], list(namespace["losses"]))
    model, losses = namespace["recipe"]
    # parameters are stored split along embed over all 8 devices
    assert model.up.weight.axis_names == ("mlp", "embed")
    assert _shard_shape(model.up.weight) == (32, 2)
    assert _shard_shape(model.down.weight) == (2, 32)
    # the same three steps on one device, with plain equinox jit
    one = jax.devices()[0]
    ref_model = jax.device_put(namespace["MLP"].init(key=jax.random.key(0)), one)
    x = jax.device_put(hax.random.normal(jax.random.key(1), (namespace["Batch"], namespace["Embed"])), one)
    step = eqx.filter_jit(namespace["sgd_step"])
    ref_losses = []
    for _ in range(3):
        ref_model, loss = step(ref_model, x)
        ref_losses.append(float(loss))
    np.testing.assert_allclose(losses, ref_losses, rtol=1e-5, atol=1e-6)
    # the page's tensor-parallel and combined runs agree with FSDP too
    np.testing.assert_allclose(namespace["tp_losses"], ref_losses, rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(namespace["both_losses"], ref_losses, rtol=1e-5, atol=1e-6)
    assert _shard_shape(namespace["tp_model"].up.weight) == (4, 16)
    assert _shard_shape(namespace["both_model"].up.weight) == (16, 4)
