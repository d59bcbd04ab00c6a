"""The losses of five tiny runs, pinned: the hello world, a Llama run, SFT (chat), LoRA and Whisper ASR.

Each run goes through its entry point's ``main(argv)`` with the argument list a user would type (a packaged
config shrunk by dotted overrides), and its losses are read back from the JSON tracker's file. The pinned
numbers were recorded at commit 28d611d (before the ``Run``/``Task`` refactor of issue 32), on one CPU device,
where they were bitwise equal. XLA's CPU kernels round differently on other instruction sets (AVX2 vs AVX-512), so
they are compared here to 1e-5 relative: a change of formula, data order or optimizer moves them far more.
Regenerate them (only for a change meant to alter the numerics) with
``python tests/test_pinned_losses.py`` from ``packages/trainer``, which prints the dict below.
"""

from __future__ import annotations

import json
import tempfile
from collections.abc import Callable
from pathlib import Path

from conftest import TOKENIZER, tiny_corpus
from finetune_support import write_tiny_llama

from ponente.trainer.data.synthetic_speech import write_synthetic_speech
from ponente.trainer.main import lora_lm, sft, train_asr, train_lm

STEPS = 3

TINY_DECODER = [
    "--model.seq_len=32",
    "--model.hidden_dim=32",
    "--model.intermediate_dim=64",
    "--model.num_layers=2",
    "--model.num_heads=2",
    "--model.num_kv_heads=2",
]


def _shrunk(where: Path) -> list[str]:
    """Overrides of every run: ``STEPS`` steps of 4 rows, one evaluation batch, every output under ``where``."""
    return [
        f"--data.cache_dir={where / 'cache'}",
        "--trainer.train_batch_size=4",
        f"--trainer.num_train_steps={STEPS}",
        f"--trainer.steps_per_eval={STEPS}",
        "--trainer.max_eval_batches=1",
        "--trainer.id=pinned",
        f"--trainer.run_dir={where / 'runs' / '{run_id}'}",
        f"--trainer.tracker={{type: json, path: {where / 'metrics.jsonl'}}}",
        f"--trainer.checkpointer.base_path={where / 'checkpoints'}",
    ]


def _losses(where: Path) -> dict[str, list[str]]:
    """Every ``*loss`` metric the JSON tracker logged under ``where``, in step order, as ``float.hex`` strings."""
    out: dict[str, list[str]] = {}
    for line in (where / "metrics.jsonl").read_text().splitlines():
        record = json.loads(line)
        for key, value in record.items():
            if key.endswith("loss") and isinstance(value, float):
                out.setdefault(key, []).append(value.hex())
    return out


def _run(main: Callable[[list[str]], int], where: Path, argv: list[str]) -> dict[str, list[str]]:
    """Run an entry point's ``main`` on ``argv`` and read back the losses it logged under ``where``."""
    where.mkdir(parents=True)
    assert main(argv) == 0, f"{main.__module__} {' '.join(argv)}"
    return _losses(where)


