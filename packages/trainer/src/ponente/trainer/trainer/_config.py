"""What to train with: :class:`TrainerConfig` (batch sizes, steps, precision, parallelism, where things go)."""

from __future__ import annotations

import dataclasses
from typing import Any, Literal

from ..checkpoint import CheckpointerConfig
from ..distributed import DistributedConfig, RayConfig
from ..tracker import JsonTrackerConfig, TrackerConfig, WandbConfig
from ._quantization import QuantizationConfig

DEFAULT_CACHE_DIR = "~/.cache/ponente/jax"
"""The default ``TrainerConfig.compilation_cache_dir``."""


@dataclasses.dataclass(frozen=True)
class TrainerConfig:
    """How to train: batch sizes, steps, precision, parallelism. Keys follow Levanter's ``trainer:`` section.

    Attributes:
        seed: the root seed; the model key and the training key are split from ``PRNGKey(seed)``.
        mp: the ``jmp`` mixed-precision policy, e.g. ``"f32"`` or ``"p=f32,c=bfloat16"`` (parameters,
            compute, output dtypes).
        train_batch_size: examples per step (global, over all devices); -1 (Levanter's convention): one microbatch
            of ``per_device_parallelism`` examples per device, i.e. ``per_device_parallelism`` x the data-axis
            size (resolved when a run starts, see ``ponente.trainer.run.Run``).
        per_device_parallelism: examples per device per microbatch; -1 means
            ``train_batch_size / data-axis size`` (no accumulation). Smaller values accumulate gradients
            over ``train_batch_size / (per_device_parallelism * data-axis size)`` microbatches.
        per_device_eval_parallelism: examples per device per evaluation batch (-1: as for training).
        num_train_steps: the number of optimizer steps of the run.
        steps_per_eval: evaluate every this many steps.
        max_eval_batches: evaluate on at most this many batches (None: all).
        id: the run id (None: generated from the time and 6 random hex digits, e.g. ``20250101-120000-a1b2c3``;
            not reproducible, so set it to resume a run under the same name).
        model_axis_size: devices per model-parallel group (the ``model`` mesh axis); the rest form ``data``.
        expert_axis_size: devices per expert-parallel group (the ``expert`` mesh axis, default 1: none). The
            ``experts`` axis of a mixture of experts' weights is split over it (storage and compute) and its
            tokens travel to their experts by all-to-all (``moe_dispatch: auto`` picks ``expert_parallel``); for
            everything else it is one more data axis: the batch is split over ``(replica, data, expert)``. Must
            divide the device count and the model's ``num_experts``.
        context_axis_size: devices per context-parallel group (the ``context`` mesh axis, default 1: none). The
            ``position`` axis of activations is split over it (parameters are unaffected), in zig-zag order so that
            every device gets an equal share of the causal attention work; keys and values are gathered over it.
            The sequence length must divide by ``2 * context_axis_size``. See the "long context" page.
        replica_axis_size: devices per ``replica`` group (within a slice): the batch is split over
            ``(replica, data)``, while FSDP parameters are split over ``data`` only and copied across replicas.
        replica_dcn_axis_size: slices (or, on GPUs/CPUs, groups of processes) the ``replica`` axis spans over
            the data-center network; > 1 builds a hybrid mesh whose ``replica`` axis is
            ``replica_dcn_axis_size * replica_axis_size``.
        batch_axis: the logical name of the batch axis.
        fsdp_axis: logical axis (or axes) of parameters split over ``data`` (None: parameters replicated).
        tensor_parallel_axes: logical axes split over ``model`` in parameters and computation.
        axis_resources: extra compute mapping entries (logical -> mesh axis), overriding the defaults.
        parameter_axis_resources: extra parameter mapping entries, overriding the defaults.
        compilation_cache_dir: JAX's persistent compilation cache (None: leave JAX's setting alone).
        on_nonfinite_loss: what a step whose loss or gradient norm is NaN/Inf does. ``"skip"``: its update is not
            applied (parameters and optimizer state stay as they were; the step counter and the data position
            advance past the bad batch), the step is logged as an error and counted in ``train/skipped_steps``.
            ``"stop"``: the step is undone and :meth:`Trainer.train` raises :class:`NonFiniteLossError` naming
            the step; a run (``ponente-train``, ...) then saves a checkpoint of the last good state and exits 1.
        crash_on_nan: Levanter's spelling: ``true`` means ``on_nonfinite_loss: stop``, ``false`` means ``skip``
            (None: use ``on_nonfinite_loss``); when set, it replaces ``on_nonfinite_loss``.
        preemption_exit_code: the exit status of a run stopped by SIGTERM (or Ctrl-C) after it saved its
            checkpoint; 0 by default (a scheduler that restarts on failure should see success), e.g. 75 (EX_TEMPFAIL)
            for one that requeues on a non-zero status.
        progress_bar: show a tqdm progress bar (only when stderr is a terminal).
        tracker: where metrics go: one tracker config or a list of them (``type``: ``json``,
            ``tensorboard``, ``wandb``, ``noop``).
        wandb: Levanter's older spelling of ``tracker: {type: wandb, ...}`` (``project``, ``tags``, ...): when
            set, it replaces ``tracker``.
        checkpointer: where and when checkpoints are written (``base_path``, ``save_interval``, ``keep``).
        run_dir: where the run record goes (resolved config, ``pip freeze``, git SHA, versions);
            ``{run_id}`` is replaced by the run id (None: no run record files).
        load_checkpoint: resume from the run's latest checkpoint: None resumes when one exists, True
            requires one, False starts fresh.
        load_checkpoint_path: resume from this checkpoint (or run directory) instead of the run's own.
        initialize_from: start a new run from another run's checkpoint: its model weights only (a
            checkpoint or run directory); the step, optimizer state and data position start at zero.
        allow_config_change: resume even though a field that must stay fixed for bitwise resumption
            (data, tokenizer, seq_len, batch size, mesh, seed) differs from the checkpoint's config.
        quantization: run the model's matrix products in FP8 or int8 (``{fp8: true}`` or ``{int8: true}``, see
            :class:`QuantizationConfig`); None: in the compute dtype of ``mp``.
        profiler: trace steps with the JAX profiler into ``<run_dir>/profile`` and log a summary of where the time
            went (see :mod:`ponente.trainer.profiler`).
        profiler_start_step: the steps run before the trace starts (compilation and warm-up).
        profiler_num_steps: how many steps are traced.
        profiler_perfetto_link: serve the Perfetto trace and log a link to it (the run waits until it is opened).
        distributed: how this process joins a multi-host run (``jax.distributed``; detected on SLURM).
        ray: the Ray cluster that builds data caches with ``data.backend: ray``.
    """

    seed: int = 0
    mp: str = "f32"
    train_batch_size: int = 512
    per_device_parallelism: int = -1
    per_device_eval_parallelism: int = -1
    num_train_steps: int = 400_000
    steps_per_eval: int = 1000
    max_eval_batches: int | None = None
    id: str | None = None

    model_axis_size: int = 1
    expert_axis_size: int = 1
    context_axis_size: int = 1
    replica_axis_size: int = 1
    replica_dcn_axis_size: int = 1
    batch_axis: str = "batch"
    fsdp_axis: str | list[str] | None = "embed"
    tensor_parallel_axes: list[str] | None = None
    axis_resources: dict[str, str] = dataclasses.field(default_factory=dict)
    parameter_axis_resources: dict[str, str] = dataclasses.field(default_factory=dict)

    compilation_cache_dir: str | None = DEFAULT_CACHE_DIR
    on_nonfinite_loss: Literal["skip", "stop"] = "skip"
    crash_on_nan: bool | None = None
    preemption_exit_code: int = 0
    progress_bar: bool = True

    tracker: TrackerConfig | tuple[TrackerConfig, ...] = dataclasses.field(default_factory=JsonTrackerConfig)
    wandb: WandbConfig | None = None
    checkpointer: CheckpointerConfig = dataclasses.field(default_factory=CheckpointerConfig)
    run_dir: str | None = "logs/{run_id}"
    load_checkpoint: bool | None = None
    load_checkpoint_path: str | None = None
    initialize_from: str | None = None
    allow_config_change: bool = False
    quantization: QuantizationConfig | None = None
    profiler: bool = False
    profiler_start_step: int = 5
    profiler_num_steps: int = 100
    profiler_perfetto_link: bool = False
    distributed: DistributedConfig = dataclasses.field(default_factory=DistributedConfig)
    ray: RayConfig = dataclasses.field(default_factory=RayConfig)

    def __post_init__(self) -> None:
        if self.wandb is not None:  # the frozen config holds one spelling: the tracker
            object.__setattr__(self, "tracker", self.wandb)
            object.__setattr__(self, "wandb", None)
        if self.crash_on_nan is not None:  # the frozen config holds one spelling: on_nonfinite_loss
            object.__setattr__(self, "on_nonfinite_loss", "stop" if self.crash_on_nan else "skip")
            object.__setattr__(self, "crash_on_nan", None)
        if self.on_nonfinite_loss not in ("skip", "stop"):
            raise ValueError(f"trainer.on_nonfinite_loss must be 'skip' or 'stop', got {self.on_nonfinite_loss!r}")
        if self.profiler_start_step < 0 or self.profiler_num_steps < 1:
            key = "profiler_start_step" if self.profiler_start_step < 0 else "profiler_num_steps"
            raise ValueError(f"trainer.{key}: expected a start step >= 0 and >= 1 steps, got {getattr(self, key)}")
        if not 0 <= self.preemption_exit_code <= 255:
            raise ValueError(f"trainer.preemption_exit_code must be in 0..255, got {self.preemption_exit_code}")
        if self.train_batch_size == -1 and self.per_device_parallelism == -1:
            raise ValueError("trainer.train_batch_size: -1 needs trainer.per_device_parallelism (examples per device)")
        positive = {
            "train_batch_size": 1 if self.train_batch_size == -1 else self.train_batch_size,
            "num_train_steps": self.num_train_steps,
            "steps_per_eval": self.steps_per_eval,
            "model_axis_size": self.model_axis_size,
            "expert_axis_size": self.expert_axis_size,
            "context_axis_size": self.context_axis_size,
            "replica_axis_size": self.replica_axis_size,
            "replica_dcn_axis_size": self.replica_dcn_axis_size,
        }
        for name, value in positive.items():
            if value < 1:
                raise ValueError(f"trainer.{name} must be >= 1, got {value}")
        for name in ("per_device_parallelism", "per_device_eval_parallelism"):
            value = getattr(self, name)
            if value != -1 and value < 1:
                raise ValueError(f"trainer.{name} must be -1 (automatic) or >= 1, got {value}")
        if self.max_eval_batches is not None and self.max_eval_batches < 1:
            raise ValueError(f"trainer.max_eval_batches must be None or >= 1, got {self.max_eval_batches}")

    @property
    def compute_axis_mapping(self) -> dict[str, Any]:
        """Logical -> mesh axes when computing: batch over ``(replica, data)`` (and ``expert``), ``experts`` on
        ``expert`` (when ``expert_axis_size > 1``), ``position`` on ``context`` (when ``context_axis_size > 1``),
        tensor-parallel axes on ``model``."""
        mapping: dict[str, Any] = {self.batch_axis: ("replica", "data")}
        if self.expert_axis_size > 1:
            mapping = {self.batch_axis: ("replica", "data", "expert"), "experts": "expert"}
        if self.context_axis_size > 1:
            mapping["position"] = "context"
        mapping.update(dict.fromkeys(self.tensor_parallel_axes or (), "model"))
        mapping.update(self.axis_resources)
        return mapping

    @property
    def parameter_axis_mapping(self) -> dict[str, Any]:
        """Logical -> mesh axes of stored parameters: ``fsdp_axis`` over ``data``, ``experts`` over ``expert`` (when
        ``expert_axis_size > 1``), tensor-parallel axes over ``model``.

        Returns:
            The mapping (``parameter_axis_resources`` entries override the defaults).
        """
        fsdp = [self.fsdp_axis] if isinstance(self.fsdp_axis, str) else list(self.fsdp_axis or ())
        mapping: dict[str, Any] = dict.fromkeys(fsdp, "data")
        if self.expert_axis_size > 1:
            mapping["experts"] = "expert"
        mapping.update(dict.fromkeys(self.tensor_parallel_axes or (), "model"))
        mapping.update(self.parameter_axis_resources)
        return mapping
