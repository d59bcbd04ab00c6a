"""Data configs of language-model training: a corpus (`LMDatasetConfig`) or a weighted mixture of corpora
(`LMMixtureDatasetConfig`). They describe; `ponente.trainer.data.build_datasets` opens the caches and makes rows.

A corpus is a source (files or a Hugging Face dataset, see `SplitSources`), a tokenizer with its BOS/EOS policy,
and a ``format`` (``ponente.trainer.data.formats``: ``text``, ``supervised``, ``chat``, ``preference_chat``, ``asr``)
that turns its records into cached tokens and then into rows ``{"input_ids": int32[seq_len], "segment_ids":
int32[seq_len]}`` (supervised and chat rows add a target-aligned ``loss_mask`` and restarting ``position_ids``;
speech rows are log-mel features and transcript tokens).

Cache layout: the cache of split ``S`` of a single dataset lives at ``<cache_dir>/<name or id or
"default">/<S>``; the cache of component ``K`` of a mixture at ``<mixture cache_dir>/<K>/<S>``.
"""

from __future__ import annotations

import dataclasses
import itertools
import warnings
from collections.abc import Callable, Mapping, Sequence
from typing import TYPE_CHECKING, Any, Literal

import numpy as np

from ponente.trainer.config import ConfigError
from ponente.trainer.data.formats import LmDatasetFormat, TextLmDatasetFormat
from ponente.trainer.data.source import SplitSources, check_shuffle, join_path
from ponente.trainer.data.tokens import load_data_tokenizer, vocab_size

if TYPE_CHECKING:
    from tokenizers import Tokenizer

__all__ = ["LMDatasetConfig", "LMMixtureDatasetConfig", "Row"]

Row = dict[str, np.ndarray]
"""A training row: ``{"input_ids": int32[seq_len], "segment_ids": int32[seq_len]}``, plus, for supervised and chat
data, ``"loss_mask"`` (1 where the token is a training target) and ``"position_ids"`` (restarting per example)."""

FLAT_FORMAT_KEYS: dict[str, Any] = {
    "text_key": "text",
    "input_field": "input",
    "output_field": "output",
    "prompt_template": None,
    "messages_field": "messages",
    "chat_template": None,
    "mask_inputs": True,
    "pack": True,
    "audio_field": "audio",
    "text_field": "text",
    "audio_root": None,
    "n_mels": 80,
    "chunk_seconds": 30.0,
    "language": "en",
    "task": "transcribe",
    "timestamps": False,
    "max_label_tokens": 448,
}
"""Format fields that older configs write directly under ``data`` (``data.messages_field``, the speech configs'
``data.n_mels``), with the defaults they had there; `move_flat_format_keys` reads them into ``data.format``."""


def move_flat_format_keys(
    items: Mapping[Any, Any], path: str, read: Callable[[Any, str], Any], base: LMDatasetConfig | None
) -> Mapping[Any, Any]:
    """Read the flat spellings of format fields (``data.format: chat`` + ``data.messages_field: m``) into
    ``data.format`` (``{type: chat, messages_field: m}``).

    A flat key that is not a field of the chosen format is dropped when it holds its former default (older
    configs carried e.g. ``prompt_template: null`` next to ``format: chat``); with another value it stays, and
    the decoder reports it (``data.format.chat_template: not a field of type 'text'; ...``).

    Args:
        items: The keys of a ``data`` mapping.
        path: Its dotted key (``data``).
        read: ``read(value, key)``: a value's plain data (command-line text read as YAML).
        base: The config the keys merge over (its format type applies when ``items`` gives none), or None.

    Raises:
        ConfigError: naming both keys when a field is given flat and under ``format`` with different values.
    """
    flat = {k: v for k, v in items.items() if k in FLAT_FORMAT_KEYS}
    if not flat:
        return items
    rest = {k: v for k, v in items.items() if k not in flat}
    given = read(items["format"], "format") if "format" in items else None
    if isinstance(given, str):
        given = {"type": given}
    if given is not None and not isinstance(given, Mapping):
        return items  # the decoder reports the bad ``format`` value
    given = dict(given or {})
    type_name = given.get("type", base.format.choice_name if base is not None else LmDatasetFormat.default_choice)
    try:
        own = {f.name for f in dataclasses.fields(LmDatasetFormat.get_choice_class(str(type_name)))}
    except KeyError:
        own = set(FLAT_FORMAT_KEYS)  # the decoder reports the unknown type

    def plain(value: Any, key: str) -> Any:  # for comparing only: a template need not read as YAML
        try:
            return read(value, key)
        except ConfigError:
            return value

    prefix = f"{path}." if path else ""
    for key, value in flat.items():
        if key not in own and plain(value, key) == FLAT_FORMAT_KEYS[key]:
            continue
        if key in given and plain(given[key], key) != plain(value, key):
            raise ConfigError(
                f"{prefix}{key}: given both flat ({plain(value, key)!r}) and as {prefix}format.{key} "
                f"({plain(given[key], key)!r}); keep one"
            )
        given[key] = value
    rest["format"] = given
    return rest


