"""The builder of the data pipeline: the one place that does the I/O of the LM data configs.

source (files, a Hugging Face dataset, a mixture) → format (processor: records → cached tokens) → rows (windows or
packed examples) → shuffle / mix → `build_datasets` (and `ponente.trainer.data.DataLoader` for batches).

Example:
    ```python
    from ponente.trainer.data import LMDatasetConfig, build_datasets

    data = build_datasets(LMDatasetConfig(train_urls=["train.jsonl"], tokenizer="tokenizer.json"), seq_len=128, seed=0)
    data.train[0]["input_ids"].shape  # (128,)
    ```
"""

from __future__ import annotations

import dataclasses
import hashlib
import logging
from typing import TYPE_CHECKING, Any, overload

import numpy as np

from ponente.datacache import CacheDataset, Dataset, EraShuffleDataset, MixtureDataset, PermutationDataset
from ponente.trainer.data.cache_build import open_or_build, resolve_url
from ponente.trainer.data.lm_dataset import LMDatasetConfig, LMMixtureDatasetConfig, Row
from ponente.trainer.data.source import SPLITS
from ponente.trainer.data.tokens import TokenizerSpec, load_data_tokenizer, vocab_size

if TYPE_CHECKING:
    from tokenizers import Tokenizer

    from ponente.datacache import BatchProcessor

__all__ = [
    "LmDatasets",
    "build_all_caches",
    "build_caches",
    "build_datasets",
    "data_processor",
    "data_tokenizer",
    "data_vocab_size",
    "derive_seed",
    "shuffled",
    "train_set",
    "validation_sets",
]

logger = logging.getLogger(__name__)

LmData = LMDatasetConfig | LMMixtureDatasetConfig


@dataclasses.dataclass(frozen=True)
class LmDatasets:
    """What `build_datasets` returns: the rows a run trains and evaluates on, and the vocabulary they use.

    Attributes:
        train: The training rows (shuffled / mixed per the config), or ``None`` when not asked for.
        validation: The unshuffled validation rows by name (``{}``: none).
        tokenizer: The data's tokenizer.
        vocab_size: ``data.vocab_size`` if set, else the tokenizer's vocabulary size.
    """

    train: Dataset[Row] | None
    validation: dict[str, Dataset[Row]]
    tokenizer: Tokenizer
    vocab_size: int


def build_datasets(
    data: LmData, seq_len: int, *, seed: int, batch_size: int | None = None, train: bool = True
) -> LmDatasets:
    """Open (building in the background where needed) the caches of ``data`` and return its datasets.

    Args:
        data: A single corpus or a mixture.
        seq_len: Tokens per row.
        seed: The root seed of the shuffles and of the mixing.
        batch_size: Rows per step (a mixture's weight schedule needs it).
        train: Build the training set (``False``: validation only, e.g. for evaluation).

    Returns:
        The `LmDatasets`.

    Raises:
        ValueError: naming the key (no training data, a bad token, a template that cannot be read, ...).
    """
    return LmDatasets(
        train=train_set(data, seq_len, seed=seed, batch_size=batch_size) if train else None,
        validation=validation_sets(data, seq_len),
        tokenizer=data_tokenizer(data),
        vocab_size=data_vocab_size(data),
    )


# -- tokenizer ---------------------------------------------------------------------------------------


def data_tokenizer(data: LmData) -> Tokenizer:
    """The tokenizer of ``data`` (loaded once per process): the one place the tasks and entry points load it.

    Raises:
        FileNotFoundError: For a missing ``package://`` file or a directory without ``tokenizer.json`` (the message
            starts with ``data.tokenizer:``).
        OSError: For a hub id that cannot be fetched (e.g. offline), also naming ``data.tokenizer``.
    """
    try:
        return load_data_tokenizer(data.tokenizer)
    except FileNotFoundError as e:
        raise FileNotFoundError(f"data.tokenizer: {e}") from e
    except OSError as e:
        raise OSError(f"data.tokenizer: {e}") from e


