"""The fused cross-entropy (position chunks, gradient computed with the loss) vs the plain materialized loss."""

from __future__ import annotations

import re
from typing import Any

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import pytest

import ponente.models.loss.fused as fused_kernel
import ponente.models.loss.next_token as next_token
import ponente.namedtensor as hax
from ponente.models import LlamaConfig, LmExample, compute_next_token_loss
from ponente.models.loss import fused_cross_entropy_loss
from ponente.namedtensor import NamedArray

B, P, E, V = hax.make_axes(batch=3, position=7, embed=6, vocab=23)


@pytest.fixture(autouse=True)
def _float32_products() -> Any:
    """Full float32 matrix products on every device (GPUs default to TF32, far from a 1e-5 tolerance)."""
    with jax.default_matmul_precision("highest"):
        yield


def _inputs(seed: int = 0) -> tuple[NamedArray, NamedArray, NamedArray, NamedArray]:
    keys = jax.random.split(jax.random.key(seed), 4)
    hidden = hax.random.normal(keys[0], (B, P, E))
    head = hax.random.normal(keys[1], (V, E)) * 0.5  # (vocab, embed): either order is accepted
    # some ids outside the vocabulary (target logit 0, as the plain loss's one-hot)
    targets = hax.random.randint(keys[2], (B, P), 0, V.size + 3)
    mask = (hax.random.uniform(keys[3], (B, P)) > 0.3).astype(jnp.float32)
    return hidden, head, targets, mask


def _plain(h: jax.Array, w: jax.Array, t: jax.Array, m: jax.Array, z: float, reduction: str) -> jax.Array:
    """The materialized loss: full float32 logits ``[batch, position, vocab]``, reduced like the trainer's."""
    logits = jnp.einsum("bpe,ve->bpv", h, w)
    lse = jax.nn.logsumexp(logits, axis=-1)
    per = lse - jnp.sum(logits * jax.nn.one_hot(t, V.size), axis=-1) + z * lse**2
    total = jnp.sum(per * m)
    return total / jnp.maximum(jnp.sum(m), 1.0) if reduction == "mean" else total


def _assert_close(a: Any, b: Any) -> None:
    # relative to each array's largest entry (head gradients are ~1/vocab)
    a, b = np.asarray(a), np.asarray(b)
    np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-5 * max(float(np.abs(b).max()), 1.0))


@pytest.mark.parametrize("reduction", ["mean", "sum"])
@pytest.mark.parametrize("chunk_size", [None, 1, 3, 4, 100])  # 3, 4: 7 positions are not a multiple
@pytest.mark.parametrize("z", [0.0, 1e-2])
def test_fused_loss_and_gradients_match_plain(reduction: str, chunk_size: int | None, z: float) -> None:
    hidden, head, targets, mask = _inputs()

    def fused(h: NamedArray, w: NamedArray) -> jax.Array:
        loss = fused_cross_entropy_loss(
            h, w, targets, weights=mask, reduction=reduction, z_loss_weight=z, chunk_size=chunk_size
        )
        assert loss.axes == ()
        return loss.scalar()

    def plain(h: jax.Array, w: jax.Array) -> jax.Array:
        return _plain(h, w, targets.array, mask.array, z, reduction)

    loss, grads = jax.jit(jax.value_and_grad(fused, argnums=(0, 1)))(hidden, head)
    ref, ref_grads = jax.value_and_grad(plain, argnums=(0, 1))(hidden.array, head.array)
    _assert_close(loss, ref)
    _assert_close(fused(hidden, head), ref)  # the primal path (no gradient) too
    assert grads[0].axes == hidden.axes
    assert grads[1].axes == head.axes
    for g, r in zip(grads, ref_grads, strict=True):
        _assert_close(g.array, r)


