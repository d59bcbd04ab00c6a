"""Preference tuning: ``data.format: preference_chat`` and ``ponente-dpo`` (DPO, IPO, hinge, SimPO; LoRA-DPO).

The pair tokens are checked against ``transformers``' ``apply_chat_template`` cut as TRL's ``DPOTrainer`` cuts
conversational pairs; truncation against a by-hand rule; the runs go through ``train_dpo.main(argv)`` on a tiny
random Hugging Face Llama with the shipped preference set, and their first logged loss against ln 2 (the policy
starts as the reference).
"""

from __future__ import annotations

import importlib.resources
import json
import math
from pathlib import Path

import numpy as np
import pytest
from finetune_support import ASSETS, CHAT_TEMPLATE, write_tiny_llama

from ponente.trainer.main import train_dpo

PAIRS = f"{ASSETS}/tiny_preferences.jsonl"


@pytest.fixture(scope="module")
def tiny_llama(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_tiny_llama(tmp_path_factory.mktemp("tiny_llama"), max_positions=256)


def _records() -> list[dict]:
    text = importlib.resources.files("ponente.trainer.assets").joinpath("tiny_preferences.jsonl").read_text()
    return [json.loads(line) for line in text.splitlines()]


def _template() -> str:
    return importlib.resources.files("ponente.trainer.assets").joinpath("tiny_chat_template.jinja").read_text()


def _hf_pair(tokenizer: object, record: dict) -> tuple[list[int], list[int], list[int]]:
    """TRL's conversational cut, by transformers: the implicit prompt is the shared leading messages."""
    chosen, rejected = record["chosen"], record["rejected"]
    if "prompt" in record:
        prompt = record["prompt"]
    else:
        k = 0
        while chosen[k] == rejected[k]:
            k += 1
        prompt, chosen, rejected = chosen[:k], chosen[k:], rejected[k:]

    def ids(messages: list, **kw: object) -> list[int]:
        return list(tokenizer.apply_chat_template(messages, tokenize=True, return_dict=True, **kw)["input_ids"])  # type: ignore[attr-defined]

    p = ids(prompt, add_generation_prompt=True)
    pc, pr = ids(prompt + chosen), ids(prompt + rejected)
    n = min(
        next((i for i, (a, b) in enumerate(zip(p, x, strict=False)) if a != b), min(len(p), len(x))) for x in (pc, pr)
    )
    return p[:n], pc[n:], pr[n:]


def test_pair_tokens_are_those_trl_scores(tiny_llama: Path) -> None:
    """Explicit and implicit prompts, system turns and earlier exchanges: the same prompt and response tokens as
    ``apply_chat_template`` gives, and each response is the assistant's turn (its end-of-turn included)."""
    import transformers

    from ponente.datacache import PreferenceChatProcessor

    template = _template()
    hf = transformers.PreTrainedTokenizerFast(tokenizer_file=str(tiny_llama / "tokenizer.json"))
    hf.chat_template = template
    processor = PreferenceChatProcessor(tiny_llama / "tokenizer.json", chat_template=template)
    records = _records()[:40]
    kinds = {("prompt" in r, r["chosen"][0]["role"] if "prompt" not in r else r["prompt"][0]["role"]) for r in records}
    assert len(kinds) >= 3, kinds  # explicit/implicit, with and without a system turn
    assert any(len(r.get("prompt", r["chosen"])) > 3 for r in records)  # a multi-turn prompt
    for record in records:
        assert processor.check(record) is None
        assert processor.tokenize_pair(record) == _hf_pair(hf, record)
    out = processor(records[:2])
    prompt, chosen, rejected = processor.tokenize_pair(records[0])
    np.testing.assert_array_equal(out["input_ids"][0], prompt + chosen + rejected)
    np.testing.assert_array_equal(out["pair_part"][0], [0] * len(prompt) + [1] * len(chosen) + [2] * len(rejected))
    assert hf.decode(chosen).endswith("<|im_end|>\n")


def test_bad_pairs_name_the_field() -> None:
    from ponente.datacache import PreferenceChatProcessor

    tok = importlib.resources.files("ponente.trainer.assets").joinpath("shakespeare_tokenizer.json")
    processor = PreferenceChatProcessor(str(tok), chat_template=_template())
    user = {"role": "user", "content": "Hi"}
    answer = {"role": "assistant", "content": "Hello"}
    other = {"role": "assistant", "content": "Go away"}
    cases = {
        "missing rejected": ({"chosen": [user, answer]}, "missing_field", "'rejected'"),
        "last not assistant": (
            {"prompt": [user], "chosen": [answer], "rejected": [other, user]},
            "bad_pair",
            "'rejected'",
        ),
        "same": ({"chosen": [user, answer], "rejected": [user, answer]}, "bad_pair", "'chosen'"),
        "not a list": ({"prompt": [user], "chosen": "Hello", "rejected": [other]}, "wrong_type", "'chosen'"),
    }
    for name, (record, kind, field) in cases.items():
        problem = processor.check(record)
        assert problem is not None, name
        assert problem[0] == kind, (name, problem)
        assert field in problem[1], (name, problem)


def test_truncation_keeps_the_end_of_the_prompt_and_the_start_of_the_responses() -> None:
    from ponente.datacache.preference import truncate_pair

    # by hand: the prompt gives way first (down to half the row), then the responses are cut at their end
    assert truncate_pair(10, 5, 3, 32) == (10, 5, 3)
    assert truncate_pair(30, 5, 3, 32) == (27, 5, 3)
    assert truncate_pair(30, 25, 3, 32) == (16, 16, 3)
    assert truncate_pair(4, 60, 3, 32) == (4, 28, 3)
    for p, c, r in np.random.default_rng(0).integers(0, 50, (200, 3)).tolist():
        kp, kc, kr = truncate_pair(p, c, r, 32)
        assert kp + max(kc, kr) <= 32
        assert (kp, kc, kr) == (p, c, r) or p + max(c, r) > 32


def _overrides(tmp_path: Path, model: Path, steps: int, *extra: str) -> list[str]:
    return [
        f"--initialize_from_hf={model}",
        f"--data.train_urls=[{PAIRS}]",
        f"--data.tokenizer={model / 'tokenizer.json'}",
        f"--data.cache_dir={tmp_path / 'cache'}",
        f"--data.format={{type: preference_chat, chat_template: {CHAT_TEMPLATE}}}",
        "--train_seq_len=96",
        "--trainer.mp=f32",
        "--trainer.train_batch_size=8",
        f"--trainer.num_train_steps={steps}",
        f"--trainer.steps_per_eval={steps}",
        "--trainer.max_eval_batches=2",
        "--trainer.id=dpo",
        "--trainer.progress_bar=false",
        f"--trainer.run_dir={tmp_path / 'runs' / '{run_id}'}",
        f"--trainer.tracker={{type: json, path: {tmp_path / 'metrics.jsonl'}}}",
        f"--trainer.checkpointer.base_path={tmp_path / 'ckpt'}",
        "--optimizer.learning_rate=2e-3",
        "--optimizer.weight_decay=0.0",
        "--optimizer.warmup=0.0",
        *extra,
    ]


def _metrics(tmp_path: Path) -> list[dict]:
    return [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]


def test_dpo_starts_at_ln2_logs_the_metrics_and_exports(tmp_path: Path, tiny_llama: Path) -> None:
    """The first step's sigmoid loss is ln 2 (policy == reference), margins agree at step 1; the dpo_* metrics are
    logged for training and the held-out pairs; the policy is exported and loads in transformers."""
    import transformers

    code = train_dpo.main(_overrides(tmp_path, tiny_llama, 3, f"--hf_save_path={tmp_path / 'hf'}"))
    assert code == 0
    records = _metrics(tmp_path)
    steps = [r for r in records if "train/dpo_loss" in r]
    assert len(steps) == 3
    first = steps[0]
    assert first["train/dpo_loss"] == pytest.approx(math.log(2), abs=1e-6)
    assert first["train/dpo_margin_policy"] == pytest.approx(first["train/dpo_margin_ref"], abs=1e-3)
    assert first["train/dpo_chosen_reward"] == pytest.approx(0.0, abs=1e-5)
    for name in ("dpo_accuracy", "dpo_rejected_reward"):
        assert f"train/{name}" in first
    evals = [r for r in records if "eval/validation/dpo_accuracy" in r]
    assert evals, "no eval/validation/dpo_* metrics (validation_split_fraction holds out pairs)"
    assert 0.0 <= evals[-1]["eval/validation/dpo_accuracy"] <= 1.0
    last = steps[-1]  # the policy has moved away from the reference
    assert abs(last["train/dpo_margin_policy"] - last["train/dpo_margin_ref"]) > 1e-3, last
    model = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "hf")
    assert model.config.vocab_size >= 384


