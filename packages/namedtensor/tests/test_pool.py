"""Pooling against naive NumPy loops over windows (with padding, strides and ceil mode)."""

import itertools

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

import ponente.namedtensor as hax
from ponente.namedtensor import Axis, nn


def _np_pool(x, window, stride, pads, fn, fill, ceil=False, include_pad=False):
    """x: [b, *spatial]; pads: (lo, hi) per spatial axis."""
    sizes = x.shape[1:]
    outs = []
    for n, w, s, (lo, hi) in zip(sizes, window, stride, pads):
        total = n + lo + hi
        outs.append((-(-(total - w) // s) if ceil else (total - w) // s) + 1)
    out = np.zeros((x.shape[0], *outs))
    for pos in itertools.product(*[range(o) for o in outs]):
        vals, counted = [], 0
        for kk in itertools.product(*[range(w) for w in window]):
            idx = [p * s + q - lo for p, s, q, (lo, _) in zip(pos, stride, kk, pads)]
            inside = all(0 <= i < n for i, n in zip(idx, sizes))
            in_requested = all(-lo <= i < n + hi for i, n, (lo, hi) in zip(idx, sizes, pads))
            if inside:
                vals.append(x[(slice(None), *idx)])
                counted += 1
            elif include_pad and in_requested:
                counted += 1
                vals.append(np.full(x.shape[0], fill))
        # a window lying entirely in the padding reduces to the identity (the padding value)
        out[(slice(None), *pos)] = fn(np.stack(vals, 0), counted) if vals else fill
    return out


MAX = (lambda v, n: v.max(0), -np.inf)
MIN = (lambda v, n: v.min(0), np.inf)


@given(st.integers(1, 3), st.integers(1, 3), st.integers(1, 2), st.integers(0, 1), st.booleans())
def test_max_min_pool_loop(w0, w1, stride, pad, ceil):
    raw = np.random.default_rng(w0 * 7 + w1).standard_normal((2, 5, 6)).astype(np.float32)
    x = hax.named(raw, ("b", "h", "w"))
    Window = (Axis("h", w0), Axis("w", w1))
    pads = [(pad, pad)] * 2
    out = nn.max_pool(Window, x, stride=stride, padding=pad, use_ceil=ceil)
    assert out.axis_names == ("b", "h", "w")
    ref = _np_pool(raw, (w0, w1), (stride, stride), pads, MAX[0], MAX[1], ceil)
    np.testing.assert_allclose(out.array, ref, rtol=1e-6)
    out = nn.min_pool(Window, x, stride=stride, padding=pad, use_ceil=ceil)
    np.testing.assert_allclose(out.array, _np_pool(raw, (w0, w1), (stride, stride), pads, MIN[0], MIN[1], ceil))


@pytest.mark.parametrize("include_pad", [False, True])
@pytest.mark.parametrize("ceil", [False, True])
def test_mean_pool_loop(include_pad, ceil):
    raw = np.random.default_rng(0).standard_normal((3, 7)).astype(np.float32)
    out = nn.mean_pool(
        Axis("t", 3), hax.named(raw, ("b", "t")), stride=2, padding=1, use_ceil=ceil, count_include_pad=include_pad
    )
    ref = _np_pool(raw, (3,), (2,), [(1, 1)], lambda v, n: v.sum(0) / n, 0.0, ceil, include_pad)
    np.testing.assert_allclose(out.array, ref, rtol=1e-5)


@pytest.mark.parametrize("dtype", [np.int32, np.uint8, np.bool_])
@pytest.mark.parametrize("ceil", [False, True])
def test_max_min_pool_of_integers_and_booleans_ignore_the_padding(dtype, ceil):
    raw = np.random.default_rng(2).integers(0, 2 if dtype is np.bool_ else 50, size=(2, 7)).astype(dtype)
    x = hax.named(raw, ("b", "t"))
    for pool, (fn, _) in ((nn.max_pool, MAX), (nn.min_pool, MIN)):
        out = pool(Axis("t", 3), x, stride=2, padding=1, use_ceil=ceil)
        assert out.dtype == dtype
        # the loop only reduces real elements, so no fill value is ever used
        ref = _np_pool(raw.astype(np.float64), (3,), (2,), [(1, 1)], fn, None, ceil)
        np.testing.assert_array_equal(out.array, ref.astype(dtype))


def test_same_padding_and_axis_order():
    raw = np.random.default_rng(1).standard_normal((5, 2)).astype(np.float32)
    out = nn.max_pool({"t": 2}, hax.named(raw, ("t", "b")), padding="SAME")
    assert out.shape == {"t": 5, "b": 2}
    ref = _np_pool(raw.T, (2,), (1,), [(0, 1)], MAX[0], MAX[1]).T
    np.testing.assert_allclose(out.array, ref)


def test_pool_errors():
    x = hax.ones({"b": 2, "t": 4})
    with pytest.raises(ValueError, match="'h'"):
        nn.max_pool(Axis("h", 2), x)
    with pytest.raises(ValueError, match="stride"):
        nn.max_pool(Axis("t", 2), x, stride=(1, 2))
