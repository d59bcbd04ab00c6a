"""The data pipeline of the trainer: source → format → rows → shuffle / mixture → loader.

Configs describe (`LMDatasetConfig`, `LMMixtureDatasetConfig`, the ``data.format`` configs of
``ponente.trainer.data.formats``, speech included); `build_datasets` does the I/O (caches, tokenizer) and returns
the training and validation rows; `data_tokenizer` / `data_vocab_size` load a config's tokenizer (the one function
the tasks and entry points call); `DataLoader` / `batch_for_step` turn rows into batches.

See ``docs/trainer/docs/data.md`` for the config keys, the cache layout and the semantics of shuffling a
cache that is still being built.
"""

from ponente.trainer.data.build import (
    LmDatasets,
    build_all_caches,
    build_caches,
    build_datasets,
    data_processor,
    data_tokenizer,
    data_vocab_size,
    train_set,
    validation_sets,
)
from ponente.trainer.data.cache_build import (
    DEFAULT_FOLLOW_TIMEOUT,
    PACKAGE_SCHEME,
    CacheBuildError,
    FollowMode,
    follow_cache_builds,
    resolve_url,
)
from ponente.trainer.data.formats import (
    AsrDatasetFormat,
    ChatLmDatasetFormat,
    LmDatasetFormat,
    PreferenceChatLmDatasetFormat,
    SupervisedLmDatasetFormat,
    TextLmDatasetFormat,
)
from ponente.trainer.data.lm_dataset import LMDatasetConfig, LMMixtureDatasetConfig, Row
from ponente.trainer.data.loader import DataLoader, batch_for_step
from ponente.trainer.data.pairs import WithRowFields, pair_datasets

__all__ = [
    "DEFAULT_FOLLOW_TIMEOUT",
    "PACKAGE_SCHEME",
    "AsrDatasetFormat",
    "CacheBuildError",
    "ChatLmDatasetFormat",
    "DataLoader",
    "FollowMode",
    "LMDatasetConfig",
    "LMMixtureDatasetConfig",
    "LmDatasetFormat",
    "LmDatasets",
    "PreferenceChatLmDatasetFormat",
    "Row",
    "SupervisedLmDatasetFormat",
    "TextLmDatasetFormat",
    "WithRowFields",
    "batch_for_step",
    "build_all_caches",
    "build_caches",
    "build_datasets",
    "data_processor",
    "data_tokenizer",
    "data_vocab_size",
    "follow_cache_builds",
    "pair_datasets",
    "resolve_url",
    "train_set",
    "validation_sets",
]
