"""Hugging Face ``datasets`` as a source (the ``hf`` extra): a local ``save_to_disk`` dataset or a hub id."""

from __future__ import annotations

import itertools
import os
from collections.abc import Iterator
from typing import Any

from ponente.datacache.errors import MissingExtraError
from ponente.datacache.source import SourceItem

_OFFLINE = ("1", "true", "yes", "on")


def _datasets() -> Any:
    try:
        import datasets
    except ImportError as exc:
        raise MissingExtraError(
            "HFSource needs Hugging Face datasets, which is not installed: pip install 'ponente-datacache[hf]'"
        ) from exc
    return datasets


def _undecoded_audio(dataset: Any) -> Any:
    """``Audio`` columns as their encoded ``{"bytes", "path"}``: the audio processor decodes them with soundfile.

    Decoded ``Audio`` values need ``torchcodec`` (``datasets`` >= 4) and would be decoded twice.
    """
    datasets = _datasets()
    for name, feature in (getattr(dataset, "features", None) or {}).items():
        if isinstance(feature, datasets.Audio) and feature.decode:
            dataset = dataset.cast_column(name, datasets.Audio(decode=False))
    return dataset


class HFSource:
    """A Hugging Face dataset as a source of records.

    ``path_or_id`` is either a local directory written by ``Dataset.save_to_disk`` /
    ``DatasetDict.save_to_disk``, or a hub id loaded with ``datasets.load_dataset`` (needs the network;
    with ``HF_HUB_OFFLINE`` or ``HF_DATASETS_OFFLINE`` set it fails at once with a clear message).
    A map-style dataset is cut into shards of ``shard_rows`` rows; a streaming dataset keeps its own shards.
    ``Audio`` columns are read undecoded (``{"bytes", "path"}``), for `AudioTranscriptProcessor` to decode.

    Args:
        path_or_id: Local dataset directory or hub id.
        split: The split (required when there are several).
        name: The hub configuration name, if any.
        streaming: Stream instead of downloading (for a local dataset: iterate it as an ``IterableDataset``).
        shard_rows: Rows per shard of a map-style dataset (a shard is the unit of resumption bookkeeping).

    Raises:
        MissingExtraError: If ``datasets`` is not installed.
        OSError: If a hub id cannot be loaded (offline, unknown id).
        ValueError: If ``split`` is missing or unknown.

    Examples:
        >>> source = HFSource("/data/my_dataset", split="train")  # doctest: +SKIP
        >>> build_cache(source, "/data/cache", tokenizer="gpt2")  # doctest: +SKIP
    """

    def __init__(
        self,
        path_or_id: str | os.PathLike[str],
        *,
        split: str | None = None,
        name: str | None = None,
        streaming: bool = False,
        shard_rows: int = 100_000,
    ) -> None:
        datasets = _datasets()
        self.path_or_id = str(path_or_id)
        self.split, self.name, self.streaming = split, name, streaming
        local = os.path.isdir(self.path_or_id)
        if local:
            loaded = datasets.load_from_disk(self.path_or_id)
            if isinstance(loaded, datasets.DatasetDict):
                if split not in loaded:
                    raise ValueError(
                        f"dataset {self.path_or_id!r} has splits {sorted(loaded)}; pass split=... (found {split!r})"
                    )
                loaded = loaded[split]
            self._fingerprint = getattr(loaded, "_fingerprint", None)
            if streaming:
                loaded = loaded.to_iterable_dataset(num_shards=max(1, -(-len(loaded) // shard_rows)))
        else:
            if any(os.environ.get(v, "0").lower() in _OFFLINE for v in ("HF_HUB_OFFLINE", "HF_DATASETS_OFFLINE")):
                raise OSError(
                    f"dataset {self.path_or_id!r} is not a local directory, and HF_HUB_OFFLINE/HF_DATASETS_OFFLINE "
                    "is set, so it cannot be loaded from the Hugging Face hub: save it with save_to_disk and pass "
                    "the directory"
                )
            if split is None:
                raise ValueError(f"pass split=... to load the hub dataset {self.path_or_id!r}")
            try:
                loaded = datasets.load_dataset(self.path_or_id, name, split=split, streaming=streaming)
            except Exception as exc:
                raise OSError(
                    f"could not load dataset {self.path_or_id!r} (config {name!r}, split {split!r}) from the "
                    f"Hugging Face hub (are you offline, or is the id wrong?): {exc}"
                ) from exc
            self._fingerprint = getattr(loaded, "_fingerprint", None)
        self._dataset = _undecoded_audio(loaded)
        label = split or "data"
        if isinstance(loaded, datasets.IterableDataset):
            self._shards: dict[str, tuple[int, int]] = {f"{label}#shard{i}": (i, -1) for i in range(loaded.num_shards)}
        else:
            total = len(loaded)
            self._shards = {
                f"{label}[{a}:{min(a + shard_rows, total)}]": (a, min(a + shard_rows, total))
                for a in range(0, total, shard_rows)
            }

    @property
    def shard_names(self) -> list[str]:
        """``"split[a:b]"`` row ranges (map-style) or ``"split#shardN"`` (streaming)."""
        return list(self._shards)

    def describe(self) -> dict[str, Any]:
        """Dataset identity (path or id, config, split, fingerprint when known), streaming, and shards."""
        return {
            "type": "hf",
            "path_or_id": self.path_or_id,
            "name": self.name,
            "split": self.split,
            "streaming": self.streaming,
            "dataset_fingerprint": self._fingerprint,
            "shards": [[name] for name in self._shards],
        }

    def locate(self, name: str, row: int) -> str:
        """``"DATASET SHARD, row N"``."""
        return f"{self.path_or_id} {name}, row {row}"

    def open_shard(self, name: str, row: int = 0) -> Iterator[SourceItem]:
        """Yield ``(row, record, 0)`` from ``row`` on (records are the dataset's row dicts)."""
        if name not in self._shards:
            raise KeyError(f"no shard named {name!r} in this source")
        first, stop = self._shards[name]
        if stop < 0:
            shard = self._dataset.shard(num_shards=self._dataset.num_shards, index=first)
            for i, record in enumerate(itertools.islice(iter(shard), row, None), start=row):
                yield i, dict(record), 0
            return
        for lo in range(first + row, stop, 1024):
            batch = self._dataset[lo : min(lo + 1024, stop)]
            keys = list(batch)
            for j, values in enumerate(zip(*(batch[k] for k in keys))):
                yield lo - first + j, dict(zip(keys, values)), 0
