"""Tests for ``rearrange``: axis lists and einops-like expressions against NumPy reshape/transpose."""

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


def _arange(shape):
    sizes = tuple(shape.values())
    return NamedArray(
        jnp.arange(int(np.prod(sizes)), dtype=jnp.int32).reshape(sizes), tuple(Axis(n, s) for n, s in shape.items())
    )


@st.composite
def named_arrays(draw):
    names = draw(st.permutations(POOL))[: draw(st.integers(1, 5))]
    return _arange({n: draw(st.integers(1, 3)) for n in names})


@settings(max_examples=40, deadline=None)
@given(named_arrays(), st.data())
def test_axis_list_matches_transpose(x, data):
    names = [ax.name for ax in x.axes]
    order = data.draw(st.permutations(names))
    listed = order[: data.draw(st.integers(0, len(order)))]
    if len(listed) < len(order):
        spec = list(listed)
        spec.insert(data.draw(st.integers(0, len(spec))), ...)
        rest = [n for n in names if n not in listed]
        at = spec.index(...)
        expected = spec[:at] + rest + spec[at + 1 :]
    else:
        spec = expected = list(order)
    result = hax.rearrange(x, spec)
    assert [ax.name for ax in result.axes] == expected
    np.testing.assert_array_equal(result.array, np.transpose(np.asarray(x.array), [names.index(n) for n in expected]))
    # the same axes passed as separate arguments
    assert hax.rearrange(x, *spec).axes == result.axes


@settings(max_examples=40, deadline=None)
@given(named_arrays(), st.data())
def test_positional_expression_uses_variables(x, data):
    names = [ax.name for ax in x.axes]
    variables = [f"v{i}" for i in range(len(names))]
    perm = data.draw(st.permutations(range(len(names))))
    result = hax.rearrange(x, f"{' '.join(variables)} -> {' '.join(variables[i] for i in perm)}")
    assert [ax.name for ax in result.axes] == [names[i] for i in perm]
    np.testing.assert_array_equal(result.array, np.transpose(np.asarray(x.array), perm))


@settings(max_examples=40, deadline=None)
@given(st.data())
def test_split_and_merge_match_numpy(data):
    # atoms p0..pk with sizes; the input merges consecutive atoms into groups; the output regroups them
    k = data.draw(st.integers(1, 4))
    sizes = [data.draw(st.integers(1, 3)) for _ in range(k)]
    cuts = sorted(data.draw(st.sets(st.integers(1, k - 1), max_size=k - 1))) if k > 1 else []
    groups = [list(range(s, e)) for s, e in zip([0, *cuts], [*cuts, k])]
    x = _arange({f"g{i}": int(np.prod([sizes[j] for j in g])) for i, g in enumerate(groups)})
    lhs = " ".join(f"(g{i}: {' '.join(f'p{j}' for j in g)})" for i, g in enumerate(groups))
    perm = data.draw(st.permutations(range(k)))
    out_cut = data.draw(st.integers(0, k))
    merged, single = perm[:out_cut], perm[out_cut:]
    rhs = (f"(m: {' '.join(f'p{j}' for j in merged)}) " if merged else "") + " ".join(f"p{j}" for j in single)
    bindings = {f"p{j}": sizes[j] for j in range(k)}
    result = hax.rearrange(x, f"{lhs} -> {rhs}", **bindings)
    reference = np.asarray(x.array).reshape(sizes).transpose(perm)
    out_shape = ([int(np.prod([sizes[j] for j in merged]))] if merged else []) + [sizes[j] for j in single]
    np.testing.assert_array_equal(result.array, reference.reshape(out_shape))
    expected_axes = ([Axis("m", out_shape[0])] if merged else []) + [Axis(f"p{j}", sizes[j]) for j in single]
    assert result.axes == tuple(expected_axes)


def test_einops_examples():
    x = _arange({"N": 4, "C": 3, "H": 4, "W": 6})
    raw = np.asarray(x.array)
    y = hax.rearrange(x, "N C H W -> N H W C")
    np.testing.assert_array_equal(y.array, raw.transpose(0, 2, 3, 1))
    y = hax.rearrange(x, "{H W} -> ... W H")
    assert [a.name for a in y.axes] == ["N", "C", "W", "H"]
    np.testing.assert_array_equal(y.array, raw.transpose(0, 1, 3, 2))
    y = hax.rearrange(x, "N C ... -> N ... C")
    np.testing.assert_array_equal(y.array, raw.transpose(0, 2, 3, 1))
    y = hax.rearrange(x, "{(N: step mb) ...} -> step mb ...", step=2)
    assert y.shape == {"step": 2, "mb": 2, "C": 3, "H": 4, "W": 6}
    np.testing.assert_array_equal(y.array, raw.reshape(2, 2, 3, 4, 6))
    back = hax.rearrange(y, "step mb ... -> (N: step mb) ...")
    np.testing.assert_array_equal(back.array, raw)
    # patches: einops "n c (ph h) (pw w) -> n (ph pw) c h w"
    y = hax.rearrange(x, "N C (ph H) (pw W) -> N (P: ph pw) C H W", H=2, W=3)
    expected = raw.reshape(4, 3, 2, 2, 2, 3).transpose(0, 2, 4, 1, 3, 5).reshape(4, 4, 3, 2, 3)
    np.testing.assert_array_equal(y.array, expected)
    assert y.shape == {"N": 4, "P": 4, "C": 3, "H": 2, "W": 3}
    # unordered version with aliases for the names
    y2 = hax.rearrange(x, "{(H: ph h) (W: pw w) C} -> ... (P: ph pw) C h w", h=Axis("H", 2), w=Axis("W", 3))
    np.testing.assert_array_equal(y2.array, expected)
    assert y2.axes == y.axes
    y3 = hax.rearrange(x, "N C (nh ph) (nw pw) -> N (P: nh nw) (C: C ph pw)", P="patch", pw=3, ph=2)
    assert y3.shape == {"N": 4, "patch": 4, "C": 18}


