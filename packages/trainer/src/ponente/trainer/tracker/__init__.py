"""Trackers: where a run's metrics, hyperparameters and records go (``json``, ``tensorboard``, ``wandb``, ``noop``).

Pick one in a config with ``trainer.tracker.type`` (a YAML list of trackers composes), create it with
:func:`init_trackers`, install it with :func:`set_global_tracker`, then :func:`log` (or :func:`jit_log`
inside ``jax.jit``). :func:`log_run_info` records the git commit, resolved config and ``pip freeze``.
"""

from ponente.trainer.tracker.json_tracker import JsonTracker, JsonTrackerConfig
from ponente.trainer.tracker.run_info import flatten_config, git_info, log_run_info, pip_freeze
from ponente.trainer.tracker.tensorboard import TensorboardConfig, TensorboardTracker
from ponente.trainer.tracker.tracker import (
    CompositeTracker,
    NoopConfig,
    NoopTracker,
    Tracker,
    TrackerConfig,
    current_tracker,
    init_trackers,
    jit_log,
    log,
    set_global_tracker,
    write_text_atomic,
)
from ponente.trainer.tracker.wandb import WandbConfig, WandbTracker

__all__ = [
    "CompositeTracker",
    "JsonTracker",
    "JsonTrackerConfig",
    "NoopConfig",
    "NoopTracker",
    "TensorboardConfig",
    "TensorboardTracker",
    "Tracker",
    "TrackerConfig",
    "WandbConfig",
    "WandbTracker",
    "current_tracker",
    "flatten_config",
    "git_info",
    "init_trackers",
    "jit_log",
    "log",
    "log_run_info",
    "pip_freeze",
    "set_global_tracker",
    "write_text_atomic",
]