def data_vocab_size(data: LmData) -> int:
    """``data.vocab_size`` if set, else the tokenizer's size (with added tokens).

    Raises:
        ValueError: If ``data.vocab_size`` is smaller than the tokenizer's vocabulary.
    """
    return vocab_size(data_tokenizer(data), data.vocab_size, "data")


def data_processor(data: LMDatasetConfig, split: str = "train") -> BatchProcessor:
    """The datacache processor of a single corpus's ``split``: its format's, with the corpus's tokenizer and BOS/EOS
    policy (and the folder of the split's files, for paths inside its records)."""
    tokens = TokenizerSpec(
        tokenizer=data_tokenizer(data),
        location=resolve_url(data.tokenizer),
        spec=data.tokenizer,
        enforce_eos=data.enforce_eos,
        enforce_bos=data.enforce_bos,
        eos_token=data.eos_token,
        bos_token=data.bos_token,
    )
    return data.format.processor(tokens, data.folder(split))


# -- caches ------------------------------------------------------------------------------------------


def _build_split(
    config: LMDatasetConfig, split: str, location: str, *, background: bool, progress: bool
) -> CacheDataset:
    source = config.source(split)
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
        processor=data_processor(config, split),
        text_key=config.format.txt_key,
        backend=config.backend,
        workers=config.workers,
        bad_records=config.bad_records,
        progress=progress,
    )


@overload
def build_caches(
    data: LMDatasetConfig, split: str, *, background: bool = True, progress: bool = True
) -> CacheDataset: ...
@overload
def build_caches(
    data: LMMixtureDatasetConfig, split: str, *, background: bool = True, progress: bool = True
) -> dict[str, CacheDataset]: ...
def build_caches(
    data: LmData, split: str, *, background: bool = True, progress: bool = True
) -> CacheDataset | dict[str, CacheDataset]:
    """Build (or resume, or open) the ``split`` cache of a corpus, or of every mixture component that has the split.

    Args:
        data: A single corpus (cached at ``data.cache_path(split)``) or a mixture (``{component: cache}``).
        split: ``"train"`` or ``"validation"``.
        background: Build in a daemon thread and return as soon as the first rows commit (the cache grows while
            training reads it); ``False`` builds in this thread and returns it finished.
        progress: Show the builder's progress bar.

    Returns:
        The cache, or ``{component: cache}`` for a mixture. With ``background=True`` a cache may still grow;
        reading its length or state after the build failed raises `ponente.trainer.data.CacheBuildError`.

    Raises:
        ValueError: If a single corpus has no source for ``split``.
        ponente.datacache.FingerprintMismatchError: If the cache there was built from other inputs.
    """
    if isinstance(data, LMMixtureDatasetConfig):
        return _mixture_caches(data, split, background=background, progress=progress)
    return _single_cache(data, split, background=background, progress=progress)


def _build_component(
    mix: LMMixtureDatasetConfig, name: str, split: str, *, background: bool, progress: bool = True
) -> CacheDataset:
    location = mix.cache_path(name, split)
    return _build_split(mix.component(name), split, location, background=background, progress=progress)


def build_all_caches(data: LmData, *, progress: bool = True) -> dict[str, CacheDataset]:
    """Build every split (of every component) in this thread: ``{split: cache}``, or ``{"<component>/<split>": cache}``
    for a mixture."""
    if isinstance(data, LMMixtureDatasetConfig):
        return {
            f"{name}/{split}": cache
            for split in SPLITS
            for name, cache in _mixture_caches(data, split, background=False, progress=progress).items()
        }
    return {s: _single_cache(data, s, background=False, progress=progress) for s in SPLITS if data.has_split(s)}


def _single_cache(data: LMDatasetConfig, split: str, *, background: bool, progress: bool = True) -> CacheDataset:
    return _build_split(data, split, data.cache_path(split), background=background, progress=progress)


