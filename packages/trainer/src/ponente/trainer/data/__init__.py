"""Data glue of the trainer: data configs, on-demand caches, packed rows, mixtures and batch loading.

See ``docs/trainer/docs/data.md`` for the config keys, the cache layout and the semantics of shuffling a
cache that is still being built.
"""

from ponente.trainer.data.cache_build import PACKAGE_SCHEME, CacheBuildError, resolve_url
from ponente.trainer.data.lm_dataset import LMDatasetConfig, LMMixtureDatasetConfig, Row
from ponente.trainer.data.loader import DataLoader, batch_for_step

__all__ = [
    "PACKAGE_SCHEME",
    "CacheBuildError",
    "DataLoader",
    "LMDatasetConfig",
    "LMMixtureDatasetConfig",
    "Row",
    "batch_for_step",
    "resolve_url",
]
