"""The one exception type of the configuration system."""

from __future__ import annotations

from ponente.datacache.errors import PonenteConfigError

__all__ = ["ConfigError"]


class ConfigError(PonenteConfigError):
    """A configuration the user wrote is invalid: an unknown key, a wrong type, a missing file or field.

    The message is one line that starts with the full dotted key (or the file) at fault, e.g.
    ``trainer.num_train_steps: expected int, got 'ten'``. It is a ``ValueError`` and a
    :class:`ponente.datacache.PonenteUserError`: the console scripts exit with status 2 on it.
    """

    def __init__(self, message: str) -> None:
        # one line whatever a key or value held: a line break in user input must not split the message
        super().__init__(message.replace("\r", "\\r").replace("\n", "\\n"))