def test_fused_loss_weights_and_layout() -> None:
    """Per-token weights get their gradient (the per-token loss); the position axis need not be next to last."""
    hidden, head, targets, mask = _inputs(1)
    weights = mask * hax.random.uniform(jax.random.key(9), (B, P))
    per_token = jax.grad(lambda m: _plain(hidden.array, head.array, targets.array, m, 1e-2, "sum"))(weights.array)

    def fused(wt: NamedArray, h: NamedArray) -> jax.Array:
        return fused_cross_entropy_loss(h, head, targets, weights=wt, reduction="sum", z_loss_weight=1e-2).scalar()

    g = jax.grad(fused)(weights, hidden.rearrange((P, E, B)))
    _assert_close(g.rearrange((B, P)).array, per_token)
    # no weights: all tokens count once
    unweighted = fused_cross_entropy_loss(hidden, head, targets, chunk_size=2).scalar()
    _assert_close(unweighted, _plain(hidden.array, head.array, targets.array, jnp.ones((3, 7)), 0.0, "mean"))


@pytest.mark.parametrize("groups", [1, 3])
def test_fused_loss_groups_match_plain(groups: int) -> None:
    """Groups of the batch (each summing its own loss and head gradient) give the plain loss and gradients."""
    hidden, head, targets, mask = _inputs(3)

    def fused(h: NamedArray, w: NamedArray) -> jax.Array:
        # the batch last among the token axes: the grouped axis is moved first whatever the layout
        loss = fused_cross_entropy_loss(h, w, targets, weights=mask, z_loss_weight=1e-2, chunk_size=3, groups=groups)
        return loss.scalar()

    loss, grads = jax.value_and_grad(fused, argnums=(0, 1))(hidden.rearrange((P, E, B)), head)
    ref, ref_grads = jax.value_and_grad(
        lambda h, w: _plain(h, w, targets.array, mask.array, 1e-2, "mean"), argnums=(0, 1)
    )(hidden.array, head.array)
    _assert_close(loss, ref)
    _assert_close(grads[0].rearrange((B, P, E)).array, ref_grads[0])
    _assert_close(grads[1].array, ref_grads[1])


def test_fused_loss_checks_groups() -> None:
    hidden, head, targets, _ = _inputs()
    with pytest.raises(ValueError, match="groups must be >= 1"):
        fused_cross_entropy_loss(hidden, head, targets, groups=0)
    with pytest.raises(ValueError, match=r"groups=2 must divide .*batch"):
        fused_cross_entropy_loss(hidden, head, targets, groups=2)  # batch 3


def _loop_collectives(hlo: str) -> tuple[list[str], list[str]]:
    """The cross-device collectives of compiled HLO text: those inside while-loop bodies, and all of them."""
    computations: dict[str, list[str]] = {}
    current = None
    for line in hlo.splitlines():
        if line and not line.startswith(" ") and line.rstrip().endswith("{"):
            current = "ENTRY" if line.startswith("ENTRY") else line.split(" ")[0]
            computations[current] = []
        elif current is not None:
            computations[current].append(line)
    pattern = re.compile(r" (all-reduce|reduce-scatter|all-gather)(-start)?\(")
    bodies = set(re.findall(r"body=(%[\w.\-]+)", hlo))
    inside = [m.group(1) for b in bodies for line in computations.get(b, []) if (m := pattern.search(line))]
    every = [m.group(1) for lines in computations.values() for line in lines if (m := pattern.search(line))]
    return inside, every


