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
    from ponente.trainer.data.tokens import TokenizerSpec  # noqa: F401  (the trainer's tokenizer spec exists)

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
def test_lora_dpo_learns_the_preference_and_its_adapter_loads_in_peft(tmp_path: Path, tiny_llama: Path) -> None:
    """LoRA-DPO on the learnable synthetic preference: held-out pairs end with a positive reward margin for most
    pairs; the PEFT adapter loads on the base model."""
    import peft
    import transformers

    lora = "--lora={r: 8, alpha: 16, target_modules: [q_proj, v_proj, gate_proj, up_proj, down_proj]}"
    argv = _overrides(tmp_path, tiny_llama, 60, lora, f"--peft_save_path={tmp_path / 'peft'}", "--beta=0.5")
    assert train_dpo.main(argv) == 0
    evals = [r for r in _metrics(tmp_path) if "eval/validation/dpo_accuracy" in r]
    assert evals[-1]["eval/validation/dpo_accuracy"] > 0.6, evals[-1]
    base = transformers.AutoModelForCausalLM.from_pretrained(tiny_llama)
    peft.PeftModel.from_pretrained(base, tmp_path / "peft")


def test_epoch_sets_the_steps_from_the_training_pairs(tmp_path: Path, tiny_llama: Path) -> None:
    """240 shipped pairs, 10 % held out (24): 216 training pairs, 2 passes of 8 pairs a step = 54 steps."""
    from ponente.trainer.config import load_config

    argv = [a.removeprefix("--") for a in _overrides(tmp_path, tiny_llama, 1, "--epoch=2")]
    config = train_dpo.with_epochs(load_config(train_dpo.TrainDpoConfig, overrides=argv))
    assert config.trainer.num_train_steps == math.ceil(2 * (240 - math.ceil(0.1 * 240)) / 8)
