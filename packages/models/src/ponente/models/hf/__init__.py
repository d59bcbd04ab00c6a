"""Hugging Face interop: read and write `config.json` + (sharded) safetensors that `transformers` loads."""

from ._checkpoint import load_pretrained, save_pretrained

__all__ = ["load_pretrained", "save_pretrained"]
