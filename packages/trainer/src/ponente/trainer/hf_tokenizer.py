"""Write a ``tokenizers.Tokenizer`` as the tokenizer files of a Hugging Face model folder."""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

__all__ = ["HfTokenizerFiles"]

_SPECIAL_ROLES = {
    "eos_token": ("<|endoftext|>", "</s>", "<eos>"),
    "bos_token": ("<|begin_of_text|>", "<s>", "<bos>", "<|endoftext|>"),
    "unk_token": ("<unk>", "<|endoftext|>"),
}


class HfTokenizerFiles:
    """Adapts a ``tokenizers.Tokenizer`` to the ``save_pretrained(path)`` interface of ``ponente.models.hf``.

    ``save_pretrained`` writes ``tokenizer.json`` and a ``tokenizer_config.json`` naming
    ``PreTrainedTokenizerFast`` and the special tokens found in the vocabulary, so
    ``transformers.AutoTokenizer.from_pretrained(path)`` loads it offline.

    Args:
        tokenizer: the tokenizer.
        model_max_length: the longest sequence the model handles (recorded in the config).
    """

    def __init__(self, tokenizer: Any, *, model_max_length: int | None = None) -> None:
        self.tokenizer = tokenizer
        self.model_max_length = model_max_length

    def save_pretrained(self, path: str | os.PathLike[str]) -> None:
        """Write ``tokenizer.json`` and ``tokenizer_config.json`` into ``path``."""
        directory = Path(path)
        directory.mkdir(parents=True, exist_ok=True)
        self.tokenizer.save(os.fspath(directory / "tokenizer.json"))
        vocab = self.tokenizer.get_vocab(with_added_tokens=True)
        config: dict[str, Any] = {"tokenizer_class": "PreTrainedTokenizerFast"}
        for role, candidates in _SPECIAL_ROLES.items():
            found = next((c for c in candidates if c in vocab), None)
            if found is not None:
                config[role] = found
        if self.model_max_length is not None:
            config["model_max_length"] = self.model_max_length
        with open(directory / "tokenizer_config.json", "w", encoding="utf-8") as f:
            json.dump(config, f, indent=2, sort_keys=True)
