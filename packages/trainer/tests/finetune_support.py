"""Shared helpers of the fine-tuning tests: a tiny random Hugging Face Llama with a locally trained tokenizer.

Nothing touches the network: the tokenizer is trained on the shipped tiny instruction and chat sets, the model
is a ``transformers`` Llama with random weights written with ``save_pretrained``.
"""

from __future__ import annotations

import importlib.resources
import json
from pathlib import Path

ASSETS = "package://ponente.trainer.assets"
INSTRUCTIONS = f"{ASSETS}/tiny_instructions.jsonl"
CHAT = f"{ASSETS}/tiny_chat.jsonl"
CHAT_TEMPLATE = f"{ASSETS}/tiny_chat_template.jinja"
ALPACA_TEMPLATE = (
    "{% if input %}### Instruction:\n{{ instruction }}\n### Input:\n{{ input }}\n### Response:\n"
    "{% else %}### Instruction:\n{{ instruction }}\n### Response:\n{% endif %}"
)
"""An Alpaca-style prompt over the shipped set's ``instruction``/``input`` fields."""

SPECIAL = ["<pad>", "<unk>", "<s>", "</s>"]


def _asset_texts() -> list[str]:
    root = importlib.resources.files("ponente.trainer.assets")
    texts = []
    for line in root.joinpath("tiny_instructions.jsonl").read_text(encoding="utf-8").splitlines():
        texts.extend(str(v) for v in json.loads(line).values())
    for line in root.joinpath("tiny_chat.jsonl").read_text(encoding="utf-8").splitlines():
        texts.extend(m["content"] for m in json.loads(line)["messages"])
    return texts


def write_tokenizer(directory: Path) -> int:
    """Train a small byte-level BPE tokenizer on the shipped sets and save ``tokenizer.json``; returns its size."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tokenizer = Tokenizer(models.BPE(unk_token="<unk>"))
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=384, special_tokens=SPECIAL, initial_alphabet=pre_tokenizers.ByteLevel.alphabet()
    )
    tokenizer.train_from_iterator(_asset_texts(), trainer)
    directory.mkdir(parents=True, exist_ok=True)
    tokenizer.save(str(directory / "tokenizer.json"))
    return int(tokenizer.get_vocab_size())


def write_tiny_llama(directory: Path, *, seed: int = 0, max_positions: int = 128) -> Path:
    """A random 2-layer Llama (hidden 32) and its tokenizer in ``directory``, as ``save_pretrained`` writes them."""
    import torch
    import transformers

    vocab_size = write_tokenizer(directory)
    config = transformers.LlamaConfig(
        vocab_size=vocab_size,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=max_positions,
        tie_word_embeddings=False,
        bos_token_id=2,
        eos_token_id=3,
        pad_token_id=0,
    )
    torch.manual_seed(seed)
    model = transformers.LlamaForCausalLM(config)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "norm" in name:  # random norms: a test cannot pass by accident of symmetric weights
                param.copy_(1.0 + 0.1 * torch.randn_like(param))
        # logits of a useful size: the final norm bounds the hidden state, so with the default 0.02 scale of the
        # output projection, adapters inside the layers could barely move the loss
        model.lm_head.weight.mul_(10.0)
    model.save_pretrained(directory, safe_serialization=True)
    return directory


def supervised_overrides(tmp_path: Path, model_dir: Path, steps: int) -> list[str]:
    """Overrides of a tiny run on the shipped instruction set with an Alpaca-style prompt (both entry points)."""
    return [
        f"initialize_from_hf={model_dir}",
        f"data.train_urls=[{INSTRUCTIONS}]",
        f"data.validation_urls=[{INSTRUCTIONS}]",
        f"data.tokenizer={model_dir / 'tokenizer.json'}",
        f"data.cache_dir={tmp_path / 'cache'}",
        "data.format=supervised",
        "data.output_field=output",
        f"data.prompt_template={ALPACA_TEMPLATE}",
        "data.workers=0",
        "max_train_length=128",
        "trainer.seed=0",
        "trainer.mp=f32",
        "trainer.train_batch_size=8",
        f"trainer.num_train_steps={steps}",
        "trainer.steps_per_eval=1000",
        "trainer.max_eval_batches=1",
        "trainer.id=tiny",
        "trainer.progress_bar=false",
        "trainer.compilation_cache_dir=null",
        f"trainer.run_dir={tmp_path / 'runs' / '{run_id}'}",
        f"trainer.tracker={{type: json, path: {tmp_path / 'metrics.jsonl'}}}",
        f"trainer.checkpointer.base_path={tmp_path / 'ckpt'}",
        "optimizer.learning_rate=3e-3",
        "optimizer.weight_decay=0.0",
        "optimizer.warmup=0.0",
    ]


def losses(tmp_path: Path) -> list[tuple[int, float]]:
    """``(step, train/loss)`` of every step the JSON tracker logged under ``tmp_path``."""
    records = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    return [(r["step"], r["train/loss"]) for r in records if "train/loss" in r]
