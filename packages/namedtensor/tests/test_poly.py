"""Named polynomial functions (poly.py) against numpy's polynomial functions."""

import jax.numpy as jnp
import numpy as np
import pytest

import ponente.namedtensor as hax
from ponente.namedtensor import Axis
from ponente.namedtensor.poly import DEFAULT_POLY_AXIS_NAME

P = np.array([1.0, -2.0, -1.0, 2.0])  # (x - 2)(x - 1)(x + 1)
Q = np.array([1.0, 1.0])


def _p(values=P, name="c"):
    return hax.named(jnp.asarray(values, dtype=jnp.float32), name)


def test_coefficient_arithmetic_keeps_the_axis_name():
    p = _p()
    for ours, ref in [(hax.polyadd, np.polyadd), (hax.polysub, np.polysub), (hax.polymul, np.polymul)]:
        out = ours(p, Q)
        expected = ref(P, Q)
        assert out.axes == (Axis("c", len(expected)),)
        np.testing.assert_allclose(out.array, expected, rtol=1e-6)
    # the first named operand names the result; unnamed operands give "degree"
    assert hax.polymul(Q, _p(name="d")).axes[0].name == "d"
    assert hax.polyadd(P, Q).axes == (Axis(DEFAULT_POLY_AXIS_NAME, 4),)
    q, r = hax.polydiv(p, Q)
    ref_q, ref_r = np.polydiv(P, Q)
    np.testing.assert_allclose(q.array, ref_q, rtol=1e-5)
    np.testing.assert_allclose(np.trim_zeros(np.asarray(r.array), "f"), np.trim_zeros(ref_r, "f"), atol=1e-5)


def test_calculus_roots_and_values():
    p = _p()
    np.testing.assert_allclose(hax.polyder(p, m=2).array, np.polyder(P, m=2))
    integ = hax.polyint(p, k=3.0)
    assert integ.axes == (Axis("c", 5),)
    np.testing.assert_allclose(integ.array, np.polyint(P, k=3.0), rtol=1e-6)
    np.testing.assert_allclose(
        np.sort_complex(np.asarray(hax.roots(p).array)), np.sort_complex(np.roots(P)), atol=1e-4
    )
    np.testing.assert_allclose(hax.poly(_p([1.0, -2.0], "r")).array, np.poly([1.0, -2.0]))
    x = hax.named(jnp.linspace(-1.0, 1.0, 5), "x")
    v = hax.polyval(p, x)
    assert v.axes == x.axes
    np.testing.assert_allclose(v.array, np.polyval(P, np.asarray(x.array)), rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(hax.polyval(p, 2.0), np.polyval(P, 2.0), rtol=1e-6)
    t = hax.trim_zeros(_p([0.0, 0.0, 1.0, 0.0]), "f")
    assert t.axes == (Axis("c", 2),)
    with pytest.raises(ValueError, match="one axis"):
        hax.polyder(hax.zeros({"a": 2, "b": 2}))


def test_polyfit_and_vander():
    xs = np.arange(6.0)
    ys = np.polyval(P, xs)
    x, y = hax.named(jnp.asarray(xs), "x"), hax.named(jnp.asarray(ys), "y")
    fit = hax.polyfit(x, y, 3)
    assert fit.axes == (Axis("x", 4),)
    np.testing.assert_allclose(fit.array, np.polyfit(xs, ys, 3), atol=1e-3)
    _coeffs, cov = hax.polyfit(x, jnp.asarray(ys + 0.01 * np.sin(xs)), 2, cov=True)
    assert cov.axes == (Axis("x", 3), Axis("x_cov", 3))
    np.testing.assert_allclose(cov.array, np.polyfit(xs, ys + 0.01 * np.sin(xs), 2, cov=True)[1], rtol=1e-2, atol=1e-4)
    full = hax.polyfit(x, y, 3, full=True)
    assert len(full) == 5
    assert full[0].axes == (Axis("x", 4),)
    v = hax.vander(x, Axis("power", 3))
    assert v.axes == (Axis("x", 6), Axis("power", 3))
    np.testing.assert_allclose(v.array, np.vander(xs, 3))
    assert hax.vander(x, "power").axes == (Axis("x", 6), Axis("power", 6))
