"""Hypothesis strategies and helpers shared by the named-tensor tests (importable thanks to conftest.py)."""

from collections.abc import Sequence

import hypothesis.strategies as st
import numpy as np

from ponente.namedtensor import Axis, NamedArray, named

NAMES = ("a", "b", "c", "d", "e")


@st.composite
def axes_st(draw, min_axes: int = 0, max_axes: int = 3, names: Sequence[str] = NAMES, max_size: int = 4):
    """A tuple of axes with distinct random names (in random order) and random sizes."""
    chosen = draw(st.lists(st.sampled_from(list(names)), unique=True, min_size=min_axes, max_size=max_axes))
    sizes = draw(st.lists(st.integers(1, max_size), min_size=len(chosen), max_size=len(chosen)))
    return tuple(Axis(n, s) for n, s in zip(chosen, sizes))


def random_named(axes: Sequence[Axis], seed: int, dtype=np.float32, low: int = -5, high: int = 5) -> NamedArray:
    """A named array with reproducible random values."""
    rng = np.random.default_rng(seed)
    shape = tuple(ax.size for ax in axes)
    if np.issubdtype(dtype, np.integer):
        values = rng.integers(low, high, size=shape).astype(dtype)
    elif dtype is bool:
        values = rng.random(shape) < 0.5
    else:
        values = rng.uniform(low, high, size=shape).astype(dtype)
    return named(values, tuple(axes))


@st.composite
def named_st(draw, min_axes: int = 0, max_axes: int = 3, dtype=np.float32, axes=None):
    """A random named array (random names, order, sizes and values)."""
    if axes is None:
        axes = draw(axes_st(min_axes, max_axes))
    return random_named(axes, draw(st.integers(0, 2**16)), dtype)


def to_numpy(x: NamedArray, order: Sequence[str]) -> np.ndarray:
    """The array transposed to the given axis-name order (an independent positional reference)."""
    assert sorted(x.axis_names) == sorted(order), (x.axis_names, order)
    return np.transpose(np.asarray(x.array), [x.axis_names.index(n) for n in order])
