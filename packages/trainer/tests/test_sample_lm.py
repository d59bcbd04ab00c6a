"""``ponente-sample-lm`` end to end: prompts (command line or jsonl) in, completions jsonl out."""

from __future__ import annotations

import json
from pathlib import Path

import jax
import pytest
from finetune_support import write_tiny_llama

import ponente.namedtensor as hax
from ponente.models import LlamaConfig
from ponente.trainer.checkpoint import save_checkpoint
from ponente.trainer.config import config_to_dict
from ponente.trainer.inference import Engine, GenerationConfig, load_model
from ponente.trainer.main.sample_lm import SampleLmConfig, main


@pytest.fixture(scope="module")
def hf_folder(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_tiny_llama(tmp_path_factory.mktemp("tiny_llama"))


def read_jsonl(path: Path) -> list[dict[str, object]]:
    return [json.loads(line) for line in path.read_text(encoding="utf-8").splitlines()]


def test_jsonl_in_jsonl_out(hf_folder: Path, tmp_path: Path) -> None:
    prompts = ["Hello", "### Instruction:\nWrite a poem", "The capital of France"]
    source = tmp_path / "prompts.jsonl"
    source.write_text("".join(json.dumps({"id": i, "prompt": p}) + "\n" for i, p in enumerate(prompts)))
    output = tmp_path / "out.jsonl"
    argv = [
        f"--hf_checkpoint={hf_folder}",
        f"--prompts_file={source}",
        f"--output={output}",
        "--max_new_tokens=12",
        "--temperature=0.7",
        "--seed=3",
        "--logprobs=true",
        "--max_batch_size=2",
        "--progress_bar=false",
    ]
    assert main(argv) == 0
    records = read_jsonl(output)
    model, tokenizer = load_model(str(hf_folder))
    expected = Engine(model, tokenizer).generate(
        prompts, GenerationConfig(max_new_tokens=12, temperature=0.7, seed=3, logprobs=True, stop_token_ids=(3,))
    )
    assert [r["id"] for r in records] == [0, 1, 2]
    assert [r["prompt"] for r in records] == prompts
    assert [r["completion"] for r in records] == [c.text for c in expected]
    assert [r["tokens"] for r in records] == [c.tokens for c in expected]
    assert [r["finish_reason"] for r in records] == [c.finish_reason for c in expected]
    for record, completion in zip(records, expected, strict=True):
        assert record["logprobs"] == pytest.approx(completion.logprobs)


def test_command_line_prompts_to_stdout(hf_folder: Path, capsys: pytest.CaptureFixture[str]) -> None:
    argv = [f"--hf_checkpoint={hf_folder}", "--prompts=[Hello, Once upon]", "--max_new_tokens=5", "--stop_strings=[e]"]
    assert main(argv) == 0
    records = [json.loads(line) for line in capsys.readouterr().out.splitlines()]
    assert [r["prompt"] for r in records] == ["Hello", "Once upon"]
    assert all("e" not in r["completion"] and "logprobs" not in r for r in records)


def test_a_ponente_checkpoint_with_its_saved_configuration(hf_folder: Path, tmp_path: Path) -> None:
    """A checkpoint's metadata names the architecture and the tokenizer; no other argument is needed."""
    config = LlamaConfig(seq_len=64, hidden_dim=32, intermediate_dim=64, num_layers=2, num_heads=4, num_kv_heads=2)
    tokenizer_file = hf_folder / "tokenizer.json"
    model = config.build(hax.Axis("vocab", 384), key=jax.random.PRNGKey(1))

    saved = {"model": config_to_dict(config), "data": {"tokenizer": str(tokenizer_file), "vocab_size": None}}
    path = save_checkpoint({"model": model}, tmp_path / "run" / "step-3", step=3, metadata={"config": saved})
    loaded, tokenizer = load_model(str(tmp_path / "run"))
    assert tokenizer is not None
    assert loaded.config == config
    output = tmp_path / "out.jsonl"
    argv = [f"--checkpoint_path={path}", "--prompts=[Hello]", "--max_new_tokens=6", f"--output={output}"]
    assert main(argv) == 0
    [record] = read_jsonl(output)
    expected = Engine(model, tokenizer).generate(["Hello"], GenerationConfig(max_new_tokens=6))[0]
    assert record["tokens"] == expected.tokens
    assert record["completion"] == expected.text


def test_config_errors_name_the_key() -> None:
    with pytest.raises(ValueError, match="checkpoint_path / hf_checkpoint"):
        SampleLmConfig(prompts=["x"])
    with pytest.raises(ValueError, match="prompts / prompts_file"):
        SampleLmConfig(hf_checkpoint="x")