@pytest.mark.parametrize(
    ("expression", "message", "position"),
    [
        ("N C H W", "expected '->'", 7),
        ("N (C H W -> N", "unclosed '('", 2),
        ("N C H W -> N {C} H W", "'{' may only open a side", 13),
        ("N C H W -> N C H W)", "unmatched ')'", 18),
        ("N ... C ... -> N C", "Only one ellipsis allowed", 8),
        ("N C H -> N C H", "the left side names 3 axes but the array has 4", 0),
        ("N C H W -> N C H", "Not all intermediate axes are used: ('W',)", 11),
        ("N C H W -> N C H W Q", "Axis Q is not bound on the lhs", 19),
        ("N C H W -> N (C H) W", "All rhs axes must have a name", 13),
        ("N C (H: a b) W -> N C a b W", "cannot infer the sizes of a, b", 4),
        ("{Q} -> ...", "Could not resolve axis 'Q'", 1),
        ("{H} -> H", "Not all intermediate axes are used: ('N', 'C', 'W')", 7),
        ("N C (a b) W -> N C a b W", "cannot be split into pieces of size 3", 4),
        ("N N H W -> N H W", "Capture N is assigned more than once", 2),
    ],
)
def test_errors_point_at_the_character(expression, message, position):
    x = _arange({"N": 4, "C": 3, "H": 4, "W": 6})
    bindings = {"a": 3} if "(a b)" in expression else {}
    with pytest.raises(ValueError, match=re.escape(message)) as info:
        hax.rearrange(x, expression, **bindings)
    lines = str(info.value).splitlines()
    assert lines[-2].strip() == expression
    assert lines[-1].index("^") - lines[-2].index(expression[0]) == position


def test_axis_list_errors():
    x = _arange({"N": 2, "C": 3})
    with pytest.raises(ValueError, match="'Q' is not in the array"):
        hax.rearrange(x, ("Q", ...))
    with pytest.raises(ValueError, match=r"axes \('C',\) of the array are not listed"):
        hax.rearrange(x, ("N",))
    with pytest.raises(TypeError, match="only allowed with an expression"):
        hax.rearrange(x, ("N", "C"), N=2)
    with pytest.raises(ValueError, match="do not occur in the expression"):
        hax.rearrange(x, "N C -> C N", Z=3)


def test_rearrange_under_jit_and_grad():
    x = NamedArray(jnp.arange(6.0).reshape(2, 3), (Axis("N", 2), Axis("C", 3)))
    f = jax.jit(lambda x: hax.rearrange(x, "N (C: a b) -> b N a", a=1))
    y = f(x)
    assert y.shape == {"b": 3, "N": 2, "a": 1}
    g = jax.grad(lambda x: (hax.rearrange(x, ("C", "N")).array * jnp.arange(6.0).reshape(3, 2)).sum())(x)
    np.testing.assert_array_equal(g.array, np.arange(6.0).reshape(3, 2).T)


def test_method_form_delegates_to_rearrange():
    x = _arange({"N": 2, "C": 3})
    np.testing.assert_array_equal(x.rearrange("n c -> c n").array, np.arange(6).reshape(2, 3).T)
    assert x.rearrange(("C", ...)).axes == (Axis("C", 3), Axis("N", 2))


def test_several_ellipses_and_renames_match_numpy():
    x = _arange({"N": 2, "C": 3, "H": 4, "W": 5})
    raw = np.asarray(x.array)
    # N comes first -> first '...'; C (listed) moves the current '...' past itself, so W lands in the last one
    y = hax.rearrange(x, "n c h w -> ... h ... c ...")
    assert [a.name for a in y.axes] == ["N", "H", "C", "W"]
    np.testing.assert_array_equal(y.array, raw.transpose(0, 2, 1, 3))
    y = hax.rearrange(x, "n c h w -> c ... (P: n h) ... w")
    assert y.shape == {"C": 3, "P": 8, "W": 5}
    np.testing.assert_array_equal(y.array, raw.transpose(1, 0, 2, 3).reshape(3, 8, 5))
    # (name: x) renames; an identifier bound on the left names the merged axis after its axis
    y = hax.rearrange(x, "n c h w -> (K: c) (n: n h) w")
    assert y.shape == {"K": 3, "N": 8, "W": 5}
    np.testing.assert_array_equal(y.array, raw.transpose(1, 0, 2, 3).reshape(3, 8, 5))
    # on an ordered side the name of a split group is not checked against the axis (it matches by position)
    y = hax.rearrange(x, "n c (whatever: h1 h2) w -> n c h1 h2 w", h1=2)
    np.testing.assert_array_equal(y.array, raw.reshape(2, 3, 2, 2, 5))


def test_keyword_forms():
    x = _arange({"N": 2, "C": 3})
    assert hax.rearrange(x, axes=("C", "N")).axes == (Axis("C", 3), Axis("N", 2))
    assert hax.rearrange(x, expression="n c -> (M: c n)").shape == {"M": 6}
