"""``data.format: preference_chat``: chosen/rejected conversation pairs (TRL's conversational preference format)."""

from __future__ import annotations

import dataclasses
from typing import TYPE_CHECKING, ClassVar

from ponente.datacache import BatchProcessor, CacheDataset, Dataset, PreferenceChatProcessor, PreferencePairDataset
from ponente.trainer.data.formats._base import LmDatasetFormat, check_field_name
from ponente.trainer.data.formats.chat import chat_template_of

if TYPE_CHECKING:
    from tokenizers import Tokenizer

    from ponente.trainer.data.tokens import TokenizerSpec

__all__ = ["PreferenceChatLmDatasetFormat"]


@LmDatasetFormat.register_subclass("preference_chat")
@dataclasses.dataclass(frozen=True)
class PreferenceChatLmDatasetFormat(LmDatasetFormat):
    """Preference pairs: each record holds a chosen and a rejected conversation (read by ``ponente-dpo``).

    A record is ``{"chosen": [messages], "rejected": [messages]}`` whose shared leading messages are the prompt,
    or ``{"prompt": [messages], "chosen": [message], "rejected": [message]}``. The scored tokens of a response are
    those TRL scores: the tokens of the chat template's rendering of ``prompt + [response]`` after those of
    ``prompt`` rendered with ``add_generation_prompt``. A row holds one pair (``chosen_input_ids``,
    ``chosen_loss_mask``, ``rejected_input_ids``, ``rejected_loss_mask``). Bad records (a missing field, a response
    whose last message is not the assistant's, chosen equal to rejected) go through ``data.bad_records``, named by
    file, row and field.

    Attributes:
        prompt_field: The record field of an explicit prompt (a list of messages; used when present).
        chosen_field: The record field of the preferred conversation or response.
        rejected_field: The record field of the dispreferred conversation or response.
        chat_template: The Jinja chat template (as for ``chat``; ``None``: the tokenizer folder's).
        truncation: A pair longer than the row: ``truncate`` (the prompt is cut from the left, down to half the
            row, then the responses at their end; counted and logged) or ``error`` (stop, naming the pair).

    Example:
        ```yaml
        data:
          train_urls: [package://ponente.trainer.assets/tiny_preferences.jsonl]
          format:
            type: preference_chat
            chat_template: package://ponente.trainer.assets/tiny_chat_template.jinja
        ```
    """

    has_loss_mask: ClassVar[bool] = False

    prompt_field: str = "prompt"
    chosen_field: str = "chosen"
    rejected_field: str = "rejected"
    chat_template: str | None = None
    truncation: str = "truncate"

    def __post_init__(self) -> None:
        """Raises ``ValueError`` naming the ``data.format`` key of an empty field name or an unknown truncation."""
        check_field_name(self, "prompt_field", "chosen_field", "rejected_field")
        if self.truncation not in ("truncate", "error"):
            raise ValueError(f"data.format.truncation: expected truncate or error, got {self.truncation!r}")
        if self.chosen_field == self.rejected_field:
            raise ValueError(f"data.format.rejected_field: the same field as chosen_field ({self.chosen_field!r})")

    def processor(self, tokens: TokenizerSpec, folder: str | None) -> BatchProcessor:
        """A `PreferenceChatProcessor` (the chat template resolved as for ``chat``).

        Raises:
            ValueError: naming ``data.format.chat_template`` if there is no template, or it cannot be read.
        """
        del folder  # no paths inside the records
        template, bos, eos = chat_template_of(tokens, self.chat_template)
        return PreferenceChatProcessor(
            tokens.tokenizer,
            chat_template=template,
            prompt_field=self.prompt_field,
            chosen_field=self.chosen_field,
            rejected_field=self.rejected_field,
            bos=bos,
            eos=eos,
            template_key="data.format.chat_template",
        )

    def rows(self, cache: CacheDataset, seq_len: int, tokenizer: Tokenizer) -> Dataset[dict]:
        """One pair per row of ``seq_len`` tokens (longer pairs as ``truncation`` says)."""
        del tokenizer
        return PreferencePairDataset(cache, seq_len, truncation=self.truncation, name=str(cache.location))
