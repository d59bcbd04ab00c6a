"""``data.format: text``: documents under one record field, tokenized and cut into windows of ``seq_len`` tokens."""

from __future__ import annotations

import dataclasses
from typing import TYPE_CHECKING, ClassVar

from ponente.datacache import BatchProcessor, CacheDataset, Dataset, TokenizerProcessor, TokenSeqDataset
from ponente.trainer.data.formats._base import LmDatasetFormat, check_field_name

if TYPE_CHECKING:
    from tokenizers import Tokenizer

    from ponente.trainer.data.tokens import TokenizerSpec

__all__ = ["TextLmDatasetFormat"]


@LmDatasetFormat.register_subclass("text")
@dataclasses.dataclass(frozen=True)
class TextLmDatasetFormat(LmDatasetFormat):
    """Pre-training text: every token is a target; documents are packed into windows (Levanter's ``text``).

    Rows: ``{"input_ids": int32[seq_len], "segment_ids": int32[seq_len]}``. BOS/EOS follow
    ``data.enforce_bos``/``data.enforce_eos``.

    Attributes:
        text_key: The record field holding the document (also the key of ``.txt`` files' documents).

    Example:
        ```yaml
        data:
          format: {type: text, text_key: content}
        ```
    """

    has_loss_mask: ClassVar[bool] = False
    text_key: str = "text"

    def __post_init__(self) -> None:
        """Raises ``ValueError`` naming ``data.format.text_key`` if it is empty."""
        check_field_name(self, "text_key")

    @property
    def txt_key(self) -> str:
        """``text_key``: documents of ``.txt`` files are read into this field."""
        return self.text_key

    def processor(self, tokens: TokenizerSpec, folder: str | None) -> BatchProcessor:
        """A `TokenizerProcessor` of ``text_key`` with the BOS/EOS policy of ``tokens``."""
        del folder  # no paths inside the records
        eos = tokens.eos
        return TokenizerProcessor(tokens.tokenizer, text_key=self.text_key, bos=tokens.bos, eos=eos)

    def rows(self, cache: CacheDataset, seq_len: int, tokenizer: Tokenizer) -> Dataset[dict]:
        """Windows of ``seq_len`` tokens (`TokenSeqDataset`)."""
        del tokenizer
        return TokenSeqDataset(cache, seq_len)
