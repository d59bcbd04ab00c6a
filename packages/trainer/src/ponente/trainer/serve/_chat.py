"""The chat template of a served model: from ``--chat_template`` or the tokenizer's folder, rendered like in SFT."""

from __future__ import annotations

import os
from collections.abc import Mapping, Sequence
from typing import Any

__all__ = ["ChatTemplate"]


class ChatTemplate:
    """Renders chat messages into the prompt text the model continues (``add_generation_prompt=True``).

    The rendering is ``ponente.datacache.ChatProcessor``'s, the same as for chat fine-tuning data, so a model
    fine-tuned with ``ponente-sft`` is prompted exactly as it was trained.

    Args:
        tokenizer: the ``tokenizers.Tokenizer``.
        template: the Jinja text.
        bos: the template's ``bos_token``.
        eos: the template's ``eos_token``.
    """

    def __init__(self, tokenizer: Any, template: str, *, bos: str | None = None, eos: str | None = None) -> None:
        from ponente.datacache import ChatProcessor

        self.source = template
        self._processor = ChatProcessor(
            tokenizer, chat_template=template, bos=bos, eos=eos, template_key="chat_template"
        )

    @classmethod
    def load(
        cls, tokenizer: Any, folder: str | os.PathLike[str] | None, template: str | None = None
    ) -> ChatTemplate | None:
        """The template given, or the one saved next to the tokenizer; None if there is neither.

        Args:
            tokenizer: the ``tokenizers.Tokenizer``.
            folder: the tokenizer's folder (``chat_template.jinja`` or ``tokenizer_config.json``), or None.
            template: ``--chat_template``: Jinja text, or a ``.jinja`` file (path or ``package://`` URL).

        Returns:
            The template, or None (``/v1/chat/completions`` then answers 400).

        Raises:
            ValueError: naming ``chat_template`` if the file cannot be read or the template is not valid Jinja.
        """
        from ponente.trainer.data.templates import read_template, tokenizer_chat_defaults

        text = read_template(template, "chat_template")
        bos = eos = None
        if folder is not None and os.path.exists(folder):
            defaults = tokenizer_chat_defaults(folder)
            text = text if text is not None else defaults.chat_template
            bos, eos = defaults.bos_token, defaults.eos_token
        if text is None:
            return None
        vocab = tokenizer.get_vocab(with_added_tokens=True)
        return cls(tokenizer, text, bos=bos if bos in vocab else None, eos=eos if eos in vocab else None)

    def render(self, messages: Sequence[Mapping[str, str]]) -> str:
        """The prompt text: ``messages`` then the start of the assistant's turn.

        Raises:
            ValueError: if the template rejects the conversation (e.g. a role it does not know).
        """
        return self._processor.render(messages, add_generation_prompt=True)
