"""Optimizers for ``ponente.trainer``: configs keyed by ``type``, learning-rate schedules, masks, skip-step.

``OptimizerConfig.get_choice_class(name)`` looks a type up: ``adam`` (AdamW), ``lion``, ``sophia-h``, ``muon``.
"""

from .adam import AdamConfig
from .config import OptimizerConfig
from .lion import LionConfig
from .metrics import NormMetricsState, optimizer_metrics, track_norms
from .muon import MuonConfig, MuonState, newton_schulz, orthogonalize_linear_update, scale_by_muon
from .schedule import LR_SCHEDULES, build_lr_schedule, frac_or_steps
from .skip_step import SkipStepState, skip_bad_steps
from .sophia import SophiaHConfig, SophiaHState, hutchinson_diagonal, scale_by_sophia_h
from .wd_mask import param_paths, weight_decay_mask

__all__ = [
    "LR_SCHEDULES",
    "AdamConfig",
    "LionConfig",
    "MuonConfig",
    "MuonState",
    "NormMetricsState",
    "OptimizerConfig",
    "SkipStepState",
    "SophiaHConfig",
    "SophiaHState",
    "build_lr_schedule",
    "frac_or_steps",
    "hutchinson_diagonal",
    "newton_schulz",
    "optimizer_metrics",
    "orthogonalize_linear_update",
    "param_paths",
    "scale_by_muon",
    "scale_by_sophia_h",
    "skip_bad_steps",
    "track_norms",
    "weight_decay_mask",
]