@pytest.mark.multidevice
@pytest.mark.parametrize("head_mapping", [{}, {"embed": "data"}], ids=["dp", "fsdp"])
def test_fused_loss_reduces_across_devices_once(head_mapping: dict[str, str]) -> None:
    """Batch sharded over 8 devices (the head replicated, or split FSDP-style over its embedding): the head's gradient
    is reduced after the chunk loop, not once per chunk."""
    import ponente.namedtensor.partitioning as partitioning

    assert len(jax.devices()) == 8, "run with XLA_FLAGS=--xla_force_host_platform_device_count=8"
    Batch, Pos, Embed, Vocab = hax.make_axes(batch=16, position=64, embed=16, vocab=256)
    keys = jax.random.split(jax.random.key(5), 3)
    hidden = hax.random.normal(keys[0], (Batch, Pos, Embed))
    head = hax.random.normal(keys[1], (Embed, Vocab)) * 0.3
    targets = hax.random.randint(keys[2], (Batch, Pos), 0, Vocab.size)

    def plain(h: jax.Array, w: jax.Array) -> jax.Array:
        logits = h @ w
        target_logits = jnp.take_along_axis(logits, targets.array[..., None], axis=-1)[..., 0]
        return jnp.mean(jax.nn.logsumexp(logits, axis=-1) - target_logits)

    ref, ref_grads = jax.value_and_grad(plain, argnums=(0, 1))(hidden.array, head.array)
    mesh = partitioning.make_mesh({"data": 8})

    def compiled(groups: int | None) -> tuple[Any, str]:
        def loss(h: NamedArray, w: NamedArray) -> jax.Array:
            return fused_cross_entropy_loss(h, w, targets, chunk_size=8, groups=groups).scalar()

        mapping = {"batch": "data"}  # the compute mapping
        with jax.set_mesh(mesh), partitioning.axis_mapping(mapping):
            h, w = hax.shard(hidden, mapping, mesh), hax.shard(head, head_mapping, mesh)
            fn = jax.jit(jax.value_and_grad(loss, argnums=(0, 1)))
            return fn(h, w), fn.lower(h, w).compile().as_text()

    (loss, grads), hlo = compiled(None)  # groups from the mapping: one per device
    _assert_close(loss, ref)
    for g, r in zip(grads, ref_grads, strict=True):
        _assert_close(g.array, r)
    inside, every = _loop_collectives(hlo)
    assert inside == [], inside
    assert every, "expected the reduction after the loop"
    # one group: the partial head gradients of the 8 devices are reduced inside the loop (the check can fail)
    (loss_one, _), hlo_one = compiled(1)
    _assert_close(loss_one, ref)
    assert _loop_collectives(hlo_one)[0], "expected a collective inside the chunk loop with one group"


def _dot_count(jaxpr: Any) -> int:
    """The dot_general equations of a jaxpr, inner jaxprs (loop bodies, custom-VJP rules) included."""
    count = 0
    for eqn in jaxpr.eqns:
        count += eqn.primitive.name == "dot_general"
        for sub in jax.extend.core.jaxprs_in_params(eqn.params):
            count += _dot_count(sub)
    return count


def test_fused_loss_three_matrix_products_and_chunk_sized_logits() -> None:
    hidden, head, targets, mask = _inputs()

    def fused(h: NamedArray, w: NamedArray) -> jax.Array:
        return fused_cross_entropy_loss(h, w, targets, weights=mask, chunk_size=2).scalar()

    grad_jaxpr = jax.make_jaxpr(jax.grad(fused, argnums=(0, 1)))(hidden, head)
    assert _dot_count(grad_jaxpr.jaxpr) == 3  # logits, d/dhidden, d/dhead: no recomputation
    assert _dot_count(jax.make_jaxpr(fused)(hidden, head).jaxpr) == 1  # the loss alone computes no gradient
    # logits-sized arrays (a vocabulary dimension, not the head's) hold at most one chunk: 3 x 2 tokens
    assert (
        _max_tokens_with_vocab(
            jax.make_jaxpr(
                jax.grad(lambda h, w: _plain(h, w, targets.array, mask.array, 0.0, "mean"), argnums=(0, 1))
            )(hidden.array, head.array)
        )
        == B.size * P.size
    )  # the check can fail
    assert _max_tokens_with_vocab(grad_jaxpr) == B.size * 2