@pytest.mark.parametrize(
    ("extra", "message", "code"),
    [
        (["--beta=-1"], "beta", 2),
        (["--loss_type=kto"], "loss_type", 2),
        (["--data.format=chat"], "data.format", 2),
    ],
)
def test_bad_settings_are_one_line_naming_the_key(
    tmp_path: Path, tiny_llama: Path, capsys: pytest.CaptureFixture[str], extra: list[str], message: str, code: int
) -> None:
    assert train_dpo.main(_overrides(tmp_path, tiny_llama, 1, *extra)) == code
    err = capsys.readouterr().err.strip().splitlines()
    assert err[-1].startswith("error:"), err[-3:]
    assert message in err[-1], err[-3:]


def test_a_bad_row_stops_the_run_naming_file_row_and_field(
    tmp_path: Path, tiny_llama: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    rows = _records()[:12]
    del rows[7]["rejected"]
    pairs = tmp_path / "pairs.jsonl"
    pairs.write_text("".join(json.dumps(r) + "\n" for r in rows))
    argv = [*_overrides(tmp_path, tiny_llama, 1), f"--data.train_urls=[{pairs}]"]
    assert train_dpo.main(argv) == 1
    last = capsys.readouterr().err.strip().splitlines()[-1]
    for part in ("pairs.jsonl", "8", "'rejected'"):
        assert part in last, last
    assert not (tmp_path / "metrics.jsonl").exists() or not any("train/dpo_loss" in r for r in _metrics(tmp_path))


@pytest.mark.integration
@pytest.mark.parametrize("variant", ["full", "lora"])
def test_dpo_learns_the_preference_and_lora_dpos_adapter_loads_in_peft(
    variant: str, tmp_path: Path, tiny_llama: Path
) -> None:
    """DPO (full, and LoRA-DPO) on the learnable synthetic preference: held-out pairs end with a positive reward
    margin for most pairs; the PEFT adapter of LoRA-DPO loads on the base model."""
    import peft
    import transformers

    extra = ["--beta=0.5"]
    if variant == "lora":
        lora = "--lora={r: 8, alpha: 16, target_modules: [q_proj, v_proj, gate_proj, up_proj, down_proj]}"
        extra += [lora, f"--peft_save_path={tmp_path / 'peft'}"]
    else:
        extra += ["--optimizer.learning_rate=5e-4"]
    assert train_dpo.main(_overrides(tmp_path, tiny_llama, 60, *extra)) == 0
    evals = [r for r in _metrics(tmp_path) if "eval/validation/dpo_accuracy" in r]
    assert evals[-1]["eval/validation/dpo_accuracy"] > 0.6, evals[-1]
    assert evals[-1]["eval/validation/dpo_margin_policy"] > evals[-1]["eval/validation/dpo_margin_ref"], evals[-1]
    if variant == "lora":
        base = transformers.AutoModelForCausalLM.from_pretrained(tiny_llama)
        peft.PeftModel.from_pretrained(base, tmp_path / "peft")


def test_epoch_sets_the_steps_from_the_training_pairs(tmp_path: Path, tiny_llama: Path) -> None:
    """240 shipped pairs, 10 % held out (24): 216 training pairs, 2 passes of 8 pairs a step = 54 steps."""
    from ponente.trainer.config import load_config

    argv = [a.removeprefix("--") for a in _overrides(tmp_path, tiny_llama, 1, "--epoch=2")]
    config = train_dpo.with_epochs(load_config(train_dpo.TrainDpoConfig, overrides=argv))
    assert config.trainer.num_train_steps == math.ceil(2 * (240 - math.ceil(0.1 * 240)) / 8)


def _family_folder(family: str, tiny_llama: Path, where: Path) -> Path:
    """A tiny random Hugging Face model of ``family`` with the tiny Llama's tokenizer."""
    import shutil

    import torch
    import transformers

    if family == "llama":
        return tiny_llama
    small = {
        "vocab_size": transformers.LlamaConfig.from_pretrained(tiny_llama).vocab_size,
        "hidden_size": 32,
        "intermediate_size": 64,
        "num_hidden_layers": 2,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "head_dim": 8,
        "max_position_embeddings": 256,
    }
    torch.manual_seed(3)
    if family == "qwen3":
        model = transformers.Qwen3ForCausalLM(transformers.Qwen3Config(**small, tie_word_embeddings=False))
    else:
        config = transformers.Gemma2Config(**small, sliding_window=16, query_pre_attn_scalar=8)
        model = transformers.Gemma2ForCausalLM(config)
    model.save_pretrained(where)
    shutil.copy(tiny_llama / "tokenizer.json", where / "tokenizer.json")
    return where


@pytest.mark.parametrize("family", ["llama", "qwen3", "gemma2"])
def test_pair_logprobs_of_the_training_rows_equal_transformers(family: str, tmp_path: Path, tiny_llama: Path) -> None:
    """The rows ``data.format: preference_chat`` gives (system turns, earlier exchanges, implicit prompts, truncated
    pairs), scored by the task's forward pass, equal the completion log-probs ``transformers`` computes on TRL's
    cut (1e-4), for Llama, Qwen3 and Gemma 2."""
    import torch
    import transformers

    from ponente.models.hf import load_pretrained
    from ponente.trainer.config import load_config
    from ponente.trainer.data import pair_datasets
    from ponente.trainer.tasks.dpo import _pair_logprobs, dpo_batch

    argv = [a.removeprefix("--") for a in _overrides(tmp_path, tiny_llama, 1, "--data.shuffle=false")]
    config = load_config(train_dpo.TrainDpoConfig, overrides=argv)
    pairs, _ = pair_datasets(config.data, 96, seed=0, validation_split_fraction=None)
    pairs.wait_for_length(None)
    rows = pairs.get_batch(list(range(12)))
    records = _records()[:12]
    batch = dpo_batch({k: np.stack([r[k] for r in rows]) for k in rows[0]})
    folder = _family_folder(family, tiny_llama, tmp_path / family)
    model = load_pretrained(str(folder))
    chosen, rejected = _pair_logprobs(model, batch, key=None)

    hf_tok = transformers.PreTrainedTokenizerFast(tokenizer_file=str(tiny_llama / "tokenizer.json"))
    hf_tok.chat_template = _template()
    hf = transformers.AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32, attn_implementation="eager")
    hf = hf.eval()
    want: dict[str, list[float]] = {"chosen": [], "rejected": []}
    for record in records:
        prompt, *responses = _hf_pair(hf_tok, record)
        longer = max(len(r) for r in responses)
        # by hand: a long pair keeps the end of its prompt (down to half the row), then the start of the responses
        keep_p = len(prompt) if len(prompt) + longer <= 96 else min(len(prompt), max(96 - longer, 48))
        for name, response in zip(("chosen", "rejected"), responses, strict=True):
            ids = (prompt[len(prompt) - keep_p :] + response)[:96]
            with torch.no_grad():
                logp = torch.log_softmax(hf(torch.tensor([ids])).logits.double()[0], -1).numpy()
            want[name].append(sum(logp[j - 1, ids[j]] for j in range(keep_p, len(ids))))
    np.testing.assert_allclose(np.asarray(chosen.array), want["chosen"], atol=1e-4, rtol=0)
    np.testing.assert_allclose(np.asarray(rejected.array), want["rejected"], atol=1e-4, rtol=0)


