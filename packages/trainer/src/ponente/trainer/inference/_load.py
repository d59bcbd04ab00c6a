"""A model and its tokenizer for generation: from a Hugging Face folder or a Ponente training checkpoint."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path
from typing import Any

from ponente.models import Gpt2Config, LmConfig

__all__ = ["eos_token_ids", "load_model"]


@dataclasses.dataclass(frozen=True)
class _ModelSection:
    """The ``model:`` section of a saved run configuration (decoded like the training config's)."""

    model: LmConfig = dataclasses.field(default_factory=Gpt2Config)


def load_model(
    path: str,
    *,
    vocab_size: int | None = None,
    model_config: LmConfig | None = None,
    tokenizer: str | None = None,
) -> tuple[Any, Any]:
    """Load a language model and its tokenizer.

    ``path`` is either a Hugging Face model folder (with ``config.json``; a hub id is downloaded unless offline) or
    a Ponente checkpoint (``.../step-N``) or run directory (its latest committed checkpoint). A checkpoint records
    its run's resolved configuration: the ``model:`` section (or ``initialize_from_hf``'s ``config.json``) gives
    the architecture and ``data.tokenizer`` / ``data.vocab_size`` the tokenizer and vocabulary.

    Args:
        path: the folder or checkpoint.
        vocab_size: the vocabulary size of a checkpoint (None: from its configuration or tokenizer).
        model_config: the architecture of a checkpoint (None: from its configuration).
        tokenizer: a ``tokenizer.json`` file, a folder holding one, or a hub id (None: ``path``'s own, else the
            checkpoint configuration's ``data.tokenizer``; no tokenizer at all gives None).

    Returns:
        ``(model, tokenizer)``; the tokenizer is a ``tokenizers.Tokenizer`` or None.

    Raises:
        FileNotFoundError: if ``path`` is neither a model folder nor a committed checkpoint.
        ValueError: if a checkpoint's configuration does not say its architecture or vocabulary (pass
            ``model_config`` / ``vocab_size``).
    """
    from ponente.datacache import load_tokenizer
    from ponente.trainer.data import resolve_url

    folder = Path(path)
    if (folder / "config.json").is_file() or not folder.exists():
        from ponente.models.hf import load_pretrained

        model = load_pretrained(path)
        spec = tokenizer if tokenizer is not None else (path if (folder / "tokenizer.json").is_file() else None)
        return model, None if spec is None else load_tokenizer(resolve_url(spec))
    return _load_checkpoint(path, vocab_size=vocab_size, model_config=model_config, tokenizer=tokenizer)


def _load_checkpoint(
    path: str, *, vocab_size: int | None, model_config: LmConfig | None, tokenizer: str | None
) -> tuple[Any, Any]:
    import equinox as eqx
    import jax

    import ponente.namedtensor as hax
    from ponente.datacache import load_tokenizer
    from ponente.models import config_for_type
    from ponente.trainer.checkpoint import latest_checkpoint_path, load_checkpoint, read_metadata
    from ponente.trainer.config import load_config
    from ponente.trainer.data import resolve_url

    source = latest_checkpoint_path(path)
    metadata = None if source is None else read_metadata(source)
    if source is None or metadata is None:
        raise FileNotFoundError(f"{path}: neither a Hugging Face folder (config.json) nor a committed checkpoint")
    saved = dict(metadata.get("metadata", {}).get("config") or {})
    data = dict(saved.get("data") or {})
    hf_vocab = 0
    if model_config is None:
        if "model" in saved:
            model_config = load_config(_ModelSection, overrides={"model": saved["model"]}).model
        elif saved.get("initialize_from_hf"):
            from ponente.models.hf import resolve_checkpoint  # a folder, or a hub id from the local cache first

            folder = resolve_checkpoint(saved["initialize_from_hf"], weights=False, key="initialize_from_hf")
            hf_config = json.loads((folder / "config.json").read_text(encoding="utf-8"))
            model_config = config_for_type(str(hf_config["model_type"])).from_hf_config(hf_config)
            hf_vocab = int(hf_config.get("vocab_size", 0))
        else:
            raise ValueError(f"model_config: {source}'s configuration has no model section; pass the architecture")
    spec = tokenizer if tokenizer is not None else data.get("tokenizer")
    tok = None if spec is None else load_tokenizer(resolve_url(str(spec)))
    if vocab_size is None:
        sizes = [data.get("vocab_size"), None if tok is None else tok.get_vocab_size(with_added_tokens=True)]
        known = [int(s) for s in sizes if s is not None]
        if not known:
            raise ValueError(f"vocab_size: {source}'s configuration names no tokenizer or vocab_size; pass it")
        vocab_size = max(known[0], hf_vocab)
    assert model_config is not None  # every branch above sets it or raises
    config = model_config
    Vocab = hax.Axis("vocab", vocab_size)
    template = eqx.filter_eval_shape(lambda: config.build(Vocab, key=jax.random.PRNGKey(0)))
    return load_checkpoint(template, source, subpath="model"), tok


def eos_token_ids(path: str) -> tuple[int, ...]:
    """The end-of-sequence ids of a Hugging Face folder: ``generation_config.json``'s, else ``config.json``'s.

    Args:
        path: the model folder.

    Returns:
        The ids (empty when neither file names one).
    """
    for name in ("generation_config.json", "config.json"):
        file = Path(path) / name
        if not file.is_file():
            continue
        value = json.loads(file.read_text(encoding="utf-8")).get("eos_token_id")
        if value is not None:
            return tuple(int(v) for v in (value if isinstance(value, list) else [value]))
    return ()