def _measure(root: Path) -> dict[str, dict[str, list[str]]]:
    """The losses of the five runs, with every input and output under ``root``."""
    train, validation = tiny_corpus(root)
    text = [f"--data.train_urls=[{train}]", f"--data.validation_urls=[{validation}]", f"--data.tokenizer={TOKENIZER}"]
    llama_dir = write_tiny_llama(root / "tiny_llama")
    finetune = [f"--initialize_from_hf={llama_dir}", f"--data.tokenizer={llama_dir}", "--max_train_length=64"]
    digits = root / "digits"
    write_synthetic_speech(digits, train=24, validation=8, seed=3)
    runs = {
        "gpt2_nano": (
            train_lm.main,
            ["--config_path", "gpt2_nano", *text, *TINY_DECODER, "--sample.num_tokens=0"],
        ),
        "llama": (
            train_lm.main,
            ["--config_path", "gpt2_nano", *text, "--model.type=llama", *TINY_DECODER, "--sample.num_tokens=0"],
        ),
        "sft_chat": (
            sft.main,
            ["--config_path", "sft_chat", "tiny_chat", *finetune, "--hf_save_path=null", "--hf_save_steps=null"],
        ),
        "lora_llama2": (
            lora_lm.main,
            [
                "--config_path",
                "lora_llama2",
                "tiny_instructions",
                *finetune,
                "--lora.r=4",
                "--lora.alpha=16",
                "--optimizer.learning_rate=2e-2",
            ],
        ),
        "whisper_tiny_digits": (
            train_asr.main,
            [
                "--config_path",
                "whisper_tiny_digits",
                f"--data.train_urls=[{digits / 'train.jsonl'}]",
                f"--data.validation_urls=[{digits / 'validation.jsonl'}]",
                f"--data.tokenizer={digits / 'tokenizer'}",
                "--model.d_model=32",
                "--model.encoder_layers=1",
                "--model.decoder_layers=1",
                "--model.encoder_attention_heads=2",
                "--model.decoder_attention_heads=2",
                "--model.encoder_ffn_dim=64",
                "--model.decoder_ffn_dim=64",
                "--wer.max_examples=0",
                "--hf_save_path=null",
            ],
        ),
    }
    results = {}
    for name, (main, argv) in runs.items():
        where = root / name
        extra = [f"--peft_save_path={where / 'peft'}"] if name == "lora_llama2" else []
        results[name] = _run(main, where, [*argv, *_shrunk(where), *extra])
    return results


# Recorded at commit 28d611d (before issue 32's refactor) on one CPU device, as float.hex strings of the logged
# values (the train losses are float32, the eval losses float64 means); regenerate: python tests/test_pinned_losses.py
PINNED: dict[str, dict[str, list[str]]] = {
    "gpt2_nano": {
        "train/loss": ["0x1.0a41700000000p+3", "0x1.0860920000000p+3", "0x1.086bee0000000p+3"],
        "eval/shakespeare/loss": ["0x1.0756339ce739dp+3"],
    },
    "llama": {
        "train/loss": ["0x1.1f0fca0000000p+3", "0x1.1951bc0000000p+3", "0x1.17d7320000000p+3"],
        "eval/shakespeare/loss": ["0x1.0e69484210842p+3"],
    },
    "sft_chat": {
        "train/loss": ["0x1.9fba280000000p+2", "0x1.c17a740000000p+2", "0x1.bc52de0000000p+2"],
    },
    "lora_llama2": {
        "train/loss": ["0x1.aba8280000000p+2", "0x1.8010260000000p+2", "0x1.54661c0000000p+2"],
    },
    "whisper_tiny_digits": {
        "train/loss": ["0x1.e4834e0000000p+2", "0x1.d8ecc00000000p+2", "0x1.cf1f480000000p+2"],
        "eval/digits/loss": ["0x1.ccd1aeeeeeeefp+2"],
    },
}


REL = 1e-5


def _close(want: list[str], now: list[str]) -> bool:
    return len(want) == len(now) and all(
        abs(float.fromhex(a) - float.fromhex(b)) <= REL * abs(float.fromhex(a)) for a, b in zip(want, now, strict=True)
    )


def test_losses_are_those_of_commit_28d611d(tmp_path: Path) -> None:
    import jax

    assert jax.device_count() == 1, "the pinned losses are of one device"
    got = _measure(tmp_path)
    differ = [
        f"{run} {key}: pinned {[float.fromhex(x) for x in want]}, got {[float.fromhex(x) for x in now]}"
        for run, metrics in PINNED.items()
        for key, want in metrics.items()
        if not _close(want, now := got[run].get(key, []))
    ]
    assert not differ, "\n".join(differ)


if __name__ == "__main__":
    with tempfile.TemporaryDirectory() as directory:
        print(json.dumps(_measure(Path(directory)), indent=4))
