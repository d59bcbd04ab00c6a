"""Data configs of language-model training: where the text is, how it is tokenized, cached, packed and mixed.

`LMDatasetConfig` describes one corpus (files or a Hugging Face dataset), `LMMixtureDatasetConfig` a
weighted mixture of several. Both build their datacache caches on demand and turn them into datasets of
packed fixed-length rows ``{"input_ids": int32[seq_len], "segment_ids": int32[seq_len]}``; supervised and
chat data (``format: supervised | chat``) add a target-aligned ``loss_mask`` and restarting ``position_ids``.

Cache layout: the cache of split ``S`` of a single dataset lives at ``<cache_dir>/<name or id or
"default">/<S>``; the cache of component ``K`` of a mixture at ``<mixture cache_dir>/<K>/<S>``.
"""

from __future__ import annotations

import dataclasses
import functools
import hashlib
import itertools
import logging
from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING, Any, Literal

import numpy as np

from ponente.datacache import (
    BatchProcessor,
    CacheDataset,
    ChatProcessor,
    Dataset,
    EraShuffleDataset,
    HFSource,
    MixtureDataset,
    PackedExampleDataset,
    PermutationDataset,
    SupervisedProcessor,
    TokenizerProcessor,
    TokenSeqDataset,
    load_tokenizer,
)
from ponente.trainer.data.cache_build import open_or_build, resolve_url
from ponente.trainer.data.templates import read_template, tokenizer_chat_defaults

if TYPE_CHECKING:
    from tokenizers import Tokenizer

__all__ = ["LMDatasetConfig", "LMMixtureDatasetConfig", "Row"]

logger = logging.getLogger(__name__)

Row = dict[str, np.ndarray]
"""A training row: ``{"input_ids": int32[seq_len], "segment_ids": int32[seq_len]}``, plus, for supervised and chat
data, ``"loss_mask"`` (1 where the token is a training target) and ``"position_ids"`` (restarting per example)."""

SPLITS = ("train", "validation")

FORMATS = ("text", "supervised", "chat")
"""Values of ``data.format``."""

_EOS_CANDIDATES = ("<|endoftext|>", "</s>", "<|end_of_text|>", "<eos>", "<|eos|>")
_BOS_CANDIDATES = ("<s>", "<|begin_of_text|>", "<bos>", "<|bos|>", "<|endoftext|>")


@functools.lru_cache(maxsize=16)
def _load_tokenizer(spec: str) -> Tokenizer:
    return load_tokenizer(resolve_url(spec))


def _special_token(tokenizer: Tokenizer, explicit: str | None, candidates: Sequence[str], key: str) -> str:
    """The token named by ``explicit``, else the first of ``candidates`` that is one of the tokenizer's specials."""
    if explicit is not None:
        if tokenizer.token_to_id(explicit) is None:
            raise ValueError(f"{key}: token {explicit!r} is not in the tokenizer's vocabulary")
        return explicit
    specials = {t.content for t in tokenizer.get_added_tokens_decoder().values() if t.special}
    for token in candidates:
        if token in specials:
            return token
    raise ValueError(
        f"{key} is not set and none of {list(candidates)} is a special token of the tokenizer (its special "
        f"tokens are {sorted(specials)}): set {key}, or turn off the enforce_* option that needs it"
    )


