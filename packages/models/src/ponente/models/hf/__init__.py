"""Hugging Face interop: read and write `config.json` + (sharded) safetensors that `transformers` loads, and LoRA
adapters in PEFT's format. Hub ids resolve offline-first (the local Hub cache before the network)."""

from ._checkpoint import UnsupportedModelError, hf_config_class, load_pretrained, save_pretrained
from ._hub import HubUnavailableError, PickleCheckpointError, resolve_checkpoint, split_revision
from ._peft import load_peft_pretrained, save_peft_pretrained
from ._whisper import load_whisper_pretrained, save_whisper_pretrained

__all__ = [
    "HubUnavailableError",
    "PickleCheckpointError",
    "UnsupportedModelError",
    "hf_config_class",
    "load_peft_pretrained",
    "load_pretrained",
    "load_whisper_pretrained",
    "resolve_checkpoint",
    "save_peft_pretrained",
    "save_pretrained",
    "save_whisper_pretrained",
    "split_revision",
]