def test_precomputed_reference_gives_the_losses_of_the_live_reference(tmp_path: Path, tiny_llama: Path) -> None:
    """``precompute_reference: true`` (reference log-probs computed once, carried in the batch) logs the losses
    and metrics of a run that runs the reference model every step; SimPO runs without a reference."""
    runs = {"live": (), "precomputed": ("--precompute_reference=true",), "simpo": ("--loss_type=simpo",)}
    logged = {}
    for name, extra in runs.items():
        where = tmp_path / name
        assert train_dpo.main(_overrides(where, tiny_llama, 2, *extra)) == 0
        logged[name] = [r for r in _metrics(where) if "train/dpo_loss" in r]
    for key in ("train/dpo_loss", "train/dpo_margin_ref", "train/dpo_chosen_reward", "train/dpo_accuracy"):
        np.testing.assert_allclose(
            [r[key] for r in logged["precomputed"]], [r[key] for r in logged["live"]], atol=2e-5, err_msg=key
        )
    simpo = logged["simpo"]
    assert len(simpo) == 2
    assert simpo[0]["train/dpo_loss"] != pytest.approx(math.log(2), abs=1e-3)  # reference-free: not ln 2 at step 1


def test_a_reference_of_another_shape_is_refused_naming_the_key(
    tmp_path: Path, tiny_llama: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    import torch
    import transformers

    other = tmp_path / "other"
    config = transformers.LlamaConfig.from_pretrained(tiny_llama)
    config.intermediate_size = 48
    torch.manual_seed(1)
    transformers.LlamaForCausalLM(config).save_pretrained(other)
    argv = _overrides(tmp_path, tiny_llama, 1, f"--reference_model_path={other}")
    assert train_dpo.main(argv) == 2
    last = capsys.readouterr().err.strip().splitlines()[-1]
    assert last.startswith("error: reference_model_path:"), last
    assert not (tmp_path / "metrics.jsonl").exists() or not any("train/dpo_loss" in r for r in _metrics(tmp_path))


@pytest.mark.integration
def test_dpo_stopped_and_resumed_matches_an_uninterrupted_run_bitwise(tmp_path: Path, tiny_llama: Path) -> None:
    """Full DPO (policy and reference in the state) stopped after 2 of 4 steps and resumed equals an uninterrupted
    run bit for bit: the logged losses and the exported weights."""
    whole, parts = tmp_path / "whole", tmp_path / "parts"
    constant = ("--optimizer.lr_schedule=constant",)
    for where, steps in ((whole, 4), (parts, 2), (parts, 4)):
        argv = _overrides(where, tiny_llama, steps, *constant, f"--hf_save_path={where / 'hf'}")
        assert train_dpo.main([*argv, "--trainer.steps_per_eval=100"]) == 0
    a = [(r["step"], r["train/dpo_loss"]) for r in _metrics(whole) if "train/dpo_loss" in r]
    b = [(r["step"], r["train/dpo_loss"]) for r in _metrics(parts) if "train/dpo_loss" in r]
    assert a == b
    assert [s for s, _ in b] == [1, 2, 3, 4]
    assert (whole / "hf" / "model.safetensors").read_bytes() == (parts / "hf" / "model.safetensors").read_bytes()


@pytest.mark.multidevice
def test_dpo_on_8_devices_fsdp_and_tensor_parallel_matches_1_device(tmp_path: Path, tiny_llama: Path) -> None:
    import os
    import subprocess
    import sys

    from safetensors.numpy import load_file

    layouts = {
        "one": (1, []),
        "eight": (8, ["--trainer.model_axis_size=2", "--trainer.tensor_parallel_axes=[mlp, heads, kv_heads]"]),
    }
    for name, (devices, layout) in layouts.items():
        where = tmp_path / name
        where.mkdir()
        env = {**os.environ, "XLA_FLAGS": f"--xla_force_host_platform_device_count={devices}", "JAX_PLATFORMS": "cpu"}
        argv = _overrides(where, tiny_llama, 3, "--optimizer.learning_rate=1e-3", f"--hf_save_path={where / 'hf'}")
        proc = subprocess.run(
            [sys.executable, "-m", "ponente.trainer.main.train_dpo", *argv, *layout],
            cwd=where, env=env, capture_output=True, text=True, timeout=600,
        )  # fmt: skip
        assert proc.returncode == 0, proc.stderr[-3000:]
    for key in ("train/dpo_loss", "train/dpo_margin_policy"):
        one = [r[key] for r in _metrics(tmp_path / "one") if key in r]
        eight = [r[key] for r in _metrics(tmp_path / "eight") if key in r]
        np.testing.assert_allclose(eight, one, atol=1e-5, err_msg=key)
    one_w = load_file(tmp_path / "one" / "hf" / "model.safetensors")
    eight_w = load_file(tmp_path / "eight" / "hf" / "model.safetensors")
    for key, value in one_w.items():
        np.testing.assert_allclose(eight_w[key], value, atol=1e-5, err_msg=key)
