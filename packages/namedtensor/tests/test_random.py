"""``ponente.namedtensor.random`` is bitwise identical to ``jax.random`` with the positional shape."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import ponente.namedtensor as hax
from ponente.namedtensor import Axis, NamedArray

B, E = Axis("batch", 3), Axis("embed", 4)
SHAPE = (B, E)
POS = (3, 4)
KEY = jax.random.key(42)

# name, named params, positional params (same values)
SCALAR_PARAM_CASES = [
    ("uniform", (), ()),
    ("normal", (), ()),
    ("cauchy", (), ()),
    ("exponential", (), ()),
    ("gumbel", (), ()),
    ("laplace", (), ()),
    ("logistic", (), ()),
    ("maxwell", (), ()),
    ("rademacher", (), ()),
    ("bits", (), ()),
    ("beta", (2.0, 3.0), (2.0, 3.0)),
    ("binomial", (5.0, 0.3), (5.0, 0.3)),
    ("chisquare", (3.0,), (3.0,)),
    ("double_sided_maxwell", (0.5, 2.0), (0.5, 2.0)),
    ("f", (3.0, 4.0), (3.0, 4.0)),
    ("gamma", (1.5,), (1.5,)),
    ("geometric", (0.3,), (0.3,)),
    ("loggamma", (0.5,), (0.5,)),
    ("lognormal", (0.7,), (0.7,)),
    ("pareto", (2.0,), (2.0,)),
    ("poisson", (3.0,), (3.0,)),
    ("rayleigh", (2.0,), (2.0,)),
    ("t", (3.0,), (3.0,)),
    ("triangular", (0.0, 0.3, 1.0), (0.0, 0.3, 1.0)),
    ("truncated_normal", (-1.0, 2.0), (-1.0, 2.0)),
    ("wald", (1.5,), (1.5,)),
    ("weibull_min", (1.0, 2.0), (1.0, 2.0)),
]


def _jax_call(name, key, params, shape):
    fn = getattr(jax.random, name)
    if name in {"uniform", "normal", "cauchy", "exponential", "gumbel", "laplace", "logistic", "maxwell"}:
        return fn(key, shape)
    if name in {"rademacher", "bits"}:
        return fn(key, shape)
    return fn(key, *params, shape=shape)


@pytest.mark.parametrize(("name", "named_params", "params"), SCALAR_PARAM_CASES)
def test_bitwise_equal_to_jax_random(name, named_params, params):
    ours = getattr(hax.random, name)(KEY, SHAPE, *named_params)
    theirs = _jax_call(name, KEY, params, POS)
    assert ours.axes == SHAPE
    assert ours.dtype == theirs.dtype
    np.testing.assert_array_equal(np.asarray(ours.array), np.asarray(theirs))


def test_randint_bernoulli_generalized_normal_ball_bitwise():
    np.testing.assert_array_equal(hax.random.randint(KEY, SHAPE, 0, 10).array, jax.random.randint(KEY, POS, 0, 10))
    np.testing.assert_array_equal(hax.random.bernoulli(KEY, SHAPE, 0.3).array, jax.random.bernoulli(KEY, 0.3, POS))
    np.testing.assert_array_equal(
        hax.random.generalized_normal(KEY, SHAPE, 1.5).array, jax.random.generalized_normal(KEY, 1.5, POS)
    )
    D = Axis("d", 5)
    ball = hax.random.ball(KEY, B, D, p=1.0)
    assert ball.axes == (B, D)
    np.testing.assert_array_equal(ball.array, jax.random.ball(KEY, 5, 1.0, (3,)))
    uniform = hax.random.uniform(KEY, {"batch": 3, "embed": 4}, jnp.bfloat16, -2.0, 2.0)
    np.testing.assert_array_equal(uniform.array, jax.random.uniform(KEY, POS, jnp.bfloat16, -2.0, 2.0))


def test_named_parameters_broadcast_by_name():
    # the parameter's axes are in the opposite order of the shape and miss nothing
    a = NamedArray(jnp.arange(1.0, 13.0).reshape(4, 3), (E, B))
    ours = hax.random.gamma(KEY, SHAPE, a)
    np.testing.assert_array_equal(ours.array, jax.random.gamma(KEY, jnp.arange(1.0, 13.0).reshape(4, 3).T, POS))
    # a parameter with a subset of the axes
    lam = NamedArray(jnp.array([1.0, 2.0, 3.0, 4.0]), (E,))
    ours = hax.random.poisson(KEY, SHAPE, lam=lam)
    np.testing.assert_array_equal(ours.array, jax.random.poisson(KEY, jnp.array([1.0, 2.0, 3.0, 4.0]), POS))
    lo = NamedArray(jnp.array([0.0, 10.0, 20.0]), (B,))
    ours = hax.random.uniform(KEY, SHAPE, minval=lo, maxval=lo + 1.0)
    expected = jax.random.uniform(
        KEY, POS, minval=jnp.array([[0.0], [10.0], [20.0]]), maxval=jnp.array([[1.0], [11.0], [21.0]])
    )
    np.testing.assert_array_equal(ours.array, expected)
    assert (ours.array[1] >= 10).all()


def test_parameter_axis_not_in_shape_is_an_error():
    p = NamedArray(jnp.ones(2), (Axis("other", 2),))
    with pytest.raises(ValueError, match="'other' is not in the requested shape"):
        hax.random.gamma(KEY, SHAPE, p)
    with pytest.raises(ValueError, match="does not match"):
        hax.random.gamma(KEY, SHAPE, NamedArray(jnp.ones(5), (Axis("embed", 5),)))
    with pytest.raises(TypeError, match="missing parameter 'a'"):
        hax.random.gamma(KEY, SHAPE)
    with pytest.raises(TypeError, match="needs sizes"):
        hax.random.normal(KEY, ("batch",))


def test_categorical_choice_permutation_dirichlet_bitwise():
    logits = NamedArray(jax.random.normal(jax.random.key(1), (4, 3)), (E, B))
    ours = hax.random.categorical(KEY, logits, "embed")
    assert ours.axes == (B,)
    # the logits keep their layout (category axis first), as in Haliax
    np.testing.assert_array_equal(ours.array, jax.random.categorical(KEY, logits.array, axis=0, shape=(3,)))
    S = Axis("sample", 2)
    ours = hax.random.categorical(KEY, logits, E, shape=(S, B))
    wide = jnp.broadcast_to(logits.array, (2, 4, 3))
    np.testing.assert_array_equal(ours.array, jax.random.categorical(KEY, wide, axis=1, shape=(2, 3)))
    # a shape in another order than the logits' axes: arranged as shape + (category,)
    ours = hax.random.categorical(KEY, NamedArray(jnp.zeros((4, 3, 2)), (E, B, S)), E, shape=(S, B))
    ref = jax.random.categorical(KEY, jnp.zeros((2, 3, 4)), axis=-1, shape=(2, 3))
    np.testing.assert_array_equal(ours.array, ref)

    x = NamedArray(jnp.arange(12).reshape(3, 4), SHAPE)
    K = Axis("k", 2)
    ours = hax.random.choice(KEY, K, x, "embed", replace=False)
    assert ours.axes == (B, K)
    np.testing.assert_array_equal(ours.array, jax.random.choice(KEY, x.array, (2,), replace=False, axis=1))
    p = NamedArray(jnp.array([0.1, 0.2, 0.3, 0.4]), (E,))
    ours = hax.random.choice(KEY, K, x, E, p=p)
    np.testing.assert_array_equal(ours.array, jax.random.choice(KEY, x.array, (2,), p=p.array, axis=1))

    ours = hax.random.permutation(KEY, x, "batch", independent=True)
    np.testing.assert_array_equal(ours.array, jax.random.permutation(KEY, x.array, axis=0, independent=True))

    alpha = NamedArray(jnp.array([1.0, 2.0, 3.0, 4.0]), (E,))
    ours = hax.random.dirichlet(KEY, B, alpha, "embed")
    assert ours.axes == (B, E)
    np.testing.assert_array_equal(ours.array, jax.random.dirichlet(KEY, alpha.array, (3,)))


def test_random_under_jit_and_vmap_keys():
    f = jax.jit(lambda k: hax.random.normal(k, SHAPE))
    np.testing.assert_array_equal(f(KEY).array, jax.random.normal(KEY, POS))
    keys = jax.random.split(KEY, 2)
    batched = jax.vmap(lambda k: hax.random.uniform(k, (E,)).array)(keys)
    np.testing.assert_array_equal(batched, jax.vmap(lambda k: jax.random.uniform(k, (4,)))(keys))


def test_multivariate_normal_orthogonal_multinomial_bitwise():
    B, D = hax.Axis("batch", 3), hax.Axis("dim", 2)
    D2 = hax.Axis("dim2", 2)
    mean = hax.named(jnp.array([1.0, -1.0]), (D,))
    cov_np = np.array([[2.0, 0.3], [0.3, 1.0]], dtype=np.float32)
    cov = hax.named(jnp.asarray(cov_np), (D, D2))
    ours = hax.random.multivariate_normal(KEY, B, mean, cov, "dim", "dim2")
    assert ours.axes == (B, D)
    expected = jax.random.multivariate_normal(KEY, mean.array, jnp.asarray(cov_np), (3,))
    np.testing.assert_array_equal(ours.array, expected)
    # the same covariance stored with its axes in the other order is the same named matrix: same draw
    swapped = hax.named(jnp.asarray(cov_np.T), (D2, D))
    np.testing.assert_array_equal(hax.random.multivariate_normal(KEY, B, mean, swapped, "dim", "dim2").array, expected)

    Q = hax.random.orthogonal(KEY, B, D, D2)
    assert Q.axes == (B, D, D2)
    np.testing.assert_array_equal(Q.array, jax.random.orthogonal(KEY, 2, (3,)))
    np.testing.assert_allclose(
        np.einsum("bij,bkj->bik", Q.array, Q.array), np.broadcast_to(np.eye(2), (3, 2, 2)), atol=1e-5
    )

    C = hax.Axis("cat", 4)
    p = hax.named(jnp.array([0.1, 0.2, 0.3, 0.4]), (C,))
    counts = hax.random.multinomial(KEY, 10, p, "cat", shape=B)
    assert counts.axes == (B, C)
    np.testing.assert_array_equal(counts.array, jax.random.multinomial(KEY, 10, p.array, shape=(3, 4)))
    np.testing.assert_array_equal(counts.array.sum(axis=-1), np.full(3, 10))


def test_orthogonal_and_multivariate_normal_reject_bad_axes():
    D, E = hax.Axis("dim", 2), hax.Axis("other", 3)
    with pytest.raises(ValueError, match="square"):
        hax.random.orthogonal(KEY, (), D, E)
    mean = hax.zeros(D)
    with pytest.raises(ValueError, match="other"):
        hax.random.multivariate_normal(KEY, (), mean, hax.zeros((D, E)), "dim", "other")
