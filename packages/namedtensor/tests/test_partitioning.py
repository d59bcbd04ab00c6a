"""Tests for ``partitioning`` on one device (multi-device behaviour: ``test_multidevice_training.py``)."""

import logging
import re
import threading
import warnings

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import AbstractMesh, NamedSharding, PartitionSpec

import ponente.namedtensor as hax
import ponente.namedtensor.partitioning as P
from ponente.namedtensor import Axis, NamedArray

Batch, Embed, Mlp = Axis("batch", 4), Axis("embed", 6), Axis("mlp", 10)
ABSTRACT = AbstractMesh((2, 4), ("data", "model"))


@pytest.fixture
def mesh():
    mesh = P.make_mesh({"data": -1, "model": 1})
    with jax.set_mesh(mesh):
        yield mesh


def test_make_mesh_infers_minus_one_and_validates():
    mesh = P.make_mesh({"data": -1, P.ResourceAxis.MODEL: 1})
    assert mesh.axis_names == ("data", "model")
    assert dict(mesh.shape) == {"data": len(jax.devices()), "model": 1}
    with pytest.raises(ValueError, match="axis 'model' has size 0"):
        P.make_mesh({"data": 1, "model": 0})
    with pytest.raises(ValueError, match=r"only one axis may have size -1, but \['data', 'model'\]"):
        P.make_mesh({"data": -1, "model": -1})
    with pytest.raises(ValueError, match="need 3 devices"):
        P.make_mesh({"data": 3, "model": len(jax.devices())})
    with pytest.raises(ValueError, match="cannot be inferred"):
        P.make_mesh({"data": -1, "model": len(jax.devices()) + 1})
    with pytest.raises(ValueError, match="at least one axis"):
        P.make_mesh({})


def test_resource_axis_is_a_string():
    assert P.ResourceAxis.DATA == "data"
    assert str(P.ResourceAxis.MODEL) == "model"
    assert P.physical_axis_name("mlp", {"mlp": P.ResourceAxis.MODEL}) == "model"


def test_axis_mapping_nests_merges_and_is_thread_local():
    assert P.current_thread_local_mapping() is None
    with P.axis_mapping({"batch": "data"}):
        assert P.physical_axis_name(Batch) == "data"
        with P.axis_mapping({"mlp": "model"}):
            assert P.physical_axis_name("batch") is None
            assert P.physical_axis_name("mlp") == "model"
        with P.axis_mapping({"mlp": "model"}, merge=True):
            assert P.physical_axis_name("batch") == "data"
        seen = []
        thread = threading.Thread(target=lambda: seen.append(P.current_thread_local_mapping()))
        thread.start()
        thread.join()
        assert seen == [None]
        assert P.physical_axis_name("batch") == "data"
    assert P.current_thread_local_mapping() is None


def test_physical_axis_size_and_rounding_on_an_abstract_mesh():
    mapping = {"vocab": "model", "batch": ("data", "model")}
    assert P.physical_axis_size("vocab", mapping, mesh=ABSTRACT) == 4
    assert P.physical_axis_size("batch", mapping, mesh=ABSTRACT) == 8
    assert P.physical_axis_size("embed", mapping, mesh=ABSTRACT) is None
    for size in range(1, 20):
        rounded = P.round_axis_for_partitioning(Axis("vocab", size), mapping, mesh=ABSTRACT)
        assert rounded.name == "vocab"
        assert rounded.size == 4 * int(np.ceil(size / 4))
    assert P.round_axis_for_partitioning(Embed, mapping, mesh=ABSTRACT) == Embed
    with pytest.raises(ValueError, match="mapped to mesh axis 'replica'"):
        P.physical_axis_size("x", {"x": "replica"}, mesh=ABSTRACT)


def test_pspecs():
    assert P.pspec_for_axis((Batch, Embed, Mlp), {"batch": "data", "mlp": "model"}) == PartitionSpec(
        "data", None, "model"
    )
    assert P.pspec_for_axis(("batch",), {"batch": ("replica", "data")}) == PartitionSpec(("replica", "data"))
    with pytest.raises(ValueError, match="'embed' and 'mlp' of one array are both mapped to mesh axis 'model'"):
        P.pspec_for_axis((Embed, Mlp), {"embed": "model", "mlp": "model"})
    tree = {"w": hax.zeros((Embed, Mlp)), "plain": jnp.zeros(3), "n": 3, "none": None}
    specs = P.pspec_for(tree, {"mlp": "model"})
    assert specs == {"w": PartitionSpec(None, "model"), "plain": PartitionSpec(None), "n": None, "none": None}
    assert P.pspec_for(jnp.zeros(()), {}) == PartitionSpec()