def _max_tokens_with_vocab(jaxpr: Any) -> int:
    """The most tokens (elements / vocabulary) of an array of a jaxpr with a vocabulary dimension, the head's aside."""
    shapes = [tuple(int(d) for d in s.split(",")) for s in re.findall(r"\[(\d+(?:,\d+)*)\]", str(jaxpr))]
    return max(int(np.prod(s)) // V.size for s in shapes if V.size in s and sorted(s) != sorted((E.size, V.size)))


@pytest.mark.parametrize("groups", [1, 3])
def test_fused_loss_keeps_bfloat16(groups: int) -> None:
    """bfloat16 inputs: bfloat16 gradients; the loss equals the plain loss over bfloat16 logits (a bf16 model's)."""
    hidden, head, targets, mask = _inputs(2)
    h16, w16 = hidden.astype(jnp.bfloat16), head.astype(jnp.bfloat16)

    def fused(h: NamedArray, w: NamedArray) -> jax.Array:
        return fused_cross_entropy_loss(h, w, targets, weights=mask, chunk_size=3, groups=groups).scalar()

    def plain_bf16_logits(h: jax.Array, w: jax.Array) -> jax.Array:
        logits = jnp.einsum("bpe,ve->bpv", h, w, preferred_element_type=jnp.float32).astype(jnp.bfloat16)
        lse = jax.nn.logsumexp(logits.astype(jnp.float32), axis=-1)
        per = lse - jnp.sum(logits.astype(jnp.float32) * jax.nn.one_hot(targets.array, V.size), axis=-1)
        return jnp.sum(per * mask.array) / jnp.sum(mask.array)

    loss, (dh, dw) = jax.value_and_grad(fused, argnums=(0, 1))(h16, w16)
    assert (loss.dtype, dh.dtype, dw.dtype) == (jnp.float32, jnp.bfloat16, jnp.bfloat16)
    np.testing.assert_allclose(float(loss), float(plain_bf16_logits(h16.array, w16.array)), rtol=1e-5)
    # gradients vs float32 ones: bfloat16 rounding of the logits, the gradients and the sum over 3 chunks
    h32, w32 = (np.asarray(x.array, np.float32) for x in (h16, w16))
    _, (rh, rw) = jax.value_and_grad(_plain, argnums=(0, 1))(h32, w32, targets.array, mask.array, 0.0, "mean")
    np.testing.assert_allclose(np.asarray(dh.array, np.float32), rh, atol=2e-2 * float(np.abs(rh).max()))
    np.testing.assert_allclose(np.asarray(dw.array, np.float32), rw, atol=2e-2 * float(np.abs(rw).max()))


def test_fused_loss_checks_arguments() -> None:
    hidden, head, targets, _ = _inputs()
    with pytest.raises(ValueError, match="reduction"):
        fused_cross_entropy_loss(hidden, head, targets, reduction="none")
    with pytest.raises(ValueError, match="chunk_size"):
        fused_cross_entropy_loss(hidden, head, targets, chunk_size=0)
    with pytest.raises(ValueError, match="Pos 'seq'"):
        fused_cross_entropy_loss(hidden, head, targets, Pos="seq")
    with pytest.raises(ValueError, match="weights"):
        fused_cross_entropy_loss(hidden, head, targets, weights=hax.ones((B, hax.Axis("other", 2))))
    with pytest.raises(ValueError, match="targets"):
        fused_cross_entropy_loss(hidden, head, hax.zeros((B,), dtype=jnp.int32))


def test_default_chunk_size() -> None:
    # 2**27 // 128256 = 1046 tokens, a power of two below
    assert fused_kernel._fused_chunk_size(128256, 1, 2048) == 1024
    assert fused_kernel._fused_chunk_size(128256, 4, 2048) == 256  # the same tokens spread over a batch of 4
    assert fused_kernel._fused_chunk_size(128256, 4, 100) == 100  # never above the positions
    assert fused_kernel._fused_chunk_size(2**30, 8, 2048) == 1  # at least one position


@pytest.mark.parametrize("reduction", ["mean", "sum"])
def test_auto_loss_is_fused_above_the_threshold(monkeypatch: pytest.MonkeyPatch, reduction: str) -> None:
    vocab = hax.Axis("vocab", 29)
    config = LlamaConfig(seq_len=8, hidden_dim=16, intermediate_dim=32, num_layers=2, num_heads=2, num_kv_heads=1)
    model = config.build(vocab, key=jax.random.key(0))
    tokens = np.random.RandomState(0).randint(0, vocab.size, size=(2, 7))
    ex = LmExample.causal(hax.named(tokens, ("batch", "position")), eos_id=3)
    monkeypatch.setattr(next_token, "FUSED_LOSS_MIN_VOCAB", 16)
    monkeypatch.setattr(fused_kernel, "FUSED_LOSS_CHUNK_ELEMENTS", 3 * 2 * vocab.size)  # 3 positions per chunk of 7
    calls: list[str] = []
    real = next_token.fused_cross_entropy_loss

    def spy(*args: Any, **kwargs: Any) -> NamedArray:
        calls.append(kwargs["reduction"])
        return real(*args, **kwargs)

    monkeypatch.setattr(next_token, "fused_cross_entropy_loss", spy)

    def loss(m: Any, block_size: str | None) -> jax.Array:
        return compute_next_token_loss(
            m, ex, logsumexp_weight=1e-2, reduction=reduction, block_size=block_size
        ).scalar()

    fused, g_fused = eqx.filter_value_and_grad(loss)(model, "auto")
    assert calls == [reduction]
    plain, g_plain = eqx.filter_value_and_grad(loss)(model, None)
    assert calls == [reduction]  # block_size=None: the plain loss
    _assert_close(fused, plain)
    leaves_fused, leaves_plain = jax.tree_util.tree_leaves(g_fused), jax.tree_util.tree_leaves(g_plain)
    assert len(leaves_fused) == len(leaves_plain) > 0
    for a, b in zip(leaves_fused, leaves_plain, strict=True):
        _assert_close(a, b)
    # per-position losses keep the vocabulary-blocked loss
    per = compute_next_token_loss(model, ex, reduction="none")
    assert calls == [reduction]
    assert per.axis_names == ("batch", "position")


def test_temperature_is_the_cross_entropy_of_the_tempered_logits(monkeypatch: pytest.MonkeyPatch) -> None:
    """``temperature`` vs NumPy on the model's own logits divided by it, materialized and blockwise (where the hidden
    states are divided instead); a temperature that is not positive is refused naming it."""
    vocab = hax.Axis("vocab", 29)
    config = LlamaConfig(seq_len=8, hidden_dim=16, intermediate_dim=32, num_layers=2, num_heads=2, num_kv_heads=1)
    model = config.build(vocab, key=jax.random.key(1))
    tokens = np.random.RandomState(1).randint(0, vocab.size, size=(2, 7))
    ex = LmExample.causal(hax.named(tokens, ("batch", "position")))
    logits = np.asarray(model(ex.tokens).rearrange(("batch", "position", "vocab")).array, np.float64) / 0.7
    lse = np.log(np.exp(logits - logits.max(-1, keepdims=True)).sum(-1)) + logits.max(-1)
    want = lse[:, :-1] - np.take_along_axis(logits[:, :-1], tokens[:, 1:, None], -1)[..., 0]
    plain = compute_next_token_loss(model, ex, reduction="none", block_size=None, temperature=0.7)
    np.testing.assert_allclose(np.asarray(plain.array)[:, :-1], want, rtol=1e-5)
    assert float(np.abs(np.asarray(plain.array)[:, -1]).max()) == 0.0  # no target after the last position
    monkeypatch.setattr(next_token, "FUSED_LOSS_MIN_VOCAB", 16)  # the blockwise loss, as for large vocabularies
    blockwise = compute_next_token_loss(model, ex, reduction="none", temperature=0.7)
    np.testing.assert_allclose(np.asarray(blockwise.array)[:, :-1], want, rtol=1e-5)
    with pytest.raises(ValueError, match=r"temperature must be > 0, got 0\.0"):
        compute_next_token_loss(model, ex, temperature=0.0)
