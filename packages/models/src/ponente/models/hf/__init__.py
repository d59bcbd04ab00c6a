"""Hugging Face interop: read and write `config.json` + (sharded) safetensors that `transformers` loads, and LoRA
adapters in PEFT's format."""

from ._checkpoint import load_pretrained, save_pretrained
from ._peft import load_peft_pretrained, save_peft_pretrained

__all__ = ["load_peft_pretrained", "load_pretrained", "save_peft_pretrained", "save_pretrained"]
