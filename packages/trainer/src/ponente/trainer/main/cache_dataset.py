"""Build the datacache caches of a data config ahead of training: ``python -m ponente.trainer.main.cache_dataset``.

Takes the same ``data:`` section as ``train_lm`` (a single dataset or a mixture); a training config file is
accepted as it is (its other sections, ``model``, ``trainer``, ..., are ignored), e.g.::

    python -m ponente.trainer.main.cache_dataset --config_path gpt2_nano
    python -m ponente.trainer.main.cache_dataset --data.train_urls '[corpus/*.jsonl.gz]' \\
        --data.tokenizer tokenizer.json --data.cache_dir /data/cache

Each split with a source is built (or resumed, or verified and left alone when finished) in the calling
process; the training run then opens the finished caches at once.
"""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Sequence

from ponente.datacache import CacheDataset
from ponente.trainer.data import LMDatasetConfig, LMMixtureDatasetConfig, build_all_caches
from ponente.trainer.run import check_inputs, parse_run_command_line, run_cli

__all__ = ["CacheDatasetConfig", "cache_dataset", "main"]

logger = logging.getLogger(__name__)


@dataclasses.dataclass(frozen=True)
class CacheDatasetConfig:
    """Configuration of the ``cache_dataset`` entry point.

    Attributes:
        data: The data config whose caches to build (a single dataset or a mixture).
        progress: Show progress bars.
    """

    data: LMDatasetConfig | LMMixtureDatasetConfig = dataclasses.field(default_factory=LMDatasetConfig)
    progress: bool = True


def cache_dataset(config: CacheDatasetConfig) -> dict[str, CacheDataset]:
    """Build every cache of ``config.data`` in this process.

    Args:
        config: What to build.

    Returns:
        The finished caches, by split (``"train"``) or, for a mixture, by ``"<component>/<split>"``.

    Raises:
        ValueError: If the config has no training or validation source at all.
    """
    caches = build_all_caches(config.data, progress=config.progress)
    if not caches:
        raise ValueError("data: nothing to cache; set data.train_urls / data.validation_urls or data.id")
    return caches


def _training_keys() -> set[str]:
    # the top-level keys of a training file (train_lm, sft, lora_lm) that this tool ignores: it reads data: only
    from ponente.trainer.main.lora_lm import LoraLmConfig
    from ponente.trainer.main.sft import SftConfig  # a TrainLmConfig with more keys

    return {name for cls in (SftConfig, LoraLmConfig) for name in cls.__dataclass_fields__}


def main(argv: Sequence[str] | None = None) -> int:
    """Parse the command line, build the caches and print where they are; returns the exit code.

    Errors print one line ``error: <message>`` on stderr (exit status 2 for a configuration error, 1 for another;
    ``--debug`` adds the traceback).
    """

    def run_main(args: list[str]) -> int:
        config = parse_run_command_line(
            CacheDatasetConfig, args, prog="ponente-cache-dataset", training_keys=_training_keys(), required=()
        )
        check_inputs(config)
        for name, cache in cache_dataset(config).items():
            ledger = cache.ledger
            tokens = ledger.lengths.get("input_ids", 0)
            print(f"{name}: {cache.location} ({ledger.rows} documents, {tokens} tokens)")
        return 0

    return run_cli(run_main, argv)


if __name__ == "__main__":
    raise SystemExit(main())