def test_infer_resource_partitions(mesh):
    tree = {"w": hax.zeros((Embed, Mlp)), "plain": jnp.zeros(3), "n": "static"}
    shardings = P.infer_resource_partitions(tree, {"embed": "data"})
    assert shardings["w"] == NamedSharding(mesh, PartitionSpec("data", None))
    assert shardings["plain"] == NamedSharding(mesh, PartitionSpec())
    assert shardings["n"] is None


def test_shard_outside_jit_places_arrays(mesh):
    x = hax.arange((Batch, Embed), dtype=jnp.float32)
    y = P.shard({"x": x, "k": 3}, {"batch": "data"})
    assert y["k"] == 3
    assert isinstance(y["x"], NamedArray)
    assert y["x"].axes == x.axes
    assert y["x"].array.sharding == NamedSharding(mesh, PartitionSpec("data", None))
    np.testing.assert_array_equal(y["x"].array, x.array)
    with P.axis_mapping({"embed": "data"}):
        assert P.shard(x).array.sharding.spec == PartitionSpec(None, "data")
        assert P.auto_sharded(x).array.sharding.spec == PartitionSpec(None, "data")
    assert P.shard_with_axis_mapping(x, {"batch": "data"}, mesh).array.sharding.spec == PartitionSpec("data", None)


def test_shard_inside_jit_adds_a_sharding_constraint(mesh):
    jaxpr = str(jax.make_jaxpr(lambda x: P.shard(x, {"mlp": "model"}))(hax.ones((Embed, Mlp))))
    assert "sharding_constraint" in jaxpr
    assert "P(None, 'model')" in jaxpr


def test_shard_without_mapping_warns_and_auto_sharded_is_silent(mesh, caplog):
    x = hax.ones(Embed)
    with caplog.at_level(logging.WARNING, logger="ponente.namedtensor.partitioning"):
        assert P.shard(x) is x
    assert "no axis mapping" in caplog.text
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="ponente.namedtensor.partitioning"):
        assert P.auto_sharded(x) is x
    assert caplog.text == ""


def test_shard_without_any_mesh_is_a_no_op():
    x = hax.ones(Embed)
    assert P.shard(x, {"embed": "data"}) is x


class Model(eqx.Module):
    w: NamedArray
    scale: float = eqx.field(static=True)
    name: str = eqx.field(static=True)

    def __call__(self, x: NamedArray) -> NamedArray:
        return hax.dot(x, self.w, axis="embed") * self.scale


def _model(scale: float = 2.0) -> Model:
    w = hax.named(
        jnp.arange(Embed.size * Mlp.size, dtype=jnp.float32).reshape(Embed.size, Mlp.size) / 10, ("embed", "mlp")
    )
    return Model(w, scale, "m")


def test_named_jit_accepts_modules_and_non_array_values_and_caches():
    traces = []

    def step(model, x, factor, label):
        traces.append(label)
        return {"y": model(x) * factor, "label": label, "axes": x.axes}

    jitted = P.named_jit(step)
    model, x = _model(), hax.ones((Batch, Embed))
    out = jitted(model, x, 3.0, "a")
    expected = np.ones((4, 6)) @ np.asarray(model.w.array) * 2.0 * 3.0
    np.testing.assert_allclose(out["y"].array, expected, rtol=1e-6)
    assert out["label"] == "a"
    assert out["axes"] == (Batch, Embed)
    jitted(model, x, 3.0, "a")
    jitted(_model(), hax.zeros((Batch, Embed)), 3.0, "a")  # new arrays, same static part: cached
    assert traces == ["a"]
    jitted(model, x, 3.0, "b")  # new static value: traced again
    jitted(_model(scale=5.0), x, 3.0, "b")  # a static module field counts too
    assert traces == ["a", "b", "b"]
    assert len(jitted._cache) == 3


def test_named_jit_sets_compute_mapping_and_constrains_inputs_and_outputs(mesh):
    seen = []

    def fn(x):
        seen.append(P.current_thread_local_mapping())
        return x * 2

    jitted = P.named_jit(
        fn, {"batch": "data"}, in_axis_resources={"embed": "data"}, out_axis_resources={"mlp": "model"}
    )
    jaxpr = str(jax.make_jaxpr(jitted)(hax.ones((Batch, Embed))))
    assert seen == [{"batch": "data"}]
    assert "P(None, 'data')" in jaxpr  # the input constraint; the output has no "mlp" axis
    with P.axis_mapping({"batch": "data"}):
        context_jit = P.named_jit(lambda x: P.physical_axis_name("batch"))
        assert context_jit(hax.ones(Batch)) == "data"