class _DeprecatedTokenizerAccess:
    """The data configs' former ``the_tokenizer``/``the_vocab_size``: deprecated, since a config only describes.

    Use `ponente.trainer.data.data_tokenizer` / `ponente.trainer.data.data_vocab_size` (or the `LmDatasets` of
    `ponente.trainer.data.build_datasets`).
    """

    tokenizer: str
    vocab_size: int | None

    @property
    def the_tokenizer(self) -> Tokenizer:
        """Deprecated: ``ponente.trainer.data.data_tokenizer(config)``."""
        _warn_moved("the_tokenizer", "data_tokenizer")
        return load_data_tokenizer(self.tokenizer)

    @property
    def the_vocab_size(self) -> int:
        """Deprecated: ``ponente.trainer.data.data_vocab_size(config)``."""
        _warn_moved("the_vocab_size", "data_vocab_size")
        return vocab_size(load_data_tokenizer(self.tokenizer), self.vocab_size, "data")


def _warn_moved(member: str, function: str) -> None:
    warnings.warn(
        f"the data config's {member} is deprecated (a config only describes; the pipeline loads): call "
        f"ponente.trainer.data.{function}(config) instead",
        DeprecationWarning,
        stacklevel=3,
    )


@dataclasses.dataclass(frozen=True)
class LMDatasetConfig(SplitSources, _DeprecatedTokenizerAccess):
    """One corpus for language-model training: source, tokenizer, cache, shuffle and format (Levanter's keys).

    Attributes:
        id: A Hugging Face dataset id or ``save_to_disk`` directory (needs the ``hf`` extra of
            ``ponente-datacache``); used when ``train_urls``/``validation_urls`` are empty.
        name: The Hugging Face dataset configuration (subset) name; also names the cache folder.
        train_urls: Training files: paths, globs, brace patterns, fsspec URLs or
            ``package://<module>/<file>`` (jsonl/json/txt/parquet, optionally gz/zst/bz2/xz).
        validation_urls: Validation files, same forms. Empty (and no ``id``): no validation set.
        cache_dir: Root folder (or ``gs://``/``s3://``/``memory://`` URL) of the caches; split ``S`` is cached at
            ``<cache_dir>/<name or id or "default">/<S>``.
        tokenizer: A ``tokenizer.json``, a directory with one, a ``package://`` URL or a Hugging Face hub id
            (offline, a hub id fails with a message saying so).
        enforce_eos: Append the EOS token to every document / example (``text``, ``supervised``).
        enforce_bos: Prepend the BOS token to every document / example (``text``, ``supervised``).
        eos_token: The EOS token; ``None`` picks the tokenizer's special token among ``<|endoftext|>``, ``</s>``,
            ``<|end_of_text|>``, ``<eos>``.
        bos_token: The BOS token; ``None`` picks among ``<s>``, ``<|begin_of_text|>``, ``<bos>``,
            ``<|endoftext|>``.
        shuffle: ``False``: rows in corpus order; ``True``: a full permutation of the packed rows (needs the
            final row count, so the training set waits for the cache to finish); an integer ``n``: shuffle
            within consecutive eras of ``n`` rows (starts as soon as the first era is cached).
        vocab_size: The model's vocabulary size; ``None``: the tokenizer's. Must not be smaller than it.
        train_split: The Hugging Face split read for training (with ``id``).
        validation_split: The Hugging Face split read for validation (with ``id``); ``None``: none.
        workers: Tokenizer worker processes of a cache build; ``0`` tokenizes in the building thread;
            ``None``: one per CPU.
        backend: The cache builder backend: ``"local"`` or ``"ray"``.
        bad_records: ``"error"`` (stop at a bad record, naming file and line) or ``"skip"`` (count them).
        format: How records become tokens and rows: ``{type: text | supervised | chat | preference_chat | asr,
            ...}`` (see ``ponente.trainer.data.formats``); ``format: chat`` is short for ``{type: chat}``. The flat
            keys of older configs (``text_key``, ``input_field``, ``output_field``, ``prompt_template``,
            ``messages_field``, ``chat_template``, ``mask_inputs``, ``pack``, and the speech configs'
            ``audio_field``, ``n_mels``, ``max_label_tokens``, ...) are read into it.

    Example:
        ```python
        from ponente.trainer.data import LMDatasetConfig
        from ponente.trainer.data.formats import ChatLmDatasetFormat

        cfg = LMDatasetConfig(
            train_urls=["package://ponente.trainer.assets/tiny_chat.jsonl"],
            tokenizer="package://ponente.trainer.assets/shakespeare_tokenizer.json",
            cache_dir="/tmp/ponente-cache",
            format=ChatLmDatasetFormat(chat_template="package://ponente.trainer.assets/tiny_chat_template.jinja"),
        )
        assert cfg.cache_path("train") == "/tmp/ponente-cache/default/train"
        ```
    """

    id: str | None = None
    name: str | None = None
    train_urls: list[str] = dataclasses.field(default_factory=list)
    validation_urls: list[str] = dataclasses.field(default_factory=list)
    cache_dir: str = "cache/"
    tokenizer: str = "gpt2"
    enforce_eos: bool = True
    enforce_bos: bool = False
    eos_token: str | None = None
    bos_token: str | None = None
    shuffle: bool | int = False
    vocab_size: int | None = None
    train_split: str = "train"
    validation_split: str | None = "validation"
    workers: int | None = None
    backend: Literal["local", "ray"] = "local"
    bad_records: Literal["error", "skip"] = "error"
    format: LmDatasetFormat = dataclasses.field(default_factory=TextLmDatasetFormat)

    upgrade_config_keys = staticmethod(move_flat_format_keys)
    """Read by the config decoder before the keys of a ``data`` mapping: the flat format keys move to ``format``."""

    def __post_init__(self) -> None:
        """Check the values that can be checked without touching files.

        Raises:
            ValueError: naming the offending key.
        """
        self._check_sources()
        if self.vocab_size is not None and self.vocab_size < 1:
            raise ValueError(f"data.vocab_size: expected a positive integer or null, got {self.vocab_size}")
        if self.backend not in ("local", "ray"):
            raise ValueError(f"data.backend: expected 'local' or 'ray', got {self.backend!r}")
        if self.bad_records not in ("error", "skip"):
            raise ValueError(f"data.bad_records: expected 'error' or 'skip', got {self.bad_records!r}")
        if self.workers is not None and self.workers < 0:
            raise ValueError(f"data.workers: expected >= 0 or null, got {self.workers}")
        if not isinstance(self.format, LmDatasetFormat):
            raise ValueError(
                f"data.format: expected a format config (type one of {LmDatasetFormat.choice_names()}), "
                f"got {self.format!r}"
            )


