"""Preference losses: sequence log-probs vs transformers (Llama, Qwen3, Gemma 2), and each loss type's value and
gradient vs a NumPy transcription of TRL's definitions (``DPOTrainer``, ``CPOTrainer``)."""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch
import transformers
from parity_support import port

import ponente.namedtensor as hax
from ponente.models.loss import preference_loss, sequence_logprobs

SMALL = {
    "vocab_size": 61,
    "max_position_embeddings": 32,
    "hidden_size": 32,
    "intermediate_size": 48,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 8,
    "attn_implementation": "eager",
}

FAMILIES = {
    "llama": lambda: transformers.LlamaForCausalLM(transformers.LlamaConfig(**SMALL)),
    "qwen3": lambda: transformers.Qwen3ForCausalLM(transformers.Qwen3Config(**SMALL)),
    "gemma2": lambda: transformers.Gemma2ForCausalLM(
        transformers.Gemma2Config(**SMALL, sliding_window=6, final_logit_softcapping=5.0, query_pre_attn_scalar=8)
    ),
}


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_sequence_logprobs_match_transformers(family: str) -> None:
    torch.manual_seed(0)
    hf = FAMILIES[family]().eval()
    model = port(hf)
    rng = np.random.RandomState(1)
    ids = rng.randint(0, 61, size=(3, 20))
    # prompt of different lengths, a response, then right padding (0 in the mask)
    mask = np.zeros_like(ids)
    for row, (start, stop) in enumerate([(4, 12), (9, 20), (2, 3)]):
        mask[row, start:stop] = 1
    with torch.no_grad():
        logp = torch.log_softmax(hf(torch.tensor(ids)).logits.double(), -1).numpy()
    want = np.array(
        [sum(logp[r, j - 1, ids[r, j]] for j in range(1, ids.shape[1]) if mask[r, j]) for r in range(ids.shape[0])]
    )
    got = sequence_logprobs(
        model, hax.named(jnp.asarray(ids), ("batch", "position")), hax.named(mask, ("batch", "position"))
    )
    np.testing.assert_allclose(np.asarray(got.array), want, atol=1e-4, rtol=0)


def _log_sigmoid(x: np.ndarray) -> np.ndarray:
    return -np.logaddexp(0.0, -x)


def _trl_losses(pc, pr, rc, rr, nc, nr, *, loss_type, beta, eps, gamma) -> np.ndarray:
    """TRL's per-pair losses, transcribed in float64 NumPy."""
    if loss_type == "simpo":  # CPOTrainer: average log-probs, no reference
        logits = pc / nc - pr / nr - gamma / beta
        return -_log_sigmoid(beta * logits) * (1 - eps) - _log_sigmoid(-beta * logits) * eps
    delta = (pc - rc) - (pr - rr)
    if loss_type == "sigmoid":  # conservative DPO (label smoothing)
        return -_log_sigmoid(beta * delta) * (1 - eps) - _log_sigmoid(-beta * delta) * eps
    if loss_type == "hinge":
        return np.maximum(0.0, 1 - beta * delta)
    ipo = (pc - rc) / nc - (pr - rr) / nr
    return (ipo - 1 / (2 * beta)) ** 2


CASES = [("sigmoid", 0.1, 0.0), ("sigmoid", 0.3, 0.2), ("ipo", 0.1, 0.0), ("hinge", 0.5, 0.0), ("simpo", 2.0, 0.1)]


@pytest.mark.parametrize(("loss_type", "beta", "eps"), CASES)
def test_loss_and_gradient_match_trl(loss_type: str, beta: float, eps: float) -> None:
    rng = np.random.RandomState(3)
    n = 6
    pc, pr, rc, rr = (rng.uniform(-30, -5, size=n) for _ in range(4))
    nc, nr = rng.randint(1, 9, size=n).astype(float), rng.randint(1, 9, size=n).astype(float)
    weights = np.array([1, 1, 1, 1, 0, 1], dtype=float)  # a padding pair counts for nothing
    gamma = 0.7

    def ours(pc: Any, pr: Any) -> Any:
        loss, _ = preference_loss(
            pc,
            pr,
            jnp.asarray(rc, jnp.float32),
            jnp.asarray(rr, jnp.float32),
            chosen_tokens=jnp.asarray(nc),
            rejected_tokens=jnp.asarray(nr),
            loss_type=loss_type,
            beta=beta,
            label_smoothing=eps,
            simpo_gamma=gamma,
            weights=jnp.asarray(weights),
        )
        return loss

    def reference(pc: np.ndarray, pr: np.ndarray) -> float:
        per = _trl_losses(pc, pr, rc, rr, nc, nr, loss_type=loss_type, beta=beta, eps=eps, gamma=gamma)
        return float(np.sum(weights * per) / np.sum(weights))

    f32 = (jnp.asarray(pc, jnp.float32), jnp.asarray(pr, jnp.float32))
    # the float64 reference is evaluated at the float32 inputs, so only the arithmetic differs
    pc32, pr32 = (np.asarray(x, np.float64) for x in f32)
    np.testing.assert_allclose(float(ours(*f32)), reference(pc32, pr32), atol=1e-6, rtol=1e-6)
    grads = jax.grad(ours, argnums=(0, 1))(*f32)
    h = 1e-6
    for which, grad in enumerate(grads):
        numeric = np.zeros(n)
        for i in range(n):
            up, down = [pc32.copy(), pr32.copy()], [pc32.copy(), pr32.copy()]
            up[which][i] += h
            down[which][i] -= h
            numeric[i] = (reference(*up) - reference(*down)) / (2 * h)
        np.testing.assert_allclose(np.asarray(grad), numeric, atol=1e-6, rtol=1e-5)


def test_metrics_and_first_step_value() -> None:
    """Policy == reference: the sigmoid loss is ln 2 and every reward 0; the metrics follow their definitions."""
    pc, pr = jnp.array([-4.0, -9.0]), jnp.array([-6.0, -3.0])
    loss, metrics = preference_loss(pc, pr, pc, pr, chosen_tokens=jnp.ones(2), rejected_tokens=jnp.ones(2))
    assert abs(float(loss) - np.log(2.0)) < 1e-7
    assert float(metrics["dpo_margin_policy"]) == pytest.approx(((-4 + 6) + (-9 + 3)) / 2)
    assert float(metrics["dpo_margin_ref"]) == float(metrics["dpo_margin_policy"])
    assert float(metrics["dpo_chosen_reward"]) == 0.0
    assert float(metrics["dpo_accuracy"]) == 0.0
    _, metrics = preference_loss(
        pc,
        pr,
        jnp.array([-5.0, -9.0]),
        jnp.array([-6.0, -4.0]),
        chosen_tokens=jnp.ones(2),
        rejected_tokens=jnp.ones(2),
        beta=0.5,
    )
    # rewards: chosen 0.5*[1, 0], rejected 0.5*[0, 1] -> the first pair is won, the second lost
    assert float(metrics["dpo_accuracy"]) == 0.5
    assert float(metrics["dpo_chosen_reward"]) == pytest.approx(0.25)
    assert float(metrics["dpo_rejected_reward"]) == pytest.approx(0.25)
    with pytest.raises(ValueError, match="loss_type"):
        preference_loss(pc, pr, pc, pr, chosen_tokens=jnp.ones(2), rejected_tokens=jnp.ones(2), loss_type="kto")