def test_named_jit_donation():
    jitted = P.named_jit(lambda a, b: a + b, donate_args=(True, False))
    a, b = jnp.ones(3), jnp.ones(3)
    np.testing.assert_array_equal(jitted(a, b), 2 * np.ones(3))
    assert a.is_deleted()
    assert not b.is_deleted()
    kw = P.named_jit(lambda a, *, b: a + b, donate_kwargs={"b": True})
    a, b = jnp.ones(3), jnp.ones(3)
    kw(a, b=b)
    assert b.is_deleted()
    assert not a.is_deleted()
    with pytest.raises(ValueError, match="donate_args has 1 entries but the function got 2"):
        P.named_jit(lambda a, b: a, donate_args=(True,))(a, jnp.ones(3))
    with pytest.raises(ValueError, match=r"donate_kwargs names \['c'\]"):
        P.named_jit(lambda a, **kw: a, donate_kwargs={"c": True})(jnp.ones(3))


def test_named_jit_donation_prefix_mask_reaches_the_right_leaves():
    # a per-argument pytree prefix of bools, with non-array leaves interleaved between the arrays
    jitted = P.named_jit(
        lambda d, c: {"sum": d["a"] + d["b"] + c, "twice": 2 * c, "tag": d["tag"]},
        donate_args=({"a": True, "b": False, "tag": True}, True),
    )
    for _ in range(2):  # the second call goes through the cached entry
        a, b, c = jnp.ones(3), jnp.full(3, 2.0), jnp.full(3, 4.0)
        out = jitted({"a": a, "tag": "t", "b": b}, c)
        np.testing.assert_array_equal(out["sum"], np.full(3, 7.0))
        np.testing.assert_array_equal(out["twice"], np.full(3, 8.0))
        assert out["tag"] == "t"
        assert [a.is_deleted(), b.is_deleted(), c.is_deleted()] == [True, False, True]


def test_named_jit_static_outputs_follow_input_shapes():
    jitted = P.named_jit(lambda x: (x.sum(), x.shape[0], "n"))
    for n in (2, 3, 2, 3):
        total, size, tag = jitted(jnp.ones(n))
        assert float(total) == n
        assert size == n
        assert tag == "n"


def test_named_jit_lower_shows_constraints_and_donation(mesh):
    jitted = P.named_jit(lambda m, x: (m.w * 2, m(x)), {"batch": "data"}, donate_args=(True, False))
    text = jitted.lower(_model(), hax.ones((Batch, Embed))).as_text()
    assert re.search(r'sharding_constraint %\d+ <@mesh, \[{"data"}, {}\]> : tensor<4x10xf32>', text)
    assert "jax.buffer_donor" in text or "tf.aliasing_output" in text


def test_named_jit_names_the_program_after_the_function():
    def scaled_sum(x):
        return hax.sum(x * 2)

    class Step:
        def train(self, x):
            return x + 1

    assert "@jit_scaled_sum" in P.named_jit(scaled_sum).lower(hax.ones((Batch,))).as_text()
    assert "@jit_train" in P.named_jit(Step().train).lower(hax.ones((Batch,))).as_text()
    # a callable without a usable name (a lambda) keeps the generic one
    assert "@jit_body" in P.named_jit(lambda x: x).lower(hax.ones((Batch,))).as_text()


def test_legacy_with_mesh_is_found(mesh):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", DeprecationWarning)
        with jax.set_mesh(None), mesh:
            assert P.current_mesh() == mesh


def test_fsdp_needs_both_mappings():
    with pytest.raises(TypeError, match="both parameter_mapping and compute_mapping"):
        P.fsdp(lambda x: x, parameter_mapping={"embed": "data"})


def test_named_jit_rejects_unhashable_static_arguments():
    with pytest.raises(TypeError, match="must be hashable"):
        P.named_jit(lambda x, opts: x)(jnp.ones(2), {1, 2})  # a set is a leaf and cannot be hashed


