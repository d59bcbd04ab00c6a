"""The base of the ``data.format`` configs: how the records of a corpus become tokens (cache) and rows (training)."""

from __future__ import annotations

import abc
from typing import TYPE_CHECKING, ClassVar

from ponente.trainer.config import Registrable

if TYPE_CHECKING:
    from tokenizers import Tokenizer

    from ponente.datacache import BatchProcessor, CacheDataset, Dataset
    from ponente.trainer.data.tokens import TokenizerSpec

__all__ = ["LmDatasetFormat", "check_field_name"]


def check_field_name(owner: object, *keys: str) -> None:
    """Raise ``ValueError`` naming ``data.format.<key>`` unless each of ``keys`` holds a non-empty string."""
    for key in keys:
        value = getattr(owner, key)
        if not isinstance(value, str) or not value:
            raise ValueError(f"data.format.{key}: expected a non-empty field name, got {value!r}")


class LmDatasetFormat(Registrable, abc.ABC):
    """How the records of a language-model corpus are read: ``data.format: {type: text | supervised | chat, ...}``.

    A format is a frozen dataclass registered under its ``type`` with only its own fields. It describes; the
    data builder (`ponente.trainer.data.build_datasets`) calls its two methods, which construct:

    - `processor`: the ``ponente.datacache`` processor that turns records into token arrays in the cache
      (its config is part of the cache fingerprint);
    - `rows`: the dataset of fixed-length training rows cut from such a cache.

    A new format is one new module: a dataclass subclass registered with
    ``@LmDatasetFormat.register_subclass("name")``, imported by ``ponente.trainer.data.formats``.
    """

    default_choice: ClassVar[str | None] = "text"
    has_loss_mask: ClassVar[bool] = True
    """Whether the rows carry ``loss_mask`` and ``position_ids`` (a mixture completes the rows of formats without)."""

    @property
    def txt_key(self) -> str:
        """The record key a plain-text (``.txt``) file's documents are put under."""
        return "text"

    @abc.abstractmethod
    def processor(self, tokens: TokenizerSpec, folder: str | None) -> BatchProcessor:
        """The datacache processor of this format for one split.

        Args:
            tokens: The data config's tokenizer and BOS/EOS policy.
            folder: The folder of the split's first file, which relative paths inside records resolve against
                (``asr``'s audio paths); None for a Hugging Face dataset.

        Raises:
            ValueError: naming the key (e.g. a template that cannot be read).
        """

    @abc.abstractmethod
    def rows(self, cache: CacheDataset, seq_len: int, tokenizer: Tokenizer) -> Dataset[dict]:
        """The rows of ``seq_len`` tokens cut from a cache built with `processor` (``tokenizer``: the data's, for
        formats that pad with one of its tokens)."""
