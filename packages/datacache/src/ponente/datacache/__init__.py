"""Resumable, reproducible on-disk token caches and random-access datasets over them.

This package never imports JAX: everything it returns is NumPy.
"""

__version__ = "0.1.0"

from ponente.datacache._hub import hub_file
from ponente.datacache.asr import AsrExampleDataset, AudioTranscriptProcessor
from ponente.datacache.builder import build_cache
from ponente.datacache.errors import (
    BadRecordError,
    CacheCorruptError,
    CacheNotFoundError,
    DataCacheError,
    FingerprintMismatchError,
    MissingExtraError,
    PonenteConfigError,
    PonenteUserError,
)
from ponente.datacache.hf_source import HFSource
from ponente.datacache.lease import BuilderLease, LeaseLostError
from ponente.datacache.ledger import Ledger, ShardProgress
from ponente.datacache.processor import BatchProcessor, PassthroughProcessor, TokenizerProcessor, load_tokenizer
from ponente.datacache.sft import ChatProcessor, SupervisedProcessor
from ponente.datacache.source import BadInput, FileSource, Source, expand_inputs
from ponente.datacache.store import CacheDataset, open_cache
from ponente.datacache.verify import verify_cache

__all__ = [
    "AsrExampleDataset",
    "AudioTranscriptProcessor",
    "BadInput",
    "BadRecordError",
    "BatchProcessor",
    "BuilderLease",
    "CacheCorruptError",
    "CacheDataset",
    "CacheNotFoundError",
    "ChatProcessor",
    "DataCacheError",
    "FileSource",
    "FingerprintMismatchError",
    "HFSource",
    "LeaseLostError",
    "Ledger",
    "MissingExtraError",
    "PassthroughProcessor",
    "PonenteConfigError",
    "PonenteUserError",
    "ShardProgress",
    "Source",
    "SupervisedProcessor",
    "TokenizerProcessor",
    "build_cache",
    "expand_inputs",
    "hub_file",
    "load_tokenizer",
    "open_cache",
    "verify_cache",
]

# --- exports of the datasets layer (maintained by DC2) ---
from ponente.datacache.dataset import Dataset, InMemoryTokenStore, TokenStore
from ponente.datacache.mixture import MixtureDataset, StopStrategy, block_counts
from ponente.datacache.packing import PackedExampleDataset
from ponente.datacache.permutation import FeistelPermutation, PermutationDataset
from ponente.datacache.preference import PreferenceChatProcessor, PreferencePairDataset
from ponente.datacache.shuffle import EpochDataset, EraShuffleDataset
from ponente.datacache.token_seq import TokenSeqDataset

__all__ += [
    "Dataset",
    "EpochDataset",
    "EraShuffleDataset",
    "FeistelPermutation",
    "InMemoryTokenStore",
    "MixtureDataset",
    "PackedExampleDataset",
    "PermutationDataset",
    "PreferenceChatProcessor",
    "PreferencePairDataset",
    "StopStrategy",
    "TokenSeqDataset",
    "TokenStore",
    "block_counts",
]
