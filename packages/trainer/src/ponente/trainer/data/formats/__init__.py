"""The ``data.format`` configs, registered by ``type``: ``text``, ``supervised``, ``chat``,
``preference_chat`` and ``asr`` (speech recognition).

A format says how a corpus's records become cached tokens and training rows, and holds only its own fields::

    data:
      train_urls: [chats.jsonl]
      format: {type: chat, messages_field: messages, chat_template: template.jinja}

``format: chat`` is short for ``format: {type: chat}``. The older flat spellings (``data.messages_field``,
``data.prompt_template``, ...) are read into ``data.format``. To add a format, write one module with a
registered `LmDatasetFormat` subclass and import it here.
"""

from ponente.trainer.data.formats._base import LmDatasetFormat
from ponente.trainer.data.formats.asr import AsrDatasetFormat
from ponente.trainer.data.formats.chat import ChatLmDatasetFormat
from ponente.trainer.data.formats.preference import PreferenceChatLmDatasetFormat
from ponente.trainer.data.formats.supervised import SupervisedLmDatasetFormat
from ponente.trainer.data.formats.text import TextLmDatasetFormat

__all__ = [
    "AsrDatasetFormat",
    "ChatLmDatasetFormat",
    "LmDatasetFormat",
    "PreferenceChatLmDatasetFormat",
    "SupervisedLmDatasetFormat",
    "TextLmDatasetFormat",
]
