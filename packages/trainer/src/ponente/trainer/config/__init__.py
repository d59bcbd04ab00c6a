"""Configuration: frozen dataclasses read from YAML files and dotted command-line overrides.

A program declares its configuration as a tree of ``@dataclasses.dataclass(frozen=True)`` classes and
calls :func:`parse_config`::

    python -m ponente.trainer.main.train_lm --config_path gpt2_nano --trainer.num_train_steps 10

Format (compatible with Levanter's keys for the same concepts):

- Each YAML mapping fills one dataclass; keys are field names. A nested section merges over the
  field's default value, so ``model: {num_layers: 2}`` keeps the other fields of the default model.
- Polymorphic fields are typed by a family base (:class:`Registrable`, or ``ponente.models.LmConfig``);
  ``type:`` picks the class (``model.type: llama``, ``trainer.tracker.type: wandb``). Changing ``type``
  starts from the new class's defaults. Other registries plug in with :func:`register_family`.
- Moved keys: a class with a static ``upgrade_config_keys(items, path, read, base)`` rewrites older spellings
  before its keys are read (``data.messages_field`` -> ``data.format.messages_field``).
- Values: bool, int, float (``1e-3``), str, None, ``Literal``, ``Enum``, ``list``, ``tuple``, ``dict``,
  ``pathlib.Path``, ``datetime.timedelta`` (``"10m"``, ``"1h30m"``, ``"45s"``, ``"2d"``, or seconds), unions,
  and ``Any`` (kept as written, e.g. ``trainer.mp: p=f32,c=bfloat16``).
- Sources, later wins: ``--config_path A B`` (files or packaged configs by name, deep-merged; ``!include
  other.yaml`` works inside a file), then ``--a.b.c VALUE`` / ``--a.b.c=VALUE`` overrides (read as YAML).
- Errors are one :class:`ConfigError` line naming the dotted key, e.g.
  ``trainer.num_trian_steps: unknown key; did you mean num_train_steps?``.
"""

from ._cli import config_help, parse_config
from ._duration import format_duration, parse_duration
from ._encode import config_to_dict, config_to_yaml
from ._errors import ConfigError
from ._family import register_family
from ._registry import Registrable
from ._sources import load_config, packaged_config_names, read_config_file

__all__ = [
    "ConfigError",
    "Registrable",
    "config_help",
    "config_to_dict",
    "config_to_yaml",
    "format_duration",
    "load_config",
    "packaged_config_names",
    "parse_config",
    "parse_duration",
    "read_config_file",
    "register_family",
]
