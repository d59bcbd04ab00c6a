"""Named FFTs (fft.py) against numpy.fft on the positional arrays."""

import jax.numpy as jnp
import numpy as np
import pytest

import ponente.namedtensor as hax
from ponente.namedtensor import Axis

A, B, C = Axis("a", 3), Axis("b", 4), Axis("c", 6)


def _x(dtype=np.float32):
    rng = np.random.default_rng(0)
    return hax.named(rng.standard_normal((3, 4, 6)).astype(dtype), (A, B, C))


def _close(out, ref):
    np.testing.assert_allclose(np.asarray(out.array), ref, rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("name", ["fft", "ifft"])
def test_complex_transforms(name):
    x = _x()
    xa = np.asarray(x.array)
    ours, ref = getattr(hax, name), getattr(np.fft, name)
    ref_n = getattr(np.fft, name + "n")
    out = ours(x)
    assert out.axes == x.axes
    _close(out, ref(xa))
    _close(ours(x, axis="a"), ref(xa, axis=0))
    out = ours(x, axis=Axis("b", 7))
    assert out.axes == (A, Axis("b", 7), C)
    _close(out, ref(xa, n=7, axis=1))
    _close(ours(x, axis=("c", "a")), ref_n(xa, axes=(2, 0)))
    out = ours(x, axis={"a": None, "c": 4})
    assert out.axes == (A, B, Axis("c", 4))
    _close(out, ref_n(xa, s=(3, 4), axes=(0, 2)))
    out = ours(x, axis={"b": Axis("freq", 4)}, norm="ortho")
    assert out.axes == (A, Axis("freq", 4), C)
    _close(out, ref(xa, axis=1, norm="ortho"))


def test_real_transforms():
    x = _x()
    xa = np.asarray(x.array)
    r = hax.rfft(x, axis="b")
    assert r.axes == (A, Axis("b", 3), C)
    _close(r, np.fft.rfft(xa, axis=1))
    back = hax.irfft(r, axis="b")
    assert back.axes == x.axes
    _close(back, xa)
    rn = hax.rfft(x, axis={"a": None, "c": None})
    assert rn.axes == (A, B, Axis("c", 4))
    _close(rn, np.fft.rfftn(xa, axes=(0, 2)))
    backn = hax.irfft(rn, axis={"a": None, "c": C})
    assert backn.axes == x.axes
    _close(backn, np.fft.irfftn(np.fft.rfftn(xa, axes=(0, 2)), s=(3, 6), axes=(0, 2)))
    odd = hax.irfft(r, axis={"b": 5})
    assert odd.axes == (A, Axis("b", 5), C)
    _close(odd, np.fft.irfft(np.fft.rfft(xa, axis=1), n=5, axis=1))


def test_hermitian_transforms():
    x = _x()
    xa = np.asarray(x.array)
    ih = hax.ihfft(x)
    assert ih.axes == (A, B, Axis("c", 4))
    _close(ih, np.fft.ihfft(xa, axis=-1))
    h = hax.hfft(ih)
    assert h.axes == x.axes
    _close(h, np.fft.hfft(np.fft.ihfft(xa, axis=-1), axis=-1))
    ih5 = hax.ihfft(x, axis=Axis("b", 5))
    assert ih5.axes == (A, Axis("b", 3), C)
    _close(ih5, np.fft.ihfft(xa, n=5, axis=1))
    _close(hax.hfft(ih, axis={"c": 7}), np.fft.hfft(np.fft.ihfft(xa, axis=-1), n=7, axis=-1))
    with pytest.raises(ValueError, match="exactly one axis"):
        hax.hfft(x, axis=("a", "b"))


def test_frequencies_and_shifts():
    F = Axis("f", 7)
    np.testing.assert_allclose(hax.fftfreq(F, d=0.5).array, np.fft.fftfreq(7, d=0.5), rtol=1e-6)
    rf = hax.rfftfreq(F)
    assert rf.axes == (Axis("f", 4),)
    np.testing.assert_allclose(rf.array, np.fft.rfftfreq(7), rtol=1e-6)
    x = hax.arange((A, B))
    np.testing.assert_array_equal(hax.fftshift(x).array, np.fft.fftshift(np.arange(12).reshape(3, 4)))
    np.testing.assert_array_equal(hax.fftshift(x, "b").array, np.fft.fftshift(np.arange(12).reshape(3, 4), axes=1))
    np.testing.assert_array_equal(hax.ifftshift(hax.fftshift(x, ("a", "b")), ("a", "b")).array, x.array)


def test_missing_axis_is_an_error():
    with pytest.raises(ValueError, match="'z'"):
        hax.fft(hax.zeros((A,)), axis="z")
    with pytest.raises(ValueError, match="at least one axis"):
        hax.fft(hax.named(jnp.zeros(()), ()))
