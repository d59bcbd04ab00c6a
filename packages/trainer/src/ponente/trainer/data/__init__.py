"""Data glue of the trainer: data configs, on-demand caches, packed rows, mixtures and batch loading.

See ``docs/trainer/docs/data.md`` for the config keys, the cache layout and the semantics of shuffling a
cache that is still being built.
"""

from ponente.trainer.data.asr import AsrDatasetConfig
from ponente.trainer.data.cache_build import (
    DEFAULT_FOLLOW_TIMEOUT,
    PACKAGE_SCHEME,
    CacheBuildError,
    FollowMode,
    follow_cache_builds,
    resolve_url,
)
from ponente.trainer.data.lm_dataset import LMDatasetConfig, LMMixtureDatasetConfig, Row
from ponente.trainer.data.loader import DataLoader, batch_for_step

__all__ = [
    "DEFAULT_FOLLOW_TIMEOUT",
    "PACKAGE_SCHEME",
    "AsrDatasetConfig",
    "CacheBuildError",
    "DataLoader",
    "FollowMode",
    "LMDatasetConfig",
    "LMMixtureDatasetConfig",
    "Row",
    "batch_for_step",
    "follow_cache_builds",
    "resolve_url",
]
