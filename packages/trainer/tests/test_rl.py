"""Reinforcement learning (``ponente-rl``): GRPO, Dr. GRPO and RLOO against NumPy references, rewards, runs.

The losses are checked against NumPy transcriptions of their published definitions (TRL's ``GRPOTrainer`` with
``loss_type="grpo"`` / ``"dr_grpo"`` and its ``RLOOTrainer``), written here loop by loop, on a fixed batch; the
runs go through ``train_rl.main(argv)`` on a tiny random Hugging Face Llama.
"""

from __future__ import annotations

import importlib.resources
import json
import math
from pathlib import Path

import numpy as np
import pytest
from finetune_support import write_tiny_llama

from ponente.trainer.main import train_rl
from ponente.trainer.rewards import exact_match, load_reward, math_answer, regex_match
from ponente.trainer.run import load_hf_weights
from ponente.trainer.tasks.rl import group_advantages, policy_loss, rollout_seed

EPS = 0.2


# -- NumPy references --------------------------------------------------------------------------------------------
def _np_advantages(rewards: list[float], group: int, loss: str) -> list[float]:
    out = []
    for start in range(0, len(rewards), group):
        g = rewards[start : start + group]
        mean = sum(g) / group
        std = math.sqrt(sum((x - mean) ** 2 for x in g) / (group - 1))
        for i, x in enumerate(g):
            if loss == "grpo":
                out.append((x - mean) / (std + 1e-4))
            elif loss == "dr_grpo":
                out.append(x - mean)
            else:
                others = [y for j, y in enumerate(g) if j != i]
                out.append(x - sum(others) / len(others))
    return out


def _np_loss(logp, old, ref, adv, mask, loss, kl_coef, max_len):
    n, t = logp.shape
    k3 = np.zeros_like(logp)
    if ref is not None:
        k3 = np.exp(ref - logp) - (ref - logp) - 1.0
    if loss in ("grpo", "dr_grpo"):
        total, seq_means, clipped = 0.0, [], 0
        for i in range(n):
            acc, count = 0.0, 0
            for j in range(t):
                if not mask[i, j]:
                    continue
                r = math.exp(logp[i, j] - old[i, j])
                term = -min(r * adv[i], min(max(r, 1 - EPS), 1 + EPS) * adv[i]) + kl_coef * k3[i, j]
                acc += term
                count += 1
                clipped += (r < 1 - EPS and adv[i] < 0) or (r > 1 + EPS and adv[i] > 0)
            seq_means.append(acc / max(count, 1))
            total += acc
        value = float(np.mean(seq_means)) if loss == "grpo" else total / (n * max_len)
        clip_fraction = clipped / mask.sum()
    else:
        per, clipped = [], 0
        for i in range(n):
            r = math.exp(sum(logp[i, j] - old[i, j] for j in range(t) if mask[i, j]))
            per.append(-min(r * adv[i], min(max(r, 1 - EPS), 1 + EPS) * adv[i]))
            per[-1] += kl_coef * sum(k3[i, j] for j in range(t) if mask[i, j]) / max(mask[i].sum(), 1)
            clipped += (r < 1 - EPS and adv[i] < 0) or (r > 1 + EPS and adv[i] > 0)
        value, clip_fraction = float(np.mean(per)), clipped / n
    kl = float((k3 * mask).sum() / mask.sum()) if ref is not None else 0.0
    return value, kl, clip_fraction


def _fixed_batch() -> tuple[np.ndarray, ...]:
    rng = np.random.default_rng(0)
    n, t = 8, 12
    mask = np.zeros((n, t), np.float32)
    for i in range(n):  # prompts of 2-4 tokens, completions of 1-7 tokens, right padding
        start = 1 + i % 3
        mask[i, start : start + 1 + (3 * i) % 7] = 1.0
    old = (-rng.uniform(0.1, 3.0, (n, t))).astype(np.float32) * mask
    logp = (old + rng.normal(0, 0.25, (n, t)).astype(np.float32)) * mask  # some ratios outside the clip
    ref = (old + rng.normal(0, 0.3, (n, t)).astype(np.float32)) * mask
    rewards = rng.integers(0, 2, n).astype(np.float64)
    return logp, old, ref, rewards, mask