WeightStages = list[tuple[int, dict[str, float]]]
"""A weight schedule: ``[(start_step, {component: weight}), ...]``, the first stage starting at step 0."""


@dataclasses.dataclass(frozen=True)
class LMMixtureDatasetConfig(_DeprecatedTokenizerAccess):
    """A weighted mixture of corpora (Levanter's keys); rows are drawn per block in exact proportions.

    The mixture's ``tokenizer`` and ``cache_dir`` apply to every component (a component's own values are
    not used); component ``K``'s split ``S`` is cached at ``<cache_dir>/<K>/<S>``. Each component is packed
    into windows and shuffled per ``shuffle`` (seeds derived from the run seed and the component name)
    before mixing. Components whose weight is zero in every stage are not trained on (and not built for
    training) but still give validation sets.

    Attributes:
        configs: The components by name.
        train_weights: ``{component: weight}`` (need not sum to 1), or a schedule of stages
            ``[[start_step, {component: weight}], ...]`` whose first stage starts at step 0.
        cache_dir: Root of the component caches.
        tokenizer: The tokenizer of every component (forms as in `LMDatasetConfig`).
        shuffle: The shuffle policy of every component (as in `LMDatasetConfig`).
        mixture_block_size: Rows per block; every block holds the weights' proportions exactly.
        stop_strategy: ``"restart"``: an exhausted component starts over (the mixture never ends);
            ``"error"``: the mixture ends where a component runs out.
        vocab_size: The model's vocabulary size; ``None``: the tokenizer's.

    Example:
        ```python
        from ponente.trainer.data import LMDatasetConfig, LMMixtureDatasetConfig

        mix = LMMixtureDatasetConfig(
            configs={"a": LMDatasetConfig(train_urls=["a.jsonl"]), "b": LMDatasetConfig(train_urls=["b.jsonl"])},
            train_weights={"a": 0.75, "b": 0.25},
            cache_dir="/tmp/cache",
        )
        assert mix.cache_path("b", "train") == "/tmp/cache/b/train"
        ```
    """

    configs: dict[str, LMDatasetConfig] = dataclasses.field(default_factory=dict)
    train_weights: dict[str, float] | WeightStages = dataclasses.field(default_factory=dict)
    cache_dir: str = "cache/"
    tokenizer: str = "gpt2"
    shuffle: bool | int = False
    mixture_block_size: int = 2048
    stop_strategy: Literal["restart", "error"] = "restart"
    vocab_size: int | None = None

    def __post_init__(self) -> None:
        """Check component names, weights and options.

        Raises:
            ValueError: naming the offending key, component or stage.
        """
        if not self.configs:
            raise ValueError("data.configs: a mixture needs at least one component")
        for stage, (_, weights) in enumerate(self._stages()):
            unknown = sorted(set(weights) - set(self.configs))
            if unknown:
                raise ValueError(
                    f"data.train_weights (stage {stage}): unknown component(s) {unknown}; "
                    f"the components (data.configs) are {sorted(self.configs)}"
                )
            if any(not np.isfinite(w) or w < 0 for w in weights.values()) or sum(weights.values()) <= 0:
                raise ValueError(
                    f"data.train_weights (stage {stage}): weights must be >= 0 with a positive sum, got {weights}"
                )
        check_shuffle(self.shuffle, "data")
        if self.mixture_block_size < 1:
            raise ValueError(f"data.mixture_block_size: expected >= 1, got {self.mixture_block_size}")
        if self.stop_strategy not in ("restart", "error"):
            raise ValueError(f"data.stop_strategy: expected 'restart' or 'error', got {self.stop_strategy!r}")

    def _stages(self) -> list[tuple[int, dict[str, float]]]:
        weights: Any = self.train_weights
        if isinstance(weights, Mapping):
            return [(0, dict(weights))]
        stages = []
        for k, stage in enumerate(weights):
            if not isinstance(stage, Sequence) or len(stage) != 2 or not isinstance(stage[1], Mapping):
                raise ValueError(f"data.train_weights stage {k}: expected [start_step, {{component: weight}}]")
            stages.append((int(stage[0]), dict(stage[1])))
        if not stages or stages[0][0] != 0:
            raise ValueError("data.train_weights: a schedule's first stage must start at step 0")
        if any(b[0] <= a[0] for a, b in itertools.pairwise(stages)):
            raise ValueError(f"data.train_weights: stage start steps must increase, got {[s for s, _ in stages]}")
        return stages

    def component(self, name: str) -> LMDatasetConfig:
        """Component ``name`` as it is built: with the mixture's ``tokenizer``."""
        return dataclasses.replace(self.configs[name], tokenizer=self.tokenizer)

    def cache_path(self, component: str, split: str) -> str:
        """Where ``component``'s ``split`` is cached: ``<cache_dir>/<component>/<split>``."""
        return join_path(self.cache_dir, component, split)

    def index_stages(self, batch_size: int | None) -> list[tuple[int, dict[str, float]]]:
        """The weight stages with their start steps turned into row indices (``step * batch_size``).

        Raises:
            ValueError: If a schedule is given without ``batch_size``, or a stage does not start on a block.
        """
        stages = self._stages()
        if len(stages) > 1 and batch_size is None:
            raise ValueError("data.train_weights is a schedule: train_set needs batch_size to place its stages")
        block = self.mixture_block_size
        index_stages = []
        for step, weights in stages:
            start = step * (batch_size or 0)
            if start % block:
                raise ValueError(
                    f"data.train_weights: the stage at step {step} starts at row {start} = step * batch_size "
                    f"({batch_size}), which is not a multiple of data.mixture_block_size ({block})"
                )
            index_stages.append((start, weights))
        return index_stages
