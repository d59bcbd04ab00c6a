"""Softmax family, one_hot, standardize and losses against NumPy references."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

import ponente.namedtensor as hax
from ponente.namedtensor import Axis, nn

RNG = np.random.default_rng(0)
RAW = RNG.standard_normal((2, 3, 4)).astype(np.float32)
X = hax.named(RAW, ("b", "pos", "vocab"))


def _np_logsumexp(x, axis):
    m = np.max(x, axis=axis, keepdims=True)
    return np.squeeze(m, axis) + np.log(np.sum(np.exp(x - m), axis=axis))


def _np_softmax(x, axis):
    e = np.exp(x - np.max(x, axis=axis, keepdims=True))
    return e / np.sum(e, axis=axis, keepdims=True)


@pytest.mark.parametrize(("axis", "pos"), [("vocab", 2), ("b", 0), (("pos", "vocab"), (1, 2))])
def test_softmax_family(axis, pos):
    x = RAW.astype(np.float64)
    np.testing.assert_allclose(nn.softmax(X, axis).array, _np_softmax(x, pos), rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(nn.log_softmax(X, axis).array, np.log(_np_softmax(x, pos)), rtol=1e-5, atol=1e-5)
    lse = nn.logsumexp(X, axis)
    np.testing.assert_allclose(lse.array, _np_logsumexp(x, pos), rtol=1e-5, atol=1e-5)
    names = (axis,) if isinstance(axis, str) else axis
    assert lse.axis_names == tuple(n for n in X.axis_names if n not in names)


def test_softmax_where_zeroes_masked_entries():
    mask = hax.named(np.array([True, False, True, True]), "vocab")
    p = nn.softmax(X, "vocab", where=mask)
    ref = _np_softmax(np.where([True, False, True, True], RAW, -np.inf), 2)
    np.testing.assert_allclose(p.array, ref, rtol=1e-5, atol=1e-6)


def test_softmax_missing_axis_names_it():
    with pytest.raises(ValueError, match="'heads'"):
        nn.softmax(X, "heads")


@given(st.integers(0, 100))
def test_standardize_matches_numpy(seed):
    raw = np.random.default_rng(seed).standard_normal((3, 5)).astype(np.float32)
    out = nn.standardize(hax.named(raw, ("b", "e")), "e", epsilon=1e-5)
    ref = (raw - raw.mean(1, keepdims=True)) / np.sqrt(raw.var(1, keepdims=True) + 1e-5)
    np.testing.assert_allclose(out.array, ref, rtol=1e-4, atol=1e-5)


def test_standardize_with_given_statistics():
    raw = RAW[0]
    x = hax.named(raw, ("pos", "vocab"))
    mean = hax.named(np.ones(3, np.float32), "pos")
    var = hax.named(np.full(3, 4.0, np.float32), "pos")
    out = nn.standardize(x, "vocab", mean=mean, variance=var, epsilon=0.0)
    np.testing.assert_allclose(out.array, (raw - 1) / 2, rtol=1e-6)


def test_one_hot_against_eye():
    labels = np.array([[0, 3], [2, 1]])
    out = nn.one_hot(hax.named(labels, ("b", "pos")), Axis("vocab", 4))
    assert out.axis_names == ("b", "pos", "vocab")
    np.testing.assert_array_equal(out.array, np.eye(4)[labels])
    np.testing.assert_array_equal(nn.one_hot(2, Axis("c", 3)).array, [0, 0, 1])
    # a single label indexes like Python (negative from the end); NamedArray labels out of range give zeros
    for label in (-3, -1, np.int32(-2), np.array(1)):
        np.testing.assert_array_equal(nn.one_hot(label, Axis("c", 3)).array, np.eye(3)[int(label)])
    np.testing.assert_array_equal(nn.one_hot(hax.named(np.array([-1, 3]), "b"), Axis("c", 3)).array, np.zeros((2, 3)))
    with pytest.raises(ValueError, match="label 3 is out of range"):
        nn.one_hot(3, Axis("c", 3))
    with pytest.raises(TypeError, match="integer scalar"):
        nn.one_hot(np.array([0, 1]), Axis("c", 3))
    with pytest.raises(ValueError, match="'b'"):
        nn.one_hot(hax.named(labels, ("b", "pos")), Axis("b", 4))


def test_cross_entropy_against_numpy():
    labels = RNG.integers(0, 4, size=(2, 3))
    V = X.resolve_axis("vocab")
    targets = nn.one_hot(hax.named(labels, ("b", "pos")), V)
    logp = np.log(_np_softmax(RAW.astype(np.float64), 2))
    per = -np.take_along_axis(logp, labels[..., None], 2)[..., 0]
    np.testing.assert_allclose(nn.cross_entropy_loss(X, V, targets).scalar(), per.mean(), rtol=1e-5)
    summed = nn.cross_entropy_loss(X, V, targets, reduction=hax.sum)
    np.testing.assert_allclose(summed.scalar(), per.sum(), rtol=1e-5)
    unreduced = nn.cross_entropy_loss(X, V, targets, reduction=None)
    np.testing.assert_allclose(unreduced.array, per, rtol=1e-5)
    by_b = nn.cross_entropy_loss(X, V, targets, reduction_axis="pos")
    np.testing.assert_allclose(by_b.array, per.mean(1), rtol=1e-5)
    where = hax.named(np.array([[True, False, True], [True, True, False]]), ("b", "pos"))
    masked = nn.cross_entropy_loss(X, V, targets, where=where)
    np.testing.assert_allclose(masked.scalar(), per[where.array].mean(), rtol=1e-5)
    loss, lognorm = nn.cross_entropy_loss_and_log_normalizers(X, V, targets)
    np.testing.assert_allclose(lognorm.array, _np_logsumexp(RAW.astype(np.float64), 2), rtol=1e-5)
    np.testing.assert_allclose(loss.array, per, rtol=1e-5)


def test_cross_entropy_gradient_is_softmax_minus_target():
    labels = np.array([[1, 0, 3], [2, 2, 0]])
    V = X.resolve_axis("vocab")
    targets = nn.one_hot(hax.named(labels, ("b", "pos")), V)
    g = jax.grad(lambda a: nn.cross_entropy_loss(hax.named(a, X.axes), V, targets, reduction=hax.sum).scalar())(
        jnp.asarray(RAW)
    )
    np.testing.assert_allclose(g, _np_softmax(RAW, 2) - np.eye(4)[labels], rtol=1e-4, atol=1e-6)


def test_cross_entropy_missing_label_axis():
    with pytest.raises(ValueError, match="'classes'"):
        nn.cross_entropy_loss(X, "classes", X)


def test_binary_cross_entropy_against_numpy():
    logits = RAW[0]
    t = (RNG.random((3, 4)) > 0.5).astype(np.float32)
    sig = 1 / (1 + np.exp(-logits.astype(np.float64)))
    per = -(t * np.log(sig) + (1 - t) * np.log(1 - sig))
    lx, tx = hax.named(logits, ("pos", "vocab")), hax.named(t, ("pos", "vocab"))
    np.testing.assert_allclose(nn.binary_cross_entropy_loss(lx, tx).scalar(), per.mean(), rtol=1e-5)
    np.testing.assert_allclose(nn.binary_cross_entropy_loss(lx, tx, reduction=None).array, per, rtol=1e-5)


def test_reduce_loss():
    arr = hax.named(RAW[0], ("pos", "vocab"))
    np.testing.assert_allclose(nn.reduce_loss(arr).scalar(), RAW[0].mean(), rtol=1e-6)
    np.testing.assert_allclose(nn.reduce_loss(arr, hax.max, "vocab").array, RAW[0].max(1), rtol=1e-6)
    assert nn.reduce_loss(arr, None) is arr