@pytest.mark.parametrize("loss", ["grpo", "dr_grpo", "rloo"])
@pytest.mark.parametrize("kl_coef", [0.0, 0.05])
def test_loss_equals_the_numpy_reference_on_a_fixed_batch(loss: str, kl_coef: float) -> None:
    logp, old, ref, rewards, mask = _fixed_batch()
    adv = group_advantages(rewards, 4, loss)
    np.testing.assert_allclose(adv, _np_advantages(list(rewards), 4, loss), rtol=1e-12, atol=1e-12)
    with_ref = ref if kl_coef else None
    value, metrics = policy_loss(
        logp, old, adv, mask, loss=loss, clip_epsilon=EPS, ref_logp=with_ref, kl_coef=kl_coef, max_completion_length=10
    )
    expected, kl, clip_fraction = _np_loss(
        logp.astype(np.float64),
        old.astype(np.float64),
        None if with_ref is None else ref.astype(np.float64),
        adv,
        mask,
        loss,
        kl_coef,
        10,
    )
    assert float(value) == pytest.approx(expected, abs=2e-6, rel=1e-5)
    assert float(metrics["train/rl/kl"]) == pytest.approx(kl, abs=1e-6)
    assert float(metrics["train/rl/clip_fraction"]) == pytest.approx(clip_fraction, abs=1e-6)
    if loss != "rloo":
        assert 0.0 < clip_fraction < 1.0  # the batch exercises the clip


def test_loss_gradient_is_the_advantage_weighted_score_on_policy() -> None:
    """On policy (ratio 1, no KL) the GRPO gradient per token is ``-A / (n tokens * completions)``."""
    import jax

    _, old, _, rewards, mask = _fixed_batch()
    adv = group_advantages(rewards, 4, "grpo")
    grad = jax.grad(lambda lp: policy_loss(lp, old, adv, mask, loss="grpo", clip_epsilon=EPS)[0])(old)
    expected = -adv[:, None] * mask / mask.sum(axis=1, keepdims=True) / mask.shape[0]
    np.testing.assert_allclose(np.asarray(grad), expected, atol=1e-6)


def test_rollout_seeds_depend_on_step_prompt_and_sample() -> None:
    seeds = {rollout_seed(0, s, p, k) for s in range(3) for p in range(3) for k in range(3)}
    assert len(seeds) == 27
    assert rollout_seed(1, 0, 0, 0) != rollout_seed(0, 0, 0, 0)


# -- rewards -----------------------------------------------------------------------------------------------------
def test_packaged_rewards() -> None:
    assert exact_match("1+1=", " 2\n", {"answer": 2}) == 1.0
    assert exact_match("1+1=", "3", {"answer": "2"}) == 0.0
    assert regex_match("", "The answer: 42", {"pattern": r".*\b42"}) == 1.0
    assert regex_match("", "41", {"answer": "42"}) == 0.0
    assert math_answer("", "first 3, then 7", {"answer": "7"}) == 1.0
    assert math_answer("", r"it is \boxed{1/2} so 9", {"answer": "0.5"}) == 1.0
    assert math_answer("", "no number", {"answer": "7"}) == 0.0
    assert load_reward("math_answer") is math_answer
    assert load_reward("ponente.trainer.rewards:exact_match") is exact_match


@pytest.mark.parametrize(
    ("spec", "words"),
    [
        ("no_such_module_xyz:score", "cannot import 'no_such_module_xyz'"),
        ("ponente.trainer.rewards:nothing", "has no 'nothing'"),
        ("not a path", "expected 'module:name'"),
    ],
)
def test_a_reward_that_does_not_load_is_one_line_naming_the_key_before_any_model_loads(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], spec: str, words: str
) -> None:
    # the model folder does not exist: the reward is checked first
    argv = [f"--initialize_from_hf={tmp_path / 'no-model'}", f"--reward.function={spec}"]
    assert train_rl.main(argv) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1, err
    assert err[0].startswith("error: reward.function:"), err
    assert words in err[0]


def test_the_packaged_config_parses() -> None:
    from ponente.trainer.config import load_config

    config = load_config(train_rl.TrainRlConfig, "rl_arithmetic")
    assert config.rl.group_size == 8
    assert config.reward.function == "exact_match"
    assert config.trainer.train_batch_size % config.rl.group_size == 0
    assert config.data.train_urls == ["package://ponente.trainer.assets/tiny_arithmetic.jsonl"]


