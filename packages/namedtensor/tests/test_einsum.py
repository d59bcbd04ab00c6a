"""Tests for ``einsum`` (ordered, unordered, output-only forms) against ``np.einsum``."""

import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import ponente.namedtensor as hax
from ponente.namedtensor import Axis, NamedArray

POOL = ("a", "b", "c", "d", "e")


@st.composite
def operands(draw):
    sizes = {name: draw(st.integers(1, 3)) for name in POOL}
    arrays = []
    for _ in range(draw(st.integers(1, 3))):
        names = draw(st.permutations(POOL))[: draw(st.integers(1, 4))]
        shape = tuple(sizes[n] for n in names)
        raw = np.random.default_rng(draw(st.integers(0, 2**16))).standard_normal(shape).astype(np.float32)
        arrays.append(NamedArray(jnp.asarray(raw), tuple(Axis(n, sizes[n]) for n in names)))
    return arrays


def _union(arrays):
    out = []
    for a in arrays:
        out += [ax.name for ax in a.axes if ax.name not in out]
    return out


def _reference(arrays, out_names):
    names = sorted({ax.name for a in arrays for ax in a.axes})
    letters = {name: chr(ord("a") + i) for i, name in enumerate(names)}
    spec = ",".join("".join(letters[ax.name] for ax in a.axes) for a in arrays)
    spec += "->" + "".join(letters[n] for n in out_names)
    return np.einsum(spec, *[np.asarray(a.array, dtype=np.float64) for a in arrays])


def _check(result, arrays, names):
    assert [ax.name for ax in result.axes] == list(names)
    np.testing.assert_allclose(result.array, _reference(arrays, names), rtol=1e-4, atol=1e-4)


@settings(max_examples=40, deadline=None)
@given(operands(), st.data())
def test_ordered_matches_numpy(arrays, data):
    # labels differ from the axis names: the ordered form matches by position
    lhs = ", ".join(" ".join(f"L{ax.name}" for ax in a.axes) for a in arrays)
    out = data.draw(st.permutations(_union(arrays)))
    out = out[: data.draw(st.integers(0, len(out)))]
    result = hax.einsum(f"{lhs} -> {' '.join(f'L{n}' for n in out)}", *arrays)
    _check(result, arrays, out)


@settings(max_examples=40, deadline=None)
@given(operands(), st.data())
def test_unordered_matches_numpy(arrays, data):
    union = _union(arrays)
    named = data.draw(st.lists(st.sampled_from(union), unique=True))
    kept = data.draw(st.lists(st.sampled_from(named), unique=True)) if named else []
    result = hax.einsum(f"{{{' '.join(named)}}} -> {' '.join(kept)}", *arrays)
    contracted = set(named) - set(kept)
    expected = [n for n in union if n not in contracted and n not in kept] + kept
    _check(result, arrays, expected)


@settings(max_examples=40, deadline=None)
@given(operands(), st.data())
def test_output_only_matches_numpy(arrays, data):
    out = data.draw(st.permutations(_union(arrays)))
    out = out[: data.draw(st.integers(0, len(out)))]
    result = hax.einsum(f"-> {' '.join(out)}", *arrays)
    _check(result, arrays, out)


def _xw():
    rng = np.random.default_rng(0)
    x = NamedArray(
        jnp.asarray(rng.standard_normal((2, 3, 4)), jnp.float32), (Axis("H", 2), Axis("W", 3), Axis("D", 4))
    )
    w = NamedArray(jnp.asarray(rng.standard_normal(4), jnp.float32), (Axis("D", 4),))
    return x, w


def test_ellipsis_forms():
    x, w = _xw()
    _check(hax.einsum("... d, d -> ...", x, w), [x, w], ["H", "W"])
    _check(hax.einsum("h ..., d -> ... h", x, w), [x, w], ["W", "H"])
    _check(hax.einsum("{H ...} -> H", x), [x], ["H"])
    _check(hax.einsum("{H ...} -> ...", x), [x], ["W", "D"])
    _check(hax.einsum("{D} -> ... H", x, w), [x, w], ["W", "H"])
    _check(hax.einsum("-> D ...", x), [x], ["D", "H", "W"])


def test_aliases():
    x, w = _xw()
    Height, Depth = Axis("H", 2), Axis("D", 4)
    _check(hax.einsum("{h d} -> h", x, w, h=Height, d=Depth), [x, w], ["W", "H"])
    _check(hax.einsum("-> h", x, w, h="H"), [x, w], ["H"])
    _check(hax.einsum("a b c, c -> a", x, w, c=Depth), [x, w], ["H"])
    with pytest.raises(ValueError, match="aliased"):
        hax.einsum("a b c, c -> a", x, w, a=Depth)
    with pytest.raises(ValueError, match="size"):
        hax.einsum("{d} -> ", x, w, d=Axis("D", 5))
    with pytest.raises(ValueError, match="Axis alias z not used"):
        hax.einsum("{D} -> ", x, w, z="H")


@pytest.mark.parametrize(
    ("equation", "message", "position"),
    [
        ("h w d, d", "expected '->'", 8),
        ("h w d, d - h", "unexpected character '-'", 9),
        ("h w (d e) -> h", "groups are not supported", 4),
        ("{h w -> h", "unclosed '{'", 0),
        ("h w d, {d} -> h", "must be the only one", 7),
        ("h w d, d -> {h}", "must be ordered", 12),
        ("h w d, d -> h ... ...", "at most once", 18),
        ("h w d, d -> h $", "unexpected character '$'", 14),
    ],
)
def test_parse_errors_point_at_the_character(equation, message, position):
    x, w = _xw()
    with pytest.raises(ValueError, match=re.escape(message)) as info:
        hax.einsum(equation, x, w)
    lines = str(info.value).splitlines()
    assert lines[-2].strip() == equation
    assert lines[-1].index("^") - lines[-2].index(equation[0]) == position


def test_semantic_errors():
    x, w = _xw()
    with pytest.raises(ValueError, match="operand 0 has axes"):
        hax.einsum("h w, d -> h", x, w)
    with pytest.raises(ValueError, match=r"Number of operand groups \(2\) does not match number of arrays \(1\)"):
        hax.einsum("h w d, d -> h", x)
    with pytest.raises(ValueError, match="'q' does not occur on the left"):
        hax.einsum("h w d, d -> q", x, w)
    with pytest.raises(ValueError, match="Axis nope not present"):
        hax.einsum("-> nope", x)
    with pytest.raises(ValueError, match="label 'd' matches axis 'D' earlier but 'H'"):
        hax.einsum("h w d, d -> h", x, NamedArray(jnp.ones(2), (Axis("H", 2),)))


def test_einsum_jit_grad():
    x, w = _xw()
    grad = jax.jit(jax.grad(lambda w: hax.einsum("{D} -> H W", x, w).array.sum()))(w)
    assert grad.axes == w.axes
    np.testing.assert_allclose(grad.array, np.asarray(x.array).sum((0, 1)), rtol=1e-5)


def test_several_ellipses_on_the_output():
    x, w = _xw()
    # W comes after H (listed first), so it joins the '...' after H; nothing precedes H
    _check(hax.einsum("{} -> ... H ... D", x, w), [x, w], ["H", "W", "D"])
    _check(hax.einsum("-> ... D ... H", x), [x], ["W", "D", "H"])
    _check(hax.einsum("{H} -> ... D ...", x, w), [x, w], ["W", "D"])
