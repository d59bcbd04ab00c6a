"""Conv / ConvTranspose against naive NumPy loops (correlation and scatter), named axes in any order."""

import itertools

import jax
import numpy as np
import pytest

import ponente.namedtensor as hax
from ponente.namedtensor import Axis, nn

C, D = Axis("c", 4), Axis("d", 6)


def _np_conv(x, w, stride, pads, dil, groups):
    """x: [b, c, *s], w: [o, c/g, *k]; naive correlation."""
    x = np.pad(x, [(0, 0), (0, 0), *pads])
    b, _c = x.shape[:2]
    o, cg = w.shape[:2]
    ks = w.shape[2:]
    out_sizes = [(x.shape[2 + i] - dil[i] * (ks[i] - 1) - 1) // stride[i] + 1 for i in range(len(ks))]
    out = np.zeros((b, o, *out_sizes))
    og = o // groups
    for oi in range(o):
        g = oi // og
        for pos in itertools.product(*[range(n) for n in out_sizes]):
            acc = np.zeros(b)
            for ci in range(cg):
                for kk in itertools.product(*[range(k) for k in ks]):
                    idx = tuple(p * s + q * d for p, s, q, d in zip(pos, stride, kk, dil))
                    acc += x[(slice(None), g * cg + ci, *idx)] * w[(oi, ci, *kk)]
            out[(slice(None), oi, *pos)] = acc
    return out


@pytest.mark.parametrize(
    ("kernel", "stride", "padding", "dilation", "groups"),
    [(3, 1, 0, 1, 1), (3, 2, 1, 1, 2), ((2, 3), (1, 2), ((1, 0), (2, 1)), (2, 1), 1)],
)
def test_conv2d_matches_loop(kernel, stride, padding, dilation, groups):
    conv = nn.Conv.init(
        ("h", "w"),
        C,
        D,
        kernel,
        stride=stride,
        padding=padding,
        dilation=dilation,
        groups=groups,
        key=jax.random.key(0),
    )
    raw = np.random.default_rng(0).standard_normal((2, 4, 7, 6)).astype(np.float32)
    # named input with axes in a scrambled order: (w, b, c, h)
    x = hax.named(raw.transpose(3, 0, 1, 2), ("w", "b", "c", "h"))
    out = conv(x)
    assert out.axis_names == ("b", "d", "h", "w")
    w = np.asarray(conv.weight.array)
    assert conv.weight.axis_names == ("d", "c", "h", "w")
    ref = (
        _np_conv(raw, w, conv.stride, list(conv.padding), conv.dilation, groups)
        + np.asarray(conv.bias.array)[:, None, None]
    )
    np.testing.assert_allclose(out.array, ref, rtol=1e-4, atol=1e-4)


def test_conv_same_padding_and_no_batch():
    conv = nn.Conv.init("t", C, D, 3, padding="SAME", use_bias=False, key=jax.random.key(1))
    raw = np.random.default_rng(1).standard_normal((4, 9)).astype(np.float32)
    out = conv(hax.named(raw, ("c", "t")))
    assert out.shape == {"d": 6, "t": 9}
    ref = _np_conv(raw[None], np.asarray(conv.weight.array), (1,), [(1, 1)], (1,), 1)[0]
    np.testing.assert_allclose(out.array, ref, rtol=1e-4, atol=1e-4)


def _np_conv_transpose(x, w, stride, pads, dil, out_pad):
    """Scatter definition: out[o, i*s + (K-1-k)*d - lo] += x[c, i] * w[o, c, k] (1-D, groups=1, unflipped kernel)."""
    b, _c, n = x.shape
    o, _, k = w.shape
    size = (n - 1) * stride - pads[0] - pads[1] + dil * (k - 1) + 1 + out_pad
    out = np.zeros((b, o, size))
    for i in range(n):
        for kk in range(k):
            t = i * stride + (k - 1 - kk) * dil - pads[0]
            if 0 <= t < size:
                out[:, :, t] += x[:, :, i] @ w[:, :, kk].T
    return out


@pytest.mark.parametrize(
    ("stride", "padding", "dilation", "out_pad"), [(1, 0, 1, 0), (2, 1, 1, 1), (3, ((0, 2),), 2, 0)]
)
def test_conv_transpose_matches_scatter(stride, padding, dilation, out_pad):
    layer = nn.ConvTranspose.init(
        "t", C, D, 3, stride=stride, padding=padding, dilation=dilation, output_padding=out_pad, key=jax.random.key(2)
    )
    raw = np.random.default_rng(2).standard_normal((2, 4, 5)).astype(np.float32)
    out = layer(hax.named(raw, ("b", "c", "t")))
    pads = (padding, padding) if isinstance(padding, int) else padding[0]
    ref = _np_conv_transpose(raw, np.asarray(layer.weight.array), stride, pads, dilation, out_pad)
    ref = ref + np.asarray(layer.bias.array)[:, None]
    np.testing.assert_allclose(out.array, ref, rtol=1e-4, atol=1e-4)


def test_conv_transpose_is_the_adjoint_of_conv():
    conv = nn.Conv.init("t", C, D, 3, stride=2, padding=1, use_bias=False, key=jax.random.key(3))
    # the transposed layer maps D -> C and shares the weight (Out=D rows, In=C columns) transposed and flipped
    up = nn.ConvTranspose.init(
        "t", D, C, 3, stride=2, padding=1, output_padding=1, use_bias=False, key=jax.random.key(4)
    )
    up = nn.ConvTranspose(
        hax.named(np.asarray(conv.weight.array).transpose(1, 0, 2)[..., ::-1], ("c", "d", "t")),
        None,
        up.Spatial,
        up.In,
        up.Out,
        up.kernel_size,
        up.stride,
        up.padding,
        up.dilation,
        up.groups,
        up.output_padding,
    )
    x = hax.random.normal(jax.random.key(5), (C, Axis("t", 8)))
    y = hax.random.normal(jax.random.key(6), (D, Axis("t", 4)))
    lhs = float(hax.sum(conv(x) * y).scalar())
    rhs = float(hax.sum(x * up(y)).scalar())
    assert abs(lhs - rhs) < 1e-3 * max(1.0, abs(lhs))


def test_conv_errors():
    with pytest.raises(ValueError, match="divisible"):
        nn.Conv.init("t", C, D, 3, groups=3, key=jax.random.key(0))
    conv = nn.Conv.init("t", C, D, 3, key=jax.random.key(0))
    with pytest.raises(ValueError, match="'t'"):
        conv(hax.ones({"c": 4, "time": 5}))
    with pytest.raises(ValueError, match=r"'c'.*size 3"):
        conv(hax.ones({"c": 3, "t": 5}))
    with pytest.raises(ValueError, match="integer padding"):
        nn.ConvTranspose.init("t", C, D, 3, padding="SAME", key=jax.random.key(0))