# -- runs --------------------------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def tiny_llama(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_tiny_llama(tmp_path_factory.mktemp("tiny_llama"), max_positions=64)


def _prompts(where: Path) -> Path:
    path = where / "prompts.jsonl"
    rows = [{"prompt": f"{a}+{b}=", "answer": str(a + b)} for a, b in [(1, 2), (2, 3), (3, 1), (4, 4)]]
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def _overrides(tmp_path: Path, model: Path, steps: int, *extra: str) -> list[str]:
    return [
        f"--initialize_from_hf={model}",
        f"--data.train_urls=[{_prompts(tmp_path)}]",
        "--reward.function=exact_match",
        "--rl.group_size=4",
        "--rl.max_new_tokens=6",
        "--trainer.mp=f32",
        "--trainer.seed=0",
        "--trainer.train_batch_size=8",
        f"--trainer.num_train_steps={steps}",
        "--trainer.id=rl",
        "--trainer.progress_bar=false",
        "--trainer.compilation_cache_dir=null",
        f"--trainer.run_dir={tmp_path / 'runs' / '{run_id}'}",
        f"--trainer.tracker={{type: json, path: {tmp_path / 'metrics.jsonl'}}}",
        f"--trainer.checkpointer.base_path={tmp_path / 'ckpt'}",
        "--optimizer.learning_rate=1e-3",
        "--optimizer.weight_decay=0.0",
        "--optimizer.warmup=0.0",
        "--optimizer.lr_schedule=constant",
        *extra,
    ]


def _metrics(tmp_path: Path) -> list[dict]:
    return [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]


def _merged(tmp_path: Path) -> dict[int, dict]:
    by_step: dict[int, dict] = {}
    for r in _metrics(tmp_path):
        if "step" in r:
            by_step.setdefault(r["step"], {}).update(r)
    return by_step


@pytest.mark.integration
def test_rl_run_logs_the_metrics_and_exports(tmp_path: Path, tiny_llama: Path) -> None:
    import transformers

    code = train_rl.main(_overrides(tmp_path, tiny_llama, 2, f"--hf_save_path={tmp_path / 'hf'}", "--rl.kl_coef=0.1"))
    assert code == 0
    steps = _merged(tmp_path)
    for step in (1, 2):
        record = steps[step]
        for name in (
            "reward_mean",
            "reward_std",
            "kl",
            "clip_fraction",
            "completion_length",
            "rollout_seconds",
            "train_seconds",
        ):
            assert f"train/rl/{name}" in record, (step, sorted(record))
        assert 1 <= record["train/rl/completion_length"] <= 6
        assert math.isfinite(record["train/loss"])
    assert steps[1]["train/rl/kl"] == pytest.approx(0.0, abs=1e-6)  # the policy starts as the reference
    assert steps[1]["train/rl/clip_fraction"] == pytest.approx(0.0, abs=1e-6)  # on policy: ratio 1
    transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "hf")


@pytest.mark.integration
def test_rl_off_policy_sync_every_2_with_a_kl_reference(tmp_path: Path, tiny_llama: Path) -> None:
    """``sync_every: 2``: the engine keeps its own weights while the state's buffers are donated; the rollout of step
    2 comes from the weights of step 0 (off-policy: the ratio moves), that of step 3 from the synced ones (ratio 1);
    the KL to the reference is 0 at step 1 only."""
    extra = ("--rl.sync_every=2", "--rl.kl_coef=0.05", "--rl.loss=rloo", "--optimizer.learning_rate=1e-2")
    assert train_rl.main(_overrides(tmp_path, tiny_llama, 3, *extra)) == 0
    steps = _merged(tmp_path)
    assert steps[1]["train/rl/kl"] == pytest.approx(0.0, abs=1e-6)
    assert steps[2]["train/rl/kl"] > 0.0
    assert steps[3]["train/rl/clip_fraction"] == 0.0  # on policy again after the sync