def test_fsdp_uses_parameter_mapping_outside_and_compute_mapping_inside(mesh):
    seen = []

    def step(model, x):
        seen.append(P.current_thread_local_mapping())
        return model(x)

    stepped = P.fsdp(step, parameter_mapping={"embed": "data"}, compute_mapping={"batch": "data"})
    jaxpr = str(jax.make_jaxpr(stepped)(_model(), hax.ones((Batch, Embed))))
    assert seen == [{"batch": "data"}]
    assert "P('data', None)" in jaxpr
    assert "P(None, 'data')" in jaxpr
    decorated = P.fsdp(parameter_mapping={"embed": "data"}, compute_mapping={"batch": "data"})(step)
    out = decorated(_model(), hax.ones((Batch, Embed)))
    np.testing.assert_allclose(out.array, np.ones((4, 6)) @ np.asarray(_model().w.array) * 2.0, rtol=1e-6)


class Annotated(eqx.Module):
    table: jax.Array = hax.field(axis_names=("embed", "mlp"))
    bias: jax.Array


class Outer(eqx.Module):
    inner: Annotated
    extra: list


def test_declared_axis_names_of_plain_array_fields_are_partitioned(mesh):
    mod = Outer(Annotated(jnp.zeros((Embed.size, Mlp.size)), jnp.zeros(Mlp.size)), [jnp.zeros(2), "tag"])
    mapping = {"embed": "data", "mlp": "model"}
    specs = P.pspec_for(mod, mapping, preserve_existing_shardings=False)
    assert specs.inner.table == PartitionSpec("data", "model")
    assert specs.inner.bias == PartitionSpec(None)
    assert specs.extra == [PartitionSpec(None), None]
    shardings = P.infer_resource_partitions(mod, mapping)
    assert shardings.inner.table == NamedSharding(mesh, PartitionSpec("data", "model"))
    placed = P.shard(mod, {"embed": "data"})
    assert placed.inner.table.sharding.spec == PartitionSpec("data", None)
    assert placed.extra[1] == "tag"
    with pytest.raises(ValueError, match=r"Annotated.table: field\(axis_names=\('embed', 'mlp'\)\) names 2 axes"):
        P.pspec_for(Annotated(jnp.zeros(3), jnp.zeros(3)), mapping)


def test_named_jit_inputs_keep_their_shardings_without_in_axis_resources(mesh):
    jaxpr = str(jax.make_jaxpr(P.named_jit(lambda x: x + 1, {"embed": "data"}))(hax.ones((Batch, Embed))))
    # the only constraint is the output's: without in_axis_resources the input is not constrained
    assert jaxpr.count("sharding_constraint") == 1


def test_shard_over_explicit_mesh_axes_reshards():
    mesh = P.make_mesh({"data": -1, "model": 1}, axis_types=jax.sharding.AxisType.Explicit)
    with P.set_mesh(mesh):

        def make(x):
            return x, hax.zeros(Mlp)  # created inside: replicated until resharded

        x, y = P.named_jit(make, {"mlp": "model", "embed": "data"})(hax.ones((Batch, Embed)))
        jaxpr = str(jax.make_jaxpr(lambda a: P.shard(a, {"embed": "data"}))(hax.ones(Embed)))
    assert "reshard" in jaxpr
    assert "sharding_constraint" not in jaxpr  # with_sharding_constraint would only assert over Explicit axes
    assert y.array.sharding.spec == PartitionSpec("model")
    assert x.array.sharding.spec == PartitionSpec(None, "data")
    np.testing.assert_array_equal(y.array, np.zeros(Mlp.size))


def test_compiled_call_runs_its_executable_without_compiling_and_other_shapes_through_named_jit():
    import jax.numpy as jnp

    from ponente.namedtensor.partitioning import named_jit

    compiles: list[float] = []

    def listener(event, duration, **kwargs):
        if event == "/jax/core/compile/backend_compile_duration":
            compiles.append(duration)

    f = named_jit(lambda x, scale: {"y": x * scale})
    twice = f.compile(jnp.zeros(3), 2.0)
    three, two = jnp.asarray([0.0, 1.0, 2.0]), jnp.asarray([0.0, 1.0])
    jax.monitoring.register_event_duration_secs_listener(listener)
    try:
        got = twice(three, 2.0)["y"]
        assert compiles == []
        assert got.tolist() == [0.0, 2.0, 4.0]
        assert twice(two, 3.0)["y"].tolist() == [0.0, 3.0]  # another shape and static value: compiled for them
        assert len(compiles) >= 1
    finally:
        jax.monitoring.unregister_event_duration_listener(listener)
    assert twice.compiled.cost_analysis() is not None