def derive_seed(seed: int, tag: str) -> int:
    """A 63-bit seed derived from ``seed`` and a text ``tag`` (e.g. a mixture component's name)."""
    digest = hashlib.blake2b(f"{int(seed)}/{tag}".encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little") >> 1


def _check_shuffle(shuffle: bool | int, where: str) -> None:
    if isinstance(shuffle, bool):
        return
    if not isinstance(shuffle, int) or shuffle < 1:
        raise ValueError(
            f"{where}.shuffle: expected false, true (a full shuffle) or an era length >= 1, got {shuffle!r}"
        )


def _shuffled(dataset: Dataset[Row], shuffle: bool | int, seed: int) -> Dataset[Row]:
    """Apply the ``shuffle`` policy: ``False`` none, ``True`` a full Feistel permutation, ``n`` eras of ``n`` rows."""
    if shuffle is False:
        return dataset
    if shuffle is True:
        return PermutationDataset(dataset, seed)
    return EraShuffleDataset(dataset, int(shuffle), seed)


def _join(base: str, *parts: str) -> str:
    """Join cache path parts with ``/`` (also for URLs such as ``gs://``), ignoring trailing slashes."""
    return "/".join([base.rstrip("/"), *(p.strip("/") for p in parts)])


class SplitSources:
    """Where the splits of a single-source data config come from and are cached (shared by the LM and ASR configs).

    The class using it has the fields ``train_urls``, ``validation_urls``, ``cache_dir``, ``id``, ``name``,
    ``train_split`` and ``validation_split``.
    """

    train_urls: list[str]
    validation_urls: list[str]
    cache_dir: str
    id: str | None
    name: str | None
    train_split: str
    validation_split: str | None
    shuffle: bool | int

    def _check_sources(self) -> None:
        """``train_urls``/``validation_urls`` are lists of strings and ``shuffle`` is valid (named ``data.<key>``)."""
        for key in ("train_urls", "validation_urls"):
            value = getattr(self, key)
            if isinstance(value, str) or not all(isinstance(u, str) for u in value):
                raise ValueError(f"data.{key}: expected a list of URL strings, got {value!r}")
        _check_shuffle(self.shuffle, "data")

    @property
    def cache_name(self) -> str:
        """The cache folder name under ``cache_dir``: ``name``, else ``id``, else ``"default"``."""
        return self.name or self.id or "default"

    def cache_path(self, split: str) -> str:
        """Where split ``split`` is cached: ``<cache_dir>/<cache_name>/<split>``."""
        return _join(self.cache_dir, self.cache_name, split)

    def has_split(self, split: str) -> bool:
        """Whether this config has a source for ``split`` (``"train"`` or ``"validation"``)."""
        return self._source(split) is not None

    def _source(self, split: str) -> list[str] | HFSource | None:
        if split not in SPLITS:
            raise ValueError(f"unknown split {split!r}: expected one of {list(SPLITS)}")
        urls = self.train_urls if split == "train" else self.validation_urls
        if urls:
            return [resolve_url(u) for u in urls]
        hf_split = self.train_split if split == "train" else self.validation_split
        if self.id is not None and hf_split is not None:
            return HFSource(self.id, split=hf_split, name=self.name)
        return None


@dataclasses.dataclass(frozen=True)
class LMDatasetConfig(SplitSources):
    """One text corpus for language-model training: sources, tokenizer, cache, shuffle (Levanter's keys).

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
        text_key: The record field holding the text.
        enforce_eos: Append the EOS token to every document (so packed documents are separated).
        enforce_bos: Prepend the BOS token to every document.
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
        format: ``"text"`` (documents under ``text_key``, packed into windows), ``"supervised"`` (a prompt and a
            response per record) or ``"chat"`` (a list of ``{role, content}`` messages per record); see
            ``docs/trainer/docs/data.md``.
        input_field: (supervised) The record field holding the prompt, when there is no ``prompt_template``.
        output_field: (supervised) The record field holding the response.
        prompt_template: (supervised) A Jinja template rendered over the record's fields to make the prompt
            (e.g. Alpaca's ``instruction``/``input``): inline text, or a path or ``package://`` URL of a
            ``.jinja`` file.
        messages_field: (chat) The record field holding the messages.
        chat_template: (chat) The Jinja chat template: inline text, a path or ``package://`` URL of a ``.jinja``
            file, or ``None``: the ``chat_template`` of the tokenizer's folder (``chat_template.jinja`` or
            ``tokenizer_config.json``).
        mask_inputs: (supervised, chat) Train on the response/assistant tokens only; ``False``: on every token.
        pack: (supervised, chat) Pack several whole examples per row; ``False``: one example per row, padded.

    Example:
        ```python
        from ponente.trainer.data import LMDatasetConfig

        cfg = LMDatasetConfig(
            train_urls=["package://ponente.trainer.assets/shakespeare_train.jsonl.gz"],
            tokenizer="package://ponente.trainer.assets/shakespeare_tokenizer.json",
            cache_dir="/tmp/ponente-cache",
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
    text_key: str = "text"
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
    format: Literal["text", "supervised", "chat"] = "text"
    input_field: str = "input"
    output_field: str = "output"
    prompt_template: str | None = None
    messages_field: str = "messages"
    chat_template: str | None = None
    mask_inputs: bool = True
    pack: bool = True

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
        if self.format not in FORMATS:
            raise ValueError(f"data.format: expected one of {list(FORMATS)}, got {self.format!r}")
        for key in ("text_key", "input_field", "output_field", "messages_field"):
            value = getattr(self, key)
            if not isinstance(value, str) or not value:
                raise ValueError(f"data.{key}: expected a non-empty field name, got {value!r}")
        for key, needs in (("prompt_template", "supervised"), ("chat_template", "chat")):
            if getattr(self, key) is not None and self.format != needs:
                raise ValueError(f"data.{key} applies to data.format: {needs}, but data.format is {self.format!r}")
        for key in ("mask_inputs", "pack"):
            if not isinstance(getattr(self, key), bool):
                raise ValueError(f"data.{key}: expected true or false, got {getattr(self, key)!r}")

    # -- tokenizer -----------------------------------------------------------------------------------

    @property
    def the_tokenizer(self) -> Tokenizer:
        """The tokenizer (``tokenizers.Tokenizer``), loaded once per process.

        Raises:
            FileNotFoundError: For a missing ``package://`` file or a directory without ``tokenizer.json``.
            OSError: For a hub id that cannot be fetched (e.g. offline).
        """
        return _load_tokenizer(self.tokenizer)

    @property
    def the_vocab_size(self) -> int:
        """The model's vocabulary size: ``vocab_size`` if set, else the tokenizer's (with added tokens).

        Raises:
            ValueError: If ``vocab_size`` is smaller than the tokenizer's vocabulary.
        """
        return _vocab_size(self.the_tokenizer, self.vocab_size, "data")

    def processor(self) -> BatchProcessor:
        """The datacache processor of this config's ``format`` (its config is part of the cache fingerprint).

        ``text``: a `TokenizerProcessor` with the BOS/EOS policy. ``supervised``: a `SupervisedProcessor`
        (BOS before the prompt, EOS after the response, per ``enforce_bos``/``enforce_eos``). ``chat``: a
        `ChatProcessor`, whose template writes its own special tokens (``enforce_*`` do not apply); its
        ``bos_token``/``eos_token`` variables are ``bos_token``/``eos_token`` if set, else those of the
        tokenizer's ``tokenizer_config.json``, else the tokenizer's usual special tokens.

        Raises:
            ValueError: Naming the key: no EOS/BOS token found for ``enforce_eos``/``enforce_bos``; a template
                that is missing (``data.chat_template``), unreadable or not valid Jinja.
        """
        tok = self.the_tokenizer
        if self.format == "chat":
            defaults = tokenizer_chat_defaults(resolve_url(self.tokenizer))
            template = read_template(self.chat_template, "data.chat_template")
            if template is None:
                template = defaults.chat_template
            if template is None:
                raise ValueError(
                    f"data.chat_template: not set, and the tokenizer {self.tokenizer!r} has no chat template (no "
                    "chat_template.jinja or tokenizer_config.json with a chat_template next to it); set "
                    "data.chat_template to Jinja text or to a .jinja file"
                )
            return ChatProcessor(
                tok,
                messages_field=self.messages_field,
                chat_template=template,
                mask_inputs=self.mask_inputs,
                bos=self.bos_token or defaults.bos_token or _maybe_special(tok, _BOS_CANDIDATES),
                eos=self.eos_token or defaults.eos_token or _maybe_special(tok, _EOS_CANDIDATES),
                template_key="data.chat_template",
            )
        eos = _special_token(tok, self.eos_token, _EOS_CANDIDATES, "data.eos_token") if self.enforce_eos else None
        bos = _special_token(tok, self.bos_token, _BOS_CANDIDATES, "data.bos_token") if self.enforce_bos else None
        if self.format == "supervised":
            return SupervisedProcessor(
                tok,
                input_field=self.input_field,
                output_field=self.output_field,
                prompt_template=read_template(self.prompt_template, "data.prompt_template"),
                bos=bos,
                eos=eos,
                mask_inputs=self.mask_inputs,
                template_key="data.prompt_template",
            )
        return TokenizerProcessor(tok, text_key=self.text_key, bos=bos, eos=eos)

    # -- caches: cache_name, cache_path, has_split come from SplitSources ---------------------------

    def build_caches(self, split: str, *, background: bool = True, progress: bool = True) -> CacheDataset:
        """Build (or resume, or open) the cache of ``split`` at `cache_path`.

        Args:
            split: ``"train"`` or ``"validation"``.
            background: Build in a daemon thread and return as soon as the first rows commit (the cache
                grows while training reads it); ``False`` builds in this thread and returns it finished.
            progress: Show the builder's progress bar.

        Returns:
            The cache. With ``background=True`` it may still grow; reading its length or state after the
            build failed raises `ponente.trainer.data.CacheBuildError` with the build's exception as cause.

        Raises:
            ValueError: If the config has no source for ``split``.
            ponente.datacache.FingerprintMismatchError: If the cache there was built from other inputs.
        """
        return _build_split(self, split, self.cache_path(split), background=background, progress=progress)

    def build_all_caches(self, *, progress: bool = True) -> dict[str, CacheDataset]:
        """Build every split that has a source, in this thread; returns ``{split: finished cache}``."""
        return {s: self.build_caches(s, background=False, progress=progress) for s in SPLITS if self.has_split(s)}

    # -- datasets ------------------------------------------------------------------------------------

    def rows(self, cache: CacheDataset, seq_len: int) -> Dataset[Row]:
        """The rows of a cache of this config: windows (``text``) or packed whole examples (supervised, chat).

        Args:
            cache: A cache built by `build_caches`.
            seq_len: Tokens per row.

        Returns:
            A `TokenSeqDataset` for ``format: text``, else a `PackedExampleDataset` (``pack`` as configured).
        """
        if self.format == "text":
            return TokenSeqDataset(cache, seq_len)
        return PackedExampleDataset(cache, seq_len, pack=self.pack)

    def train_set(self, seq_len: int, *, seed: int, batch_size: int | None = None) -> Dataset[Row]:
        """The training rows: packed rows of ``seq_len`` tokens (see `rows`), shuffled per ``shuffle``.

        The cache builds in the background if needed. While it builds, the dataset grows (unshuffled or
        era-shuffled) or stays empty until the build finishes (``shuffle: true``); `batch_for_step` waits.

        Args:
            seq_len: Tokens per row.
            seed: Root seed of the shuffle.
            batch_size: Unused for a single dataset (mixtures need it for weight schedules).

        Returns:
            A dataset of ``{"input_ids", "segment_ids"}`` int32 rows (plus ``"loss_mask"`` and ``"position_ids"``
            for supervised and chat data).

        Raises:
            ValueError: If there are no training sources.
        """
        del batch_size
        rows = self.rows(self.build_caches("train"), seq_len)
        return _shuffled(rows, self.shuffle, derive_seed(seed, "train"))

    def validation_sets(self, seq_len: int) -> dict[str, Dataset[Row]]:
        """The validation rows (unshuffled, see `rows`) by name: ``{cache_name: dataset}`` or ``{}``."""
        if not self.has_split("validation"):
            return {}
        return {self.cache_name: self.rows(self.build_caches("validation"), seq_len)}


def _maybe_special(tokenizer: Tokenizer, candidates: Sequence[str]) -> str | None:
    """The first of ``candidates`` that is a special token of ``tokenizer``, or ``None``."""
    specials = {t.content for t in tokenizer.get_added_tokens_decoder().values() if t.special}
    return next((token for token in candidates if token in specials), None)


class _AllTargets(Dataset[Row]):
    """Text rows with the keys of supervised rows, so that a mixture can mix both: every token a target (as in
    text training) and positions ``0..seq_len-1`` (the positions a text row gets without ``position_ids``)."""

    def __init__(self, inner: Dataset[Row]) -> None:
        self.inner = inner

    def __len__(self) -> int:
        return len(self.inner)

    @property
    def is_finished(self) -> bool:
        return self.inner.is_finished

    def wait_for_length(self, length: int | None = None, *, timeout: float | None = None) -> bool:
        return self.inner.wait_for_length(length, timeout=timeout)

    def __getitem__(self, index: int) -> Row:
        return self._complete(self.inner[index])

    def get_batch(self, indices: Any) -> list[Row]:
        return [self._complete(row) for row in self.inner.get_batch(indices)]

    @staticmethod
    def _complete(row: Row) -> Row:
        ids = row["input_ids"]
        ones = np.ones(ids.shape, dtype=np.int32)
        return {**row, "loss_mask": ones, "position_ids": np.arange(ids.shape[-1], dtype=np.int32)}


def _vocab_size(tokenizer: Tokenizer, vocab_size: int | None, where: str) -> int:
    actual = int(tokenizer.get_vocab_size(with_added_tokens=True))
    if vocab_size is None:
        return actual
    if vocab_size < actual:
        raise ValueError(f"{where}.vocab_size: {vocab_size} is smaller than the tokenizer's vocabulary ({actual})")
    return vocab_size


def _build_split(
    config: LMDatasetConfig, split: str, location: str, *, background: bool, progress: bool
) -> CacheDataset:
    source = config._source(split)
    if source is None:
        raise ValueError(
            f"no {split} data: set data.{split}_urls"
            + (" or data.id" if split == "train" else " (or data.id with data.validation_split)")
        )
    logger.info("cache of %s split %r: %s", config.cache_name, split, location)
    return open_or_build(
        location,
        background=background,
        inputs=source,
        processor=config.processor(),
        text_key=config.text_key,
        backend=config.backend,
        workers=config.workers,
        bad_records=config.bad_records,
        progress=progress,
    )


WeightStages = list[tuple[int, dict[str, float]]]
"""A weight schedule: ``[(start_step, {component: weight}), ...]``, the first stage starting at step 0."""


@dataclasses.dataclass(frozen=True)
class LMMixtureDatasetConfig:
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
        _check_shuffle(self.shuffle, "data")
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

    def _component(self, name: str) -> LMDatasetConfig:
        return dataclasses.replace(self.configs[name], tokenizer=self.tokenizer)

    @property
    def the_tokenizer(self) -> Tokenizer:
        """The tokenizer of every component, loaded once per process."""
        return _load_tokenizer(self.tokenizer)

    @property
    def the_vocab_size(self) -> int:
        """``vocab_size`` if set, else the tokenizer's vocabulary size."""
        return _vocab_size(self.the_tokenizer, self.vocab_size, "data")

    def cache_path(self, component: str, split: str) -> str:
        """Where ``component``'s ``split`` is cached: ``<cache_dir>/<component>/<split>``."""
        return _join(self.cache_dir, component, split)

    def build_caches(self, split: str, *, background: bool = True, progress: bool = True) -> dict[str, CacheDataset]:
        """Build (or open) the ``split`` cache of every component that has a source for it.

        Args:
            split: ``"train"`` or ``"validation"``.
            background: As in `LMDatasetConfig.build_caches`.
            progress: Show progress bars.

        Returns:
            ``{component: cache}``.
        """
        return {
            name: self._build(name, split, background=background, progress=progress)
            for name in self.configs
            if self._component(name).has_split(split)
        }

    def _build(self, name: str, split: str, *, background: bool, progress: bool = True) -> CacheDataset:
        location = self.cache_path(name, split)
        return _build_split(self._component(name), split, location, background=background, progress=progress)

    def build_all_caches(self, *, progress: bool = True) -> dict[str, CacheDataset]:
        """Build every split of every component in this thread; returns ``{"<component>/<split>": cache}``."""
        return {
            f"{name}/{split}": cache
            for split in SPLITS
            for name, cache in self.build_caches(split, background=False, progress=progress).items()
        }

    def train_set(self, seq_len: int, *, seed: int, batch_size: int | None = None) -> Dataset[Row]:
        """The mixture of the components' training rows (see the class docstring).

        Args:
            seq_len: Tokens per row.
            seed: Root seed of the shuffles and of the within-block mixing.
            batch_size: Rows per training step; needed when ``train_weights`` is a schedule, to turn its
                start steps into row indices (``step * batch_size``, a multiple of ``mixture_block_size``).

        Returns:
            A dataset of ``{"input_ids", "segment_ids"}`` int32 rows; if some component is supervised or chat
            data, every row also has ``"loss_mask"`` and ``"position_ids"`` (a text component's rows get all
            ones and ``0..seq_len-1``, which train exactly as text rows do).

        Raises:
            ValueError: If a schedule is given without ``batch_size``, a stage does not start on a block, or
                a component with positive weight has no training data.
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
        active = [name for name in self.configs if any(w.get(name, 0) > 0 for _, w in index_stages)]
        mixed = any(self.configs[name].format != "text" for name in active)
        datasets: dict[str, Dataset[Row]] = {}
        for name in active:
            component = self._component(name)
            rows = component.rows(self._build(name, "train", background=True), seq_len)
            if mixed and component.format == "text":
                rows = _AllTargets(rows)
            datasets[name] = _shuffled(rows, self.shuffle, derive_seed(seed, f"train/{name}"))
        schedule = [(start, {k: w for k, w in weights.items() if k in datasets}) for start, weights in index_stages]
        return MixtureDataset(
            datasets,
            schedule,
            block_size=block,
            seed=derive_seed(seed, "mixture"),
            stop_strategy=self.stop_strategy,
        )

    def validation_sets(self, seq_len: int) -> dict[str, Dataset[Row]]:
        """Unshuffled validation rows (see `LMDatasetConfig.rows`) of every component that has some, by name."""
        return {
            name: self._component(name).rows(cache, seq_len) for name, cache in self.build_caches("validation").items()
        }