LENGTH_REWARD = """
def text_length(prompt, completion, example):
    return len(completion) / 10.0


def digit_fraction(prompt, completion, example):
    return sum(ch.isdigit() for ch in completion) / max(len(completion), 1)
"""


@pytest.mark.integration
def test_rl_raises_the_mean_reward_of_a_learnable_reward(
    tmp_path: Path, tiny_llama: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """GRPO on the random tiny Llama with the reward "fraction of the completion's characters that are digits": the
    mean reward of the last 5 of 30 steps is well above that of the first 5 (measured: 0.035 -> 0.78)."""
    (tmp_path / "length_reward_for_rl_test.py").write_text(LENGTH_REWARD)
    monkeypatch.syspath_prepend(str(tmp_path))
    extra = (
        "--reward.function=length_reward_for_rl_test:digit_fraction",
        "--trainer.train_batch_size=32",
        "--optimizer.learning_rate=1e-3",
    )
    assert train_rl.main(_overrides(tmp_path, tiny_llama, 30, *extra)) == 0
    rewards = [r["train/rl/reward_mean"] for _, r in sorted(_merged(tmp_path).items()) if "train/rl/reward_mean" in r]
    assert len(rewards) == 30
    first, last = float(np.mean(rewards[:5])), float(np.mean(rewards[-5:]))
    assert last > first + 0.2, rewards


@pytest.mark.integration
def test_rl_stopped_and_resumed_matches_an_uninterrupted_run_bitwise(
    tmp_path: Path, tiny_llama: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Rollouts are keyed by step: a run stopped after 2 of 3 steps and resumed logs the same rewards and losses and
    exports the same weights as an uninterrupted run (a reward of the text's length, from a module on the path, so
    the advantages are not zero and the weights move)."""
    (tmp_path / "length_reward_for_rl_test.py").write_text(LENGTH_REWARD)
    monkeypatch.syspath_prepend(str(tmp_path))
    whole, parts = tmp_path / "whole", tmp_path / "parts"
    for where, steps in ((whole, 3), (parts, 2), (parts, 3)):
        where.mkdir(exist_ok=True)
        extra = (f"--hf_save_path={where / 'hf'}", "--reward.function=length_reward_for_rl_test:text_length")
        assert train_rl.main(_overrides(where, tiny_llama, steps, *extra)) == 0
    keys = ("train/loss", "train/rl/reward_mean", "train/rl/completion_length")
    a = {s: tuple(r[k] for k in keys) for s, r in _merged(whole).items() if "train/loss" in r}
    b = {s: tuple(r[k] for k in keys) for s, r in _merged(parts).items() if "train/loss" in r}
    assert a == b
    assert sorted(b) == [1, 2, 3]
    assert (whole / "hf" / "model.safetensors").read_bytes() == (parts / "hf" / "model.safetensors").read_bytes()
    assert any(loss != 0.0 for loss, *_ in a.values()), a
    assert len({reward for _, reward, _ in a.values()}) > 1, a  # the rollouts differ from step to step


def test_chat_prompts_are_rendered_as_transformers_renders_them(tiny_llama: Path) -> None:
    """A prompt that is a list of messages is rendered by the chat template with the generation prompt, as
    ``transformers``' ``apply_chat_template(..., add_generation_prompt=True, tokenize=False)`` renders it."""
    import types

    import transformers

    from ponente.trainer.tasks.rl import RlTask

    template = importlib.resources.files("ponente.trainer.assets").joinpath("tiny_chat_template.jinja").read_text()
    task = RlTask.__new__(RlTask)
    task.initialize_from_hf = str(tiny_llama)
    data = types.SimpleNamespace(tokenizer=None, chat_template=template)
    task.config = types.SimpleNamespace(data=data)  # type: ignore[assignment]
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "What is 2+3?"}]
    tokenizer = transformers.PreTrainedTokenizerFast(tokenizer_file=str(tiny_llama / "tokenizer.json"))
    tokenizer.chat_template = template
    expected = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    assert task._render(messages) == expected
    assert task._render("2+3=") == "2+3="


