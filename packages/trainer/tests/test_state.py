"""TrainerState: fresh state, trainable filters, and frozen parameters staying frozen through a step."""

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import optax

import ponente.namedtensor as hax
from ponente.trainer.state import TrainerState, init_state, trainable_filter
from ponente.trainer.trainer import Trainer, TrainerConfig


class Tiny(eqx.Module):
    encoder: hax.nn.Linear
    head: hax.nn.Linear
    scale: jax.Array
    steps: jax.Array  # an integer buffer: never trainable

    def __call__(self, x):
        return self.head(self.encoder(x)) * self.scale


In, Hid, Out = hax.Axis("embed", 3), hax.Axis("hidden", 4), hax.Axis("out", 2)


def tiny(key):
    k1, k2 = jax.random.split(key)
    return Tiny(
        hax.nn.Linear.init(In, Hid, key=k1),
        hax.nn.Linear.init(Hid, Out, key=k2),
        jnp.ones(()),
        jnp.zeros((), jnp.int32),
    )


def test_init_state_starts_at_step_zero_with_the_optimizer_state_of_the_parameters():
    model = tiny(jax.random.PRNGKey(0))
    key = jax.random.PRNGKey(3)
    state = init_state(model, optax.adam(1e-3), key)
    assert state.step.dtype == jnp.int32
    assert int(state.step) == 0
    np.testing.assert_array_equal(state.training_key, key)
    expected = optax.adam(1e-3).init(eqx.filter(model, eqx.is_inexact_array))
    assert jax.tree_util.tree_structure(state.opt_state) == jax.tree_util.tree_structure(expected)
    # the integer buffer is not a parameter
    assert state.trainable_model.steps is None
    assert isinstance(state.trainable_model.encoder.weight, hax.NamedArray)


def test_trainable_filter_selects_floating_leaves_chosen_by_the_filter():
    model = tiny(jax.random.PRNGKey(0))
    only_head = jax.tree_util.tree_map(lambda _: False, model)
    only_head = eqx.tree_at(lambda m: m.head, only_head, True)
    mask = trainable_filter(model, only_head)
    assert jax.tree_util.tree_leaves(mask.head) == [True, True]
    assert jax.tree_util.tree_leaves(mask.encoder) == [False, False]
    assert mask.scale is False
    assert mask.steps is False
    by_shape = trainable_filter(model, lambda x: np.ndim(x) == 0)
    assert by_shape.scale is True
    assert by_shape.steps is False


def test_frozen_parameters_do_not_change_in_a_step():
    def loss_fn(model, batch, *, key):
        return hax.mean(model(batch) ** 2).array

    trainer = Trainer(
        TrainerConfig(train_batch_size=2, num_train_steps=1, compilation_cache_dir=None),
        optax.sgd(0.5),
        loss_fn,
    )
    only_head = lambda m: eqx.tree_at(lambda t: t.head, jax.tree_util.tree_map(lambda _: False, m), True)  # noqa: E731
    model = tiny(jax.random.PRNGKey(0))
    state = trainer.initial_state(lambda key: model, is_trainable=only_head(model))
    assert isinstance(state, TrainerState)
    batch = hax.random.normal(jax.random.PRNGKey(1), (hax.Axis("batch", 2), In))
    new, _ = trainer.train_step(state, batch)
    np.testing.assert_array_equal(new.model.encoder.weight.array, model.encoder.weight.array)
    np.testing.assert_array_equal(new.model.scale, model.scale)
    assert not np.allclose(new.model.head.weight.array, model.head.weight.array)
    # reference update for the head: sgd on the gradient of the head alone
    grad = jax.grad(lambda h: loss_fn(eqx.tree_at(lambda m: m.head, model, h), batch, key=None))(model.head)
    np.testing.assert_allclose(
        new.model.head.weight.array, model.head.weight.array - 0.5 * grad.weight.array, rtol=1e-6
    )
