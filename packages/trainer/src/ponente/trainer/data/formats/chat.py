"""``data.format: chat``: a list of ``{role, content}`` messages per record, rendered by a Jinja chat template."""

from __future__ import annotations

import dataclasses
from typing import TYPE_CHECKING

from ponente.datacache import BatchProcessor, CacheDataset, ChatProcessor, Dataset, PackedExampleDataset
from ponente.trainer.data.formats._base import LmDatasetFormat, check_field_name
from ponente.trainer.data.templates import read_template, tokenizer_chat_defaults
from ponente.trainer.data.tokens import BOS_CANDIDATES, EOS_CANDIDATES, maybe_special

if TYPE_CHECKING:
    from tokenizers import Tokenizer

    from ponente.trainer.data.tokens import TokenizerSpec

__all__ = ["ChatLmDatasetFormat", "chat_template_of"]


def chat_template_of(tokens: TokenizerSpec, chat_template: str | None) -> tuple[str, str | None, str | None]:
    """``(template, bos, eos)`` of a chat format: ``chat_template`` (text, a path or ``package://`` URL) or the
    tokenizer folder's, and the special tokens the template sees (``data.bos_token``/``data.eos_token``, else those
    of the tokenizer's ``tokenizer_config.json``, else the tokenizer's usual ones).

    Raises:
        ValueError: naming ``data.format.chat_template`` if there is no template, or it cannot be read.
    """
    tok = tokens.tokenizer
    defaults = tokenizer_chat_defaults(tokens.location)
    template = read_template(chat_template, "data.format.chat_template")
    if template is None:
        template = defaults.chat_template
    if template is None:
        raise ValueError(
            f"data.format.chat_template: not set, and the tokenizer {tokens.spec!r} has no chat template (no "
            "chat_template.jinja or tokenizer_config.json with a chat_template next to it); set "
            "data.format.chat_template to Jinja text or to a .jinja file"
        )
    bos = tokens.bos_token or defaults.bos_token or maybe_special(tok, BOS_CANDIDATES)
    eos = tokens.eos_token or defaults.eos_token or maybe_special(tok, EOS_CANDIDATES)
    return template, bos, eos


@LmDatasetFormat.register_subclass("chat")
@dataclasses.dataclass(frozen=True)
class ChatLmDatasetFormat(LmDatasetFormat):
    """Chat data: each record holds a conversation (Levanter's ``chat``).

    Rows as for ``supervised``; the targets are the assistant turns. The template writes its own special
    tokens (``data.enforce_*`` do not apply); its ``bos_token``/``eos_token`` variables are ``data.bos_token``/
    ``data.eos_token`` if set, else those of the tokenizer's ``tokenizer_config.json``, else the tokenizer's
    usual special tokens.

    Attributes:
        messages_field: The record field holding the messages.
        chat_template: The Jinja chat template: inline text, a path or ``package://`` URL of a ``.jinja`` file, or
            ``None``: the ``chat_template`` of the tokenizer's folder (``chat_template.jinja`` or
            ``tokenizer_config.json``).
        mask_inputs: Train on the assistant tokens only; ``False``: on every token.
        pack: Pack several whole conversations per row; ``False``: one per row, padded.

    Example:
        ```yaml
        data:
          format:
            type: chat
            messages_field: conversation
            chat_template: package://ponente.trainer.assets/tiny_chat_template.jinja
        ```
    """

    messages_field: str = "messages"
    chat_template: str | None = None
    mask_inputs: bool = True
    pack: bool = True

    def __post_init__(self) -> None:
        """Raises ``ValueError`` naming the ``data.format`` key of an empty field name or a non-bool flag."""
        check_field_name(self, "messages_field")
        for key in ("mask_inputs", "pack"):
            if not isinstance(getattr(self, key), bool):
                raise ValueError(f"data.format.{key}: expected true or false, got {getattr(self, key)!r}")

    def processor(self, tokens: TokenizerSpec, folder: str | None) -> BatchProcessor:
        """A `ChatProcessor` (reads the template and the tokenizer folder's chat defaults).

        Raises:
            ValueError: naming ``data.format.chat_template`` if there is no template, or it cannot be read.
        """
        del folder  # no paths inside the records
        template, bos, eos = chat_template_of(tokens, self.chat_template)
        return ChatProcessor(
            tokens.tokenizer,
            messages_field=self.messages_field,
            chat_template=template,
            mask_inputs=self.mask_inputs,
            bos=bos,
            eos=eos,
            template_key="data.format.chat_template",
        )

    def rows(self, cache: CacheDataset, seq_len: int, tokenizer: Tokenizer) -> Dataset[dict]:
        """Whole conversations packed into rows of ``seq_len`` tokens (one per row when ``pack`` is off)."""
        del tokenizer
        return PackedExampleDataset(cache, seq_len, pack=self.pack)