def _mixture_caches(
    mix: LMMixtureDatasetConfig, split: str, *, background: bool, progress: bool = True
) -> dict[str, CacheDataset]:
    return {
        name: _build_component(mix, name, split, background=background, progress=progress)
        for name in mix.configs
        if mix.component(name).has_split(split)
    }


# -- rows, shuffles, mixtures -----------------------------------------------------------------------


def derive_seed(seed: int, tag: str) -> int:
    """A 63-bit seed derived from ``seed`` and a text ``tag`` (e.g. a mixture component's name)."""
    digest = hashlib.blake2b(f"{int(seed)}/{tag}".encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little") >> 1


def shuffled(dataset: Dataset[Any], shuffle: bool | int, seed: int) -> Dataset[Any]:
    """Apply a ``shuffle`` policy: ``False`` none, ``True`` a full Feistel permutation, ``n`` eras of ``n`` rows."""
    if shuffle is False:
        return dataset
    if shuffle is True:
        return PermutationDataset(dataset, seed)
    return EraShuffleDataset(dataset, int(shuffle), seed)


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


def train_set(data: LmData, seq_len: int, *, seed: int, batch_size: int | None = None) -> Dataset[Row]:
    """The training rows of ``data``: its format's rows of ``seq_len`` tokens, shuffled per ``data.shuffle``.

    A single corpus's cache builds in the background if needed; while it builds the dataset grows (unshuffled
    or era-shuffled) or stays empty until the build finishes (``shuffle: true``); `batch_for_step` waits. A
    mixture shuffles each component (seeds derived from ``seed`` and the component name) and mixes them per
    block; if some active component's rows carry a loss mask, the rows of the others get all-ones masks.

    Args:
        data: A single corpus or a mixture.
        seq_len: Tokens per row.
        seed: Root seed of the shuffles and of the within-block mixing.
        batch_size: Rows per training step; needed when a mixture's ``train_weights`` is a schedule, to turn its
            start steps into row indices (``step * batch_size``, a multiple of ``mixture_block_size``).

    Raises:
        ValueError: If there are no training sources, a schedule is given without ``batch_size``, or a stage
            does not start on a block.
    """
    if isinstance(data, LMDatasetConfig):
        rows = data.format.rows(_single_cache(data, "train", background=True), seq_len, data_tokenizer(data))
        return shuffled(rows, data.shuffle, derive_seed(seed, "train"))
    index_stages = data.index_stages(batch_size)
    active = [name for name in data.configs if any(w.get(name, 0) > 0 for _, w in index_stages)]
    masked = any(data.configs[name].format.has_loss_mask for name in active)
    datasets: dict[str, Dataset[Row]] = {}
    for name in active:
        component = data.component(name)
        cache = _build_component(data, name, "train", background=True)
        rows = component.format.rows(cache, seq_len, data_tokenizer(data))
        if masked and not component.format.has_loss_mask:
            rows = _AllTargets(rows)
        datasets[name] = shuffled(rows, data.shuffle, derive_seed(seed, f"train/{name}"))
    schedule = [(start, {k: w for k, w in weights.items() if k in datasets}) for start, weights in index_stages]
    return MixtureDataset(
        datasets,
        schedule,
        block_size=data.mixture_block_size,
        seed=derive_seed(seed, "mixture"),
        stop_strategy=data.stop_strategy,
    )


def validation_sets(data: LmData, seq_len: int) -> dict[str, Dataset[Row]]:
    """The unshuffled validation rows by name: ``{cache_name: rows}`` of a corpus, ``{component: rows}`` of a mixture
    (every component that has validation data), or ``{}``."""
    if isinstance(data, LMMixtureDatasetConfig):
        return {
            name: data.component(name).format.rows(cache, seq_len, data_tokenizer(data))
            for name, cache in _mixture_caches(data, "validation", background=True).items()
        }
    if not data.has_split("validation"):
        return {}
    cache = _single_cache(data, "validation", background=True)
    return {data.cache_name: data.format.rows(cache, seq_len, data_tokenizer(data))}