def _hf_logprobs(folder: Path, tokens: np.ndarray, temperature: float) -> np.ndarray:
    """TRL's per-token log-probs (``_get_per_token_logps``: ``logits / temperature``, then the log-softmax at the next
    token) from transformers' forward, in float64; ``[batch, position]`` aligned on the predicting position."""
    import torch
    import transformers

    model = transformers.AutoModelForCausalLM.from_pretrained(folder, torch_dtype=torch.float32).eval()
    with torch.no_grad():
        logits = model(torch.tensor(tokens, dtype=torch.long)).logits.double().numpy()
    z = logits / temperature
    z = z - z.max(axis=-1, keepdims=True)
    log_softmax = z - np.log(np.exp(z).sum(axis=-1, keepdims=True))
    out = np.zeros(tokens.shape, np.float64)
    out[:, :-1] = np.take_along_axis(log_softmax[:, :-1], tokens[:, 1:, None], axis=-1)[..., 0]
    return out


@pytest.fixture(scope="module")
def other_llama(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_tiny_llama(tmp_path_factory.mktemp("other_llama"), seed=1, max_positions=64)


@pytest.mark.parametrize("temperature", [0.7, 1.0])
@pytest.mark.parametrize("blockwise", [False, True])
def test_the_loss_weighs_the_log_probs_of_the_tempered_policy_and_reference(
    tmp_path: Path,
    tiny_llama: Path,
    other_llama: Path,
    monkeypatch: pytest.MonkeyPatch,
    temperature: float,
    blockwise: bool,
) -> None:
    """``RlTask.loss`` at ``rl.temperature`` T is TRL's GRPO loss on the log-probs of ``logits / T`` of the policy and
    of the KL reference (transformers' logits, a NumPy transcription of the loss); ``blockwise``: the path of a large
    vocabulary, where the hidden states are divided (forced here on the tiny vocabulary)."""
    import jax
    import jmp

    import ponente.models.loss
    from ponente.trainer.tasks.dpo import PolicyAndReference

    if blockwise:
        monkeypatch.setattr(ponente.models.loss, "cross_entropy_block_size", lambda model, block_size="auto": 128)
    extra = (f"--rl.temperature={temperature}", "--rl.kl_coef=0.05", "--rl.max_new_tokens=8")
    task = _task(tiny_llama, f"--data.train_urls=[{_prompts(tmp_path)}]", *extra)
    mp = jmp.get_policy("f32")
    policy = task.pretrained_model(mp).policy
    reference = load_hf_weights(str(other_llama), task.model_config, mp)
    rng = np.random.default_rng(0)
    n, t = 8, 16
    tokens = rng.integers(4, task.Vocab.size, (n, t)).astype(np.int32)
    mask = np.zeros((n, t), np.float32)
    for i in range(n):
        mask[i, 2 + i % 3 : 2 + i % 3 + 2 + i % 6] = 1.0
    expected_logp = _hf_logprobs(tiny_llama, tokens, temperature) * mask
    ref_logp = _hf_logprobs(other_llama, tokens, temperature) * mask
    old = (expected_logp + rng.normal(0, 0.2, (n, t))) * mask  # some ratios outside the clip
    adv = group_advantages(rng.integers(0, 2, n).astype(np.float64), 4, "grpo")
    batch = task._named(tokens, mask, old.astype(np.float32), adv.astype(np.float32))
    value, metrics = jax.jit(lambda m, b: task.loss(m, b, key=None))(PolicyAndReference(policy, reference), batch)
    expected, kl, clip_fraction = _np_loss(expected_logp, old, ref_logp, adv, mask, "grpo", 0.05, 8)
    assert float(value) == pytest.approx(expected, abs=1e-5, rel=1e-4)
    assert float(metrics["train/rl/kl"]) == pytest.approx(kl, abs=1e-5, rel=1e-4)
    assert float(metrics["train/rl/clip_fraction"]) == pytest.approx(clip_fraction, abs=1e-6)
    assert 0.0 < clip_fraction < 1.0


def test_rollout_old_logprobs_are_the_tempered_policys(tmp_path: Path, tiny_llama: Path) -> None:
    """The rollouts' ``old_logprobs`` at ``rl.temperature`` 0.7 are transformers' ``log_softmax(logits / 0.7)`` at the
    sampled tokens, so on policy the ratio of the loss is 1."""
    import jmp

    from ponente.trainer.inference import Engine

    task = _task(tiny_llama, f"--data.train_urls=[{_prompts(tmp_path)}]", "--rl.temperature=0.7")
    task.engine = Engine(task.pretrained_model(jmp.get_policy("f32")), task.tokenizer, max_batch_size=8)
    batch = task.make_batch({"row_index": np.arange(8), "prompt_index": np.repeat([0, 2], 4)})
    tokens = np.asarray(batch["input_ids"].array)
    mask = np.asarray(batch["completion_mask"].array)
    old = np.asarray(batch["old_logprobs"].array)
    assert mask.sum() > 8
    np.testing.assert_allclose(old, _hf_logprobs(tiny_llama, tokens, 0.7) * mask, atol=1e-4)


# -- prompts from a Hugging Face dataset -------------------------------------------------------------------------
ARITHMETIC = [(1, 2), (2, 3), (3, 1), (4, 4)]


def _hf_dataset(where: Path) -> Path:
    """The rows of ``_prompts`` as a Hugging Face ``DatasetDict`` saved to disk, with its own column names."""
    import datasets

    columns = {
        "question": [f"{a}+{b}=" for a, b in ARITHMETIC],
        "solution": [str(a + b) for a, b in ARITHMETIC],
        "level": [a for a, _ in ARITHMETIC],
    }
    path = where / "hf_prompts"
    datasets.DatasetDict({"train": datasets.Dataset.from_dict(columns)}).save_to_disk(str(path))
    return path


def _task(tiny_llama: Path, *overrides: str):
    from ponente.trainer.config import parse_config
    from ponente.trainer.tasks.rl import RlTask

    argv = [f"--initialize_from_hf={tiny_llama}", "--rl.group_size=4", "--trainer.train_batch_size=8", *overrides]
    return RlTask(parse_config(train_rl.TrainRlConfig, argv, exit_on_error=False), exact_match)


def test_prompts_from_a_hugging_face_dataset_equal_those_of_the_same_jsonl_rows(
    tmp_path: Path, tiny_llama: Path
) -> None:
    """``data.id`` (a ``save_to_disk`` folder) with ``prompt_field``/``answer_field`` mapping its columns reads the
    same prompts, token ids and answers as the jsonl rows of ``_prompts``; the other columns reach the reward."""
    mapping = ("--data.prompt_field=question", "--data.answer_field=solution")
    hf = _task(tiny_llama, f"--data.id={_hf_dataset(tmp_path)}", *mapping)
    jsonl = _task(tiny_llama, f"--data.train_urls=[{_prompts(tmp_path)}]")
    assert hf.prompt_texts == jsonl.prompt_texts == [f"{a}+{b}=" for a, b in ARITHMETIC]
    assert hf.prompt_ids == jsonl.prompt_ids
    assert [r["answer"] for r in hf.examples] == [r["answer"] for r in jsonl.examples]
    assert [r["level"] for r in hf.examples] == [a for a, _ in ARITHMETIC]
    assert hf.reward(hf.prompt_texts[0], " 3", hf.examples[0]) == 1.0


@pytest.mark.parametrize(
    ("overrides", "key", "words"),
    [
        (("--data.train_split=test",), "data.train_split", "splits ['train']"),
        (("--data.prompt_field=prompt",), "data.prompt_field", "no column 'prompt'"),
        (("--data.prompt_field=question", "--data.answer_field=answer_text"), "data.answer_field", "'answer_text'"),
    ],
)
def test_a_bad_hugging_face_data_config_is_one_line_naming_the_key(
    tmp_path: Path, tiny_llama: Path, overrides: tuple[str, ...], key: str, words: str
) -> None:
    from ponente.trainer.config import ConfigError

    with pytest.raises(ConfigError) as info:
        _task(tiny_llama, f"--data.id={_hf_dataset(tmp_path)}", *overrides)
    message = str(info.value)
    assert message.startswith(f"{key}:"), message
    assert words in message, message
    assert "\n" not in message


def test_jsonl_and_a_hugging_face_dataset_together_are_refused(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    argv = ["--initialize_from_hf=/nowhere", f"--data.train_urls=[{_prompts(tmp_path)}]", f"--data.id={tmp_path}"]
    assert train_rl.main(argv) == 2
    assert "data: train_urls and id are both set" in capsys.readouterr().err
