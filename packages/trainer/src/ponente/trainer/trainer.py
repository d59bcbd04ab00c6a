"""The training loop: :class:`TrainerConfig` and :class:`Trainer` (jitted step, accumulation, metrics, hooks).

A :class:`Trainer` owns the device mesh and the two axis mappings (parameters are stored by one,
computation runs by the other), compiles one training step with ``named_jit`` and runs it in a loop
that measures throughput, calls hooks and stops cleanly on Ctrl-C. The model, the loss and the
optimizer come from the caller, so the loop knows nothing about language models or trackers.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import logging
import math
import os
import secrets
import signal
import sys
import threading
import time
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from typing import Any

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import optax

import ponente.namedtensor as hax
from ponente.namedtensor import NamedArray
from ponente.namedtensor.partitioning import ResourceMapping, make_mesh, named_jit

from .callbacks import Hook, StepInfo, as_hook
from .checkpoint import CheckpointerConfig
from .distributed import DistributedConfig, RayConfig
from .mfu import device_peak_flops
from .mfu import mfu as _mfu
from .state import FilterTree, TrainerState, init_state
from .tracker import JsonTrackerConfig, TrackerConfig

__all__ = ["LossFn", "NonFiniteLossError", "Trainer", "TrainerConfig"]

logger = logging.getLogger(__name__)

LossFn = Callable[..., Any]
"""``loss_fn(model, batch, *, key) -> scalar``: the mean loss of ``model`` on ``batch`` (a scalar array or
scalar NamedArray), or ``(loss, {name: scalar})`` to also log extra per-step metrics (e.g. a MoE router's
auxiliary loss, logged as ``train/<name>``). With gradient accumulation, each microbatch's loss and
metrics are weighted by its number of loss tokens (see :class:`Trainer`)."""

_DEFAULT_CACHE_DIR = "~/.cache/ponente/jax"


@dataclasses.dataclass(frozen=True)
class TrainerConfig:
    """How to train: batch sizes, steps, precision, parallelism. Keys follow Levanter's ``trainer:`` section.

    Attributes:
        seed: the root seed; the model key and the training key are split from ``PRNGKey(seed)``.
        mp: the ``jmp`` mixed-precision policy, e.g. ``"f32"`` or ``"p=f32,c=bfloat16"`` (parameters,
            compute, output dtypes).
        train_batch_size: examples per step (global, over all devices).
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
        crash_on_nan: raise :class:`NonFiniteLossError` on a NaN/Inf loss or gradient norm (else log it).
        progress_bar: show a tqdm progress bar (only when stderr is a terminal).
        tracker: where metrics go: one tracker config or a list of them (``type``: ``json``,
            ``tensorboard``, ``wandb``, ``noop``).
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
    replica_axis_size: int = 1
    replica_dcn_axis_size: int = 1
    batch_axis: str = "batch"
    fsdp_axis: str | list[str] | None = "embed"
    tensor_parallel_axes: list[str] | None = None
    axis_resources: dict[str, str] = dataclasses.field(default_factory=dict)
    parameter_axis_resources: dict[str, str] = dataclasses.field(default_factory=dict)

    compilation_cache_dir: str | None = _DEFAULT_CACHE_DIR
    crash_on_nan: bool = True
    progress_bar: bool = True

    tracker: TrackerConfig | tuple[TrackerConfig, ...] = dataclasses.field(default_factory=JsonTrackerConfig)
    checkpointer: CheckpointerConfig = dataclasses.field(default_factory=CheckpointerConfig)
    run_dir: str | None = "logs/{run_id}"
    load_checkpoint: bool | None = None
    load_checkpoint_path: str | None = None
    initialize_from: str | None = None
    allow_config_change: bool = False
    distributed: DistributedConfig = dataclasses.field(default_factory=DistributedConfig)
    ray: RayConfig = dataclasses.field(default_factory=RayConfig)

    def __post_init__(self) -> None:
        positive = {
            "train_batch_size": self.train_batch_size,
            "num_train_steps": self.num_train_steps,
            "steps_per_eval": self.steps_per_eval,
            "model_axis_size": self.model_axis_size,
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
        """Logical -> mesh axes when computing: batch over ``(replica, data)``, tensor-parallel axes on ``model``."""
        mapping: dict[str, Any] = {self.batch_axis: ("replica", "data")}
        mapping.update(dict.fromkeys(self.tensor_parallel_axes or (), "model"))
        mapping.update(self.axis_resources)
        return mapping

    @property
    def parameter_axis_mapping(self) -> dict[str, Any]:
        """Logical -> mesh axes of stored parameters: ``fsdp_axis`` over ``data``, tensor-parallel axes over ``model``.

        Returns:
            The mapping (``parameter_axis_resources`` entries override the defaults).
        """
        fsdp = [self.fsdp_axis] if isinstance(self.fsdp_axis, str) else list(self.fsdp_axis or ())
        mapping: dict[str, Any] = dict.fromkeys(fsdp, "data")
        mapping.update(dict.fromkeys(self.tensor_parallel_axes or (), "model"))
        mapping.update(self.parameter_axis_resources)
        return mapping


def _build_mesh(config: TrainerConfig, devices: list[Any]) -> jax.sharding.Mesh:
    """The ``(replica, data, model)`` mesh over ``devices``; hybrid (ICI x DCN) when ``replica_dcn_axis_size > 1``."""
    model, replica, dcn = config.model_axis_size, config.replica_axis_size, config.replica_dcn_axis_size
    per_group = model * replica * dcn
    if len(devices) % per_group != 0:
        raise ValueError(
            f"trainer.model_axis_size={model} x replica_axis_size={replica} x replica_dcn_axis_size={dcn} "
            f"= {per_group} does not divide the {len(devices)} devices"
            if per_group != model
            else f"trainer.model_axis_size={model} does not divide the {len(devices)} devices"
        )
    if dcn == 1:
        return make_mesh({"replica": replica, "data": -1, "model": model}, devices=devices)
    grid = _hybrid_device_grid(config, devices)
    return jax.sharding.Mesh(grid, ("replica", "data", "model"), axis_types=(jax.sharding.AxisType.Auto,) * 3)


def _hybrid_device_grid(config: TrainerConfig, devices: list[Any]) -> np.ndarray:
    """The devices of a hybrid mesh as a ``(replica_dcn * replica, data, model)`` array.

    The granules of the data-center network are the slices (``device.slice_index``, TPU multi-slice) when
    the devices come from ``replica_dcn_axis_size`` different slices, else the processes (GPUs, CPUs).
    Granule ``k`` (in increasing slice / process index) fills rows ``k * replica .. (k + 1) * replica - 1``
    of the ``replica`` axis, so only the ``replica`` axis crosses the slower network.
    """
    from jax.experimental import mesh_utils

    model, replica, dcn = config.model_axis_size, config.replica_axis_size, config.replica_dcn_axis_size
    data = len(devices) // (model * replica * dcn)
    slices = {getattr(d, "slice_index", None) for d in devices}
    by_process = None in slices or len(slices) != dcn
    logger.info("hybrid mesh: %d %s along the replica axis", dcn, "process groups" if by_process else "slices")
    try:
        grid: np.ndarray = mesh_utils.create_hybrid_device_mesh(
            (replica, data, model), (dcn, 1, 1), devices, process_is_granule=by_process
        )
    except (ValueError, AssertionError) as e:
        raise ValueError(
            f"trainer.replica_dcn_axis_size={dcn}: cannot lay out a hybrid mesh of {dcn} slices/process groups x "
            f"(replica={replica}, data={data}, model={model}) over {len(devices)} devices: {e}"
        ) from e
    return grid


class NonFiniteLossError(FloatingPointError):
    """The loss or the gradient norm of a step is NaN or infinite (see ``TrainerConfig.crash_on_nan``)."""


def _generate_run_id() -> str:
    return time.strftime("%Y%m%d-%H%M%S", time.gmtime()) + "-" + secrets.token_hex(3)


def _enable_compilation_cache(path: str) -> None:
    """Point JAX's persistent compilation cache at ``path`` unless the user configured one already."""
    if getattr(jax.config, "jax_compilation_cache_dir", None):
        return
    resolved = os.path.expanduser(path)
    os.makedirs(resolved, exist_ok=True)
    jax.config.update("jax_compilation_cache_dir", resolved)
    # cache every compilation that takes noticeable time, so a warm start skips all of them
    jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.2)
    logger.info("JAX persistent compilation cache: %s", resolved)


def _init_compiler_options(mesh: jax.sharding.Mesh) -> dict[str, Any]:
    """XLA options of the program that builds the initial state.

    That program runs once and only draws random numbers and zeros. On CPU, LLVM's optimization of its
    threefry kernels costs seconds of compilation for milliseconds of run time (about 5 s against 1 s for
    the hello world), so it is compiled unoptimized there. The options are part of the compilation (and
    persistent cache) key, so every run of a configuration still gets the same initial bits.
    """
    if mesh.devices.flat[0].platform == "cpu":
        return {"xla_backend_optimization_level": 0}
    return {}


def _scalar(x: Any) -> jax.Array:
    array = x.array if isinstance(x, NamedArray) else jnp.asarray(x)
    if array.ndim != 0:
        raise ValueError(f"loss_fn must return a scalar, got an array of shape {array.shape}")
    return array.astype(jnp.float32)


def _loss_and_metrics(out: Any) -> tuple[jax.Array, dict[str, jax.Array]]:
    """A loss function's result: a scalar, or ``(scalar, {name: scalar})`` with extra metrics to log."""
    if isinstance(out, tuple) and len(out) == 2 and isinstance(out[1], Mapping):
        return _scalar(out[0]), {str(k): _scalar(v) for k, v in out[1].items()}
    return _scalar(out), {}


def _is_named(x: Any) -> bool:
    return isinstance(x, NamedArray)


def _leaves(batch: Any) -> list[Any]:
    return jax.tree_util.tree_leaves(batch, is_leaf=_is_named)


def _batch_size_of(leaf: Any, batch_axis: str) -> int | None:
    if isinstance(leaf, NamedArray):
        return leaf.resolve_axis(batch_axis).size if leaf.has_axis(batch_axis) else None
    return int(np.shape(leaf)[0]) if np.ndim(leaf) > 0 else None


def default_loss_weight(batch: Any, batch_axis: str = "batch") -> jax.Array:
    """How much a microbatch counts when gradients are accumulated: its number of loss tokens.

    Uses ``batch.loss_mask`` (e.g. an ``LmExample``) or ``batch["loss_mask"]`` if present (the sum of the
    mask), else the number of examples along ``batch_axis``. Accumulating ``weight * grad(mean loss)`` and
    dividing by the total weight then gives exactly the gradient of the full batch's mean loss.

    Args:
        batch: the microbatch.
        batch_axis: the name of the batch axis.

    Returns:
        A float32 scalar.

    Raises:
        ValueError: if there is no loss mask and no leaf has the batch axis.
    """
    mask = batch.get("loss_mask") if isinstance(batch, Mapping) else getattr(batch, "loss_mask", None)
    if mask is not None:
        raw = mask.array if isinstance(mask, NamedArray) else jnp.asarray(mask)
        return jnp.sum(raw.astype(jnp.float32))
    for leaf in _leaves(batch):
        size = _batch_size_of(leaf, batch_axis)
        if size is not None:
            return jnp.asarray(size, dtype=jnp.float32)
    raise ValueError(f"cannot weight a microbatch: it has no loss_mask and no leaf with axis {batch_axis!r}")


def _renamed(x: jax.Array, *, axes: tuple[Any, ...], index: int) -> NamedArray:
    return hax.named(jnp.moveaxis(x, 0, index), axes)


def _identity(x: Any) -> Any:
    return x


def _constant(value: Any, _: Any) -> Any:
    return value


def _split_microbatches(batch: Any, batch_axis: str, num_micro: int) -> tuple[Any, Callable[[Any], Any]]:
    """Stack ``batch`` into ``num_micro`` microbatches along a new leading axis.

    Microbatch ``j`` holds examples ``j, j + n, j + 2n, ...`` (n = ``num_micro``): with the batch split
    over devices in contiguous blocks, every microbatch then keeps the same share of each device's
    examples, so no data moves between devices. Returns the stacked arrays and a function that turns
    one slice of them back into a batch. Leaves without the batch axis are shared by all microbatches.
    """
    leaves, treedef = jax.tree_util.tree_flatten(batch, is_leaf=_is_named)
    stacked: list[Any] = []
    rebuild: list[Callable[[Any], Any]] = []
    for leaf in leaves:
        if isinstance(leaf, NamedArray) and leaf.has_axis(batch_axis):
            index = leaf.axis_indices(batch_axis)
            Micro = leaf.axes[index].resize(leaf.axes[index].size // num_micro)
            axes = (*leaf.axes[:index], Micro, *leaf.axes[index + 1 :])
            moved = jnp.moveaxis(leaf.array, index, 0)
            per = moved.reshape((Micro.size, num_micro, *moved.shape[1:])).swapaxes(0, 1)
            stacked.append(per)
            rebuild.append(functools.partial(_renamed, axes=axes, index=index))
        elif not isinstance(leaf, NamedArray) and np.ndim(leaf) > 0:
            arr = jnp.asarray(leaf)
            per = arr.reshape((arr.shape[0] // num_micro, num_micro, *arr.shape[1:])).swapaxes(0, 1)
            stacked.append(per)
            rebuild.append(_identity)
        else:
            stacked.append(None)
            rebuild.append(functools.partial(_constant, leaf))

    def unstack(slices: list[Any]) -> Any:
        return jax.tree_util.tree_unflatten(treedef, [f(s) for f, s in zip(rebuild, slices)])

    return stacked, unstack


def _check_batch(batch: Any, batch_axis: str, expected: int) -> None:
    for leaf in _leaves(batch):
        size = _batch_size_of(leaf, batch_axis)
        if size is not None and size != expected:
            raise ValueError(
                f"batch has {size} examples along axis {batch_axis!r}, but trainer.train_batch_size is {expected}"
            )


def _tokens_in(batch: Any) -> int:
    """Tokens of a batch: the size of its first array (e.g. ``LmExample.tokens`` of shape batch x position)."""
    leaves = _leaves(batch)
    if not leaves:
        return 0
    first = leaves[0]
    return int(first.size if isinstance(first, NamedArray) else np.size(first))


class _ByIdentity:
    """A static argument compared by identity (a filter tree may hold unhashable or array-like nodes)."""

    def __init__(self, value: Any):
        self.value = value

    def __hash__(self) -> int:
        return id(self.value)

    def __eq__(self, other: object) -> bool:
        return isinstance(other, _ByIdentity) and other.value is self.value


@dataclasses.dataclass(frozen=True)
class _BatchLayout:
    """The static part of a batch: its tree structure and the axes of each NamedArray leaf."""

    treedef: Any
    axes: tuple[Any, ...]

    @staticmethod
    def strip(batch: Any) -> tuple[list[Any], _BatchLayout]:
        leaves, treedef = jax.tree_util.tree_flatten(batch, is_leaf=_is_named)
        arrays = [leaf.array if isinstance(leaf, NamedArray) else leaf for leaf in leaves]
        axes = tuple(leaf.axes if isinstance(leaf, NamedArray) else None for leaf in leaves)
        return arrays, _BatchLayout(treedef, axes)

    def restore(self, arrays: Sequence[Any]) -> Any:
        leaves = [a if axes is None else hax.named(a, axes) for a, axes in zip(arrays, self.axes)]
        return jax.tree_util.tree_unflatten(self.treedef, leaves)


class Trainer:
    """Runs training: builds the sharded state, compiles the step, loops over batches.

    The step computes the mean loss over the batch and its gradient, in microbatches when
    ``per_device_parallelism`` is smaller than the per-device batch: each microbatch's gradient is
    weighted by its number of loss tokens (``loss_weight_fn``), so accumulation equals the full batch.
    The model is cast to the compute dtype of the ``mp`` policy inside the step (parameters and
    gradients stay in the parameter dtype; the loss is float32). Gradient checkpointing is a model
    setting (``LmConfig.gradient_checkpointing``), not a trainer one.

    Args:
        config: the trainer configuration.
        optimizer: the optax transformation; plain transformations are wrapped to accept the extra
            arguments ``loss``, ``obj_fn`` and ``key`` that the step passes to ``update``.
        loss_fn: ``loss_fn(model, batch, *, key) -> scalar`` (see :data:`LossFn`).
        lr_schedule: the learning-rate schedule, for the ``learning_rate`` metric (None: read an
            ``inject_hyperparams`` learning rate from the optimizer state if there is one).
        hooks: hooks (or functions of a :class:`StepInfo`) to call during :meth:`train`.
        log_fn: ``log_fn(metrics, step)`` called after every step with the step's metrics (a tracker's log).
        flops_per_token: forward FLOPs per token of the model, for MFU (None: no MFU).
        loss_weight_fn: weight of a microbatch (default: :func:`default_loss_weight`).
        devices: the devices to use (default: all of ``jax.devices()``).
        optimizer_metrics_fn: metrics read from the new optimizer state, added to the step's metrics
            (default: ``ponente.trainer.optim.optimizer_metrics``: ``optim/grad_norm``, ``optim/update_norm``,
            injected hyperparameters, ...).

    Raises:
        ValueError: if the devices do not divide into ``model_axis_size`` groups, the batch does not divide
            over the data axis and ``per_device_parallelism``, or ``mp`` is not a jmp policy.

    Example:
        >>> import optax, jax.numpy as jnp
        >>> cfg = TrainerConfig(train_batch_size=4, num_train_steps=2, compilation_cache_dir=None)
        >>> trainer = Trainer(cfg, optax.sgd(0.1), lambda model, batch, *, key: jnp.mean((batch - model) ** 2))
        >>> state = trainer.initial_state(lambda key: jnp.zeros(()), key=jax.random.PRNGKey(0))
        >>> state, metrics = trainer.train_step(state, jnp.ones(4))
        >>> round(float(metrics["loss"]), 3), int(state.step)
        (1.0, 1)
    """

    def __init__(
        self,
        config: TrainerConfig,
        optimizer: optax.GradientTransformation,
        loss_fn: LossFn,
        *,
        lr_schedule: optax.Schedule | None = None,
        hooks: Sequence[Hook | Callable[[StepInfo], Any]] = (),
        log_fn: Callable[[dict[str, float], int], Any] | None = None,
        flops_per_token: float | None = None,
        loss_weight_fn: Callable[[Any], Any] | None = None,
        devices: Sequence[Any] | None = None,
        optimizer_metrics_fn: Callable[[Any], Mapping[str, Any]] | None = None,
    ):
        import jmp

        if optimizer_metrics_fn is None:
            from .optim import optimizer_metrics

            optimizer_metrics_fn = optimizer_metrics

        self.config = config
        self.optimizer = optax.with_extra_args_support(optimizer)
        self.loss_fn = loss_fn
        self.lr_schedule = lr_schedule
        self.hooks = [as_hook(h) for h in hooks]
        self.log_fn = log_fn
        self.flops_per_token = flops_per_token
        self.optimizer_metrics_fn: Callable[[Any], Mapping[str, Any]] = optimizer_metrics_fn
        self.loss_weight_fn = loss_weight_fn or (lambda b: default_loss_weight(b, config.batch_axis))
        self.run_id = config.id if config.id is not None else _generate_run_id()
        try:
            self.mp = jmp.get_policy(config.mp)
        except ValueError as e:
            raise ValueError(f"trainer.mp: {config.mp!r} is not a jmp policy such as 'p=f32,c=bfloat16': {e}") from e
        if config.compilation_cache_dir:
            _enable_compilation_cache(config.compilation_cache_dir)

        self.mesh = _build_mesh(config, list(jax.devices() if devices is None else devices))
        self.data_axis_size = self.mesh.shape["replica"] * self.mesh.shape["data"]
        """Shards of the batch: the sizes of the ``replica`` and ``data`` mesh axes multiplied."""
        self.num_microbatches = self._microbatches(config.train_batch_size, config.per_device_parallelism, "train")
        self.compute_axis_mapping: ResourceMapping = config.compute_axis_mapping
        self.parameter_axis_mapping: ResourceMapping = config.parameter_axis_mapping
        # The state enters and leaves by the parameter mapping. The batch is passed as plain arrays plus its
        # (static) axes, so that named_jit does not constrain it by that mapping; the step shards it by the
        # compute mapping instead.
        self._step = named_jit(
            self._train_step,
            self.compute_axis_mapping,
            in_axis_resources=self.parameter_axis_mapping,
            out_axis_resources=self.parameter_axis_mapping,
            donate_args=(True, False, False),
        )
        self._eval = named_jit(
            self._eval_step, self.compute_axis_mapping, in_axis_resources=self.parameter_axis_mapping
        )
        # compiled once per (model_init, is_trainable): both are static arguments
        self._init = named_jit(
            self._build_state, self.parameter_axis_mapping, compiler_options=_init_compiler_options(self.mesh)
        )
        self._stop_reason: str | None = None
        self.last_stop_reason: str | None = None
        """Why the last :meth:`train` call stopped early (e.g. ``"SIGINT"``), or None if it ran to the end."""

    def _microbatches(self, batch_size: int, per_device: int, what: str) -> int:
        data = self.data_axis_size
        if batch_size % data != 0:
            raise ValueError(
                f"trainer.train_batch_size={batch_size} is not divisible by the data axis size {data} "
                f"({self.mesh.size} devices / model_axis_size {self.config.model_axis_size}; the batch is split "
                "over the replica and data mesh axes)"
            )
        if per_device == -1:
            return 1
        micro = per_device * data
        if batch_size % micro != 0:
            key = "per_device_parallelism" if what == "train" else "per_device_eval_parallelism"
            raise ValueError(
                f"trainer.train_batch_size={batch_size} is not divisible by the microbatch size "
                f"trainer.{key}={per_device} x data axis size {data} = {micro}"
            )
        return batch_size // micro

    # -- mesh --------------------------------------------------------------------------------------
    @contextlib.contextmanager
    def _on_mesh(self) -> Iterator[None]:
        with jax.set_mesh(self.mesh):
            yield

    def process_batch_rows(self, batch_size: int | None = None) -> slice:
        """The rows of every global batch that this process loads: those of its addressable devices.

        With one process this is the whole batch. With several, each process reads only the examples that
        land on its own devices along the batch axis (e.g. the second half of the batch for process 1 of 2
        when the batch is split over all devices); pass them to ``DataLoader(rows=...)``.

        Args:
            batch_size: the global batch size (default: ``train_batch_size``).

        Returns:
            A slice of ``range(batch_size)``.

        Raises:
            ValueError: if this process's rows are not one contiguous block (a mesh whose device order
                interleaves processes along the batch axis).
        """
        size = self.config.train_batch_size if batch_size is None else batch_size
        sharding = hax.partitioning.sharding_for_axis([self.config.batch_axis], self.compute_axis_mapping, self.mesh)
        starts: set[int] = set()
        stops: set[int] = set()
        for index in sharding.addressable_devices_indices_map((size,)).values():
            block = index[0] if index else slice(None)
            starts.add(block.start or 0)
            stops.add(size if block.stop is None else block.stop)
        rows = slice(min(starts), max(stops))
        covered = set().union(*(range(a, b) for a, b in zip(sorted(starts), sorted(stops))))
        if len(covered) != rows.stop - rows.start:
            raise ValueError(
                f"process {jax.process_index()} holds batch rows starting at {sorted(starts)} that are not one "
                "contiguous block; order the devices so that each process's devices are adjacent along the batch"
            )
        return rows

    @property
    def eval_batch_size(self) -> int:
        """Examples per evaluation batch: ``per_device_eval_parallelism`` x the data-axis size.

        ``per_device_eval_parallelism=-1`` means as for training: ``per_device_parallelism`` (the training
        microbatch) if set, else ``train_batch_size`` (one batch per step).
        """
        per_device = self.config.per_device_eval_parallelism
        if per_device == -1:
            per_device = self.config.per_device_parallelism
        if per_device == -1:
            return self.config.train_batch_size
        return per_device * self.data_axis_size

    def shard_batch(self, batch: Any, batch_size: int | None = None) -> Any:
        """Place a batch on the devices, split along the batch axis over ``(replica, data)`` (NamedArray leaves).

        The batch may be the whole global batch (every process passes the same data), or, in a
        multi-process run, only this process's rows (:meth:`process_batch_rows` of ``batch_size``): then
        the global arrays are assembled with ``jax.make_array_from_process_local_data``.

        Args:
            batch: a pytree of NamedArrays (other leaves are left to ``jit``).
            batch_size: the global batch size the batch belongs to (default: ``train_batch_size``; pass
                :attr:`eval_batch_size` for evaluation batches).

        Returns:
            The placed batch.

        Raises:
            ValueError: (several processes) if a leaf's batch axis holds neither this process's rows nor the
                whole batch.
        """
        if jax.process_count() == 1:
            return hax.shard(batch, self.compute_axis_mapping, self.mesh)
        size = self.config.train_batch_size if batch_size is None else batch_size
        rows = self.process_batch_rows(size)
        local = rows.stop - rows.start

        def place(leaf: Any) -> Any:
            if not isinstance(leaf, NamedArray):
                return leaf
            sharding = hax.partitioning.sharding_for_axis(leaf.axes, self.compute_axis_mapping, self.mesh)
            shape = list(leaf.array.shape)
            if leaf.has_axis(self.config.batch_axis):
                index = leaf.axis_indices(self.config.batch_axis)
                if shape[index] not in (local, size):
                    raise ValueError(
                        f"process {jax.process_index()}: a batch leaf has {shape[index]} examples along axis "
                        f"{self.config.batch_axis!r}; expected this process's {local} rows ({rows.start}:{rows.stop}) "
                        f"of a global batch of {size}, or all {size}"
                    )
                shape[index] = size
            data = np.asarray(leaf.array)
            global_axes = tuple(a.resize(n) for a, n in zip(leaf.axes, shape))
            return hax.named(jax.make_array_from_process_local_data(sharding, data, tuple(shape)), global_axes)

        return jax.tree_util.tree_map(place, batch, is_leaf=_is_named)

    # -- state -------------------------------------------------------------------------------------
    def initial_state(
        self, model_init: Callable[[jax.Array], Any], *, key: jax.Array | None = None, is_trainable: FilterTree = True
    ) -> TrainerState:
        """Build the model and optimizer state directly in their sharded layout.

        ``key`` (default ``jax.random.PRNGKey(config.seed)``) is split in two: the first half is passed
        to ``model_init``, the second becomes the state's ``training_key``. The model is cast to the
        parameter dtype of the ``mp`` policy.

        Args:
            model_init: ``model_init(key) -> model``, e.g. ``lambda k: cfg.build(Vocab, key=k)``.
            key: the root key.
            is_trainable: which parts of the model train (see :data:`ponente.trainer.state.FilterTree`).

        Returns:
            The state at step 0, parameters sharded by the parameter mapping.
        """
        seed = self.config.seed
        # the root key is made and split inside the one compiled init program: eager PRNGKey/split calls
        # would each compile a tiny program of their own (on every start, as they are too quick to cache)
        if key is None and 0 <= seed < 2**31:
            root: Any = np.int32(seed)
        else:
            root = jax.random.PRNGKey(seed) if key is None else key
        with self._on_mesh():
            return self._init(root, model_init, _ByIdentity(is_trainable))

    def _build_state(
        self, root: jax.Array, model_init: Callable[[jax.Array], Any], is_trainable: _ByIdentity
    ) -> TrainerState:
        if root.ndim == 0 and jnp.issubdtype(root.dtype, jnp.integer):  # a seed, not a (typed) key
            root = jax.random.PRNGKey(root)
        model_key, training_key = jax.random.split(root)
        model = self.mp.cast_to_param(model_init(model_key))
        return init_state(model, self.optimizer, training_key, is_trainable=is_trainable.value)

    def compile_step(self, state: TrainerState, batch: Any) -> None:
        """Compile the training step for a state and batches like these, without running it.

        The next :meth:`train_step` (or :meth:`train`) with arrays of the same shapes, dtypes and shardings
        then starts at once. Only the structure of ``state`` and ``batch`` is read, never their values, and
        nothing is donated, so a placeholder batch of zeros will do. XLA releases the GIL while it compiles:
        call this from a background thread to compile the step while the rest of the run gets ready
        (data, checkpoint restore, trackers). Where the state passed to :meth:`train_step` later differs
        (another sharding, say), that call compiles again, with the same result.

        Args:
            state: the state the first step will get (e.g. from :meth:`initial_state`).
            batch: a batch with the layout of the training batches: the whole global batch, or (several
                processes) this process's rows, as :meth:`shard_batch` takes.

        Raises:
            ValueError: if the batch does not have ``train_batch_size`` examples.

        Example:
            >>> import optax, jax.numpy as jnp
            >>> cfg = TrainerConfig(train_batch_size=4, num_train_steps=2, compilation_cache_dir=None)
            >>> trainer = Trainer(cfg, optax.sgd(0.1), lambda model, batch, *, key: jnp.mean((batch - model) ** 2))
            >>> state = trainer.initial_state(lambda key: jnp.zeros(()))
            >>> trainer.compile_step(state, jnp.zeros(4))  # the step below does not compile again
            >>> state, metrics = trainer.train_step(state, jnp.ones(4))
        """
        placed = self.shard_batch(batch)
        _check_batch(placed, self.config.batch_axis, self.config.train_batch_size)
        start = time.perf_counter()
        with self._on_mesh():
            self._step.lower(state, *_BatchLayout.strip(placed)).compile()
        logger.debug("training step compiled in %.2f s", time.perf_counter() - start)

    # -- the step ----------------------------------------------------------------------------------
    def _loss_and_grad(
        self, trainable: Any, rest: Any, batch: Any, key: jax.Array
    ) -> tuple[jax.Array, dict[str, jax.Array], Any]:
        def loss_of(params: Any) -> tuple[jax.Array, dict[str, jax.Array]]:
            model = self.mp.cast_to_compute(eqx.combine(params, rest))
            return _loss_and_metrics(self.loss_fn(model, batch, key=key))

        (loss, extra), grads = jax.value_and_grad(loss_of, has_aux=True)(trainable)
        return loss, extra, grads

    def _accumulate(
        self, trainable: Any, rest: Any, batch: Any, key: jax.Array
    ) -> tuple[jax.Array, dict[str, jax.Array], Any]:
        n = self.num_microbatches
        stacked, unstack = _split_microbatches(batch, self.config.batch_axis, n)
        scanned = [s for s in stacked if s is not None]
        where = [s is not None for s in stacked]

        def micro_grads(index: jax.Array, slices: Any) -> tuple[Any, ...]:
            it = iter(slices)
            micro = hax.auto_sharded(unstack([next(it) if w else None for w in where]))
            loss, extra, grads = self._loss_and_grad(trainable, rest, micro, jax.random.fold_in(key, index))
            return loss, extra, grads, jnp.asarray(self.loss_weight_fn(micro), jnp.float32)

        def body(carry: Any, xs: Any) -> Any:
            grad_sum, loss_sum, extra_sum, weight_sum = carry
            loss, extra, grads, weight = micro_grads(*xs)
            grad_sum = jax.tree_util.tree_map(lambda acc, g: acc + weight * g, grad_sum, grads)
            extra_sum = {k: extra_sum[k] + weight * v for k, v in extra.items()}
            return (grad_sum, loss_sum + weight * loss, extra_sum, weight_sum + weight), None

        # the extra metrics' names are only known from tracing the loss once
        extra_shapes = jax.eval_shape(micro_grads, jnp.zeros((), jnp.int32), [s[0] for s in scanned])[1]
        zeros = jax.tree_util.tree_map(jnp.zeros_like, trainable)
        scalar_zero = jnp.zeros((), jnp.float32)
        init = (zeros, scalar_zero, dict.fromkeys(extra_shapes, scalar_zero), scalar_zero)
        (grad_sum, loss_sum, extra_sum, weight_sum), _ = jax.lax.scan(body, init, (jnp.arange(n), scanned))
        total = jnp.maximum(weight_sum, jnp.finfo(jnp.float32).tiny)
        grads = jax.tree_util.tree_map(lambda g: (g / total).astype(g.dtype), grad_sum)
        return loss_sum / total, {k: v / total for k, v in extra_sum.items()}, grads

    def _train_step(
        self, state: TrainerState, arrays: list[Any], layout: _BatchLayout
    ) -> tuple[TrainerState, dict[str, jax.Array]]:
        batch = hax.shard(layout.restore(arrays), self.compute_axis_mapping)
        next_key, step_key = jax.random.split(state.training_key)
        loss_key, opt_key = jax.random.split(step_key)
        trainable, rest = state.split_trainable()
        if self.num_microbatches == 1:
            loss, extra, grads = self._loss_and_grad(trainable, rest, batch, loss_key)
        else:
            loss, extra, grads = self._accumulate(trainable, rest, batch, loss_key)

        def obj_fn(params: Any) -> jax.Array:
            model = self.mp.cast_to_compute(eqx.combine(params, rest))
            return _loss_and_metrics(self.loss_fn(model, batch, key=loss_key))[0]

        updates, opt_state = self.optimizer.update(
            grads, state.opt_state, trainable, loss=loss, obj_fn=obj_fn, key=opt_key
        )
        model = eqx.combine(eqx.apply_updates(trainable, updates), rest)
        new_state = dataclasses.replace(
            state, step=state.step + 1, model=model, opt_state=opt_state, training_key=next_key
        )
        metrics = {
            **extra,
            "loss": loss,
            "grad_norm": optax.tree.norm(grads),
            **self.optimizer_metrics_fn(opt_state),
        }
        lr = self._learning_rate(state)
        if lr is not None:
            metrics["learning_rate"] = jnp.asarray(lr, jnp.float32)
        return new_state, metrics

    def _learning_rate(self, state: TrainerState) -> Any:
        if self.lr_schedule is not None:
            return self.lr_schedule(state.step)
        try:
            return optax.tree_utils.tree_get(state.opt_state, "learning_rate")
        except KeyError:  # several learning rates in the state: none is "the" learning rate
            return None

    def train_step(self, state: TrainerState, batch: Any) -> tuple[TrainerState, dict[str, jax.Array]]:
        """One optimizer step on ``batch`` (compiled once; ``state`` is donated, so do not reuse it).

        Args:
            state: the current state.
            batch: a pytree with ``train_batch_size`` examples along the batch axis (NamedArrays with a
                ``batch`` axis, or arrays whose first dimension is the batch).

        Returns:
            The next state and the metrics ``loss``, ``grad_norm``, (when known) ``learning_rate`` and
            those of ``optimizer_metrics_fn``, as scalar arrays (not yet on the host).

        Raises:
            ValueError: if the batch does not have ``train_batch_size`` examples.
        """
        _check_batch(batch, self.config.batch_axis, self.config.train_batch_size)
        with self._on_mesh():
            return self._step(state, *_BatchLayout.strip(batch))

    # -- evaluation --------------------------------------------------------------------------------
    def _eval_step(self, model: Any, arrays: list[Any], layout: _BatchLayout) -> tuple[jax.Array, jax.Array]:
        batch = hax.shard(layout.restore(arrays), self.compute_axis_mapping)
        loss = _loss_and_metrics(self.loss_fn(self.mp.cast_to_compute(model), batch, key=None))[0]
        weight = jnp.asarray(self.loss_weight_fn(batch), jnp.float32)
        return loss * weight, weight

    def eval_loss(self, state: TrainerState, batches: Iterable[Any], *, batch_size: int | None = None) -> float:
        """The loss of the state's model over ``batches``, each batch weighted by its loss tokens.

        At most ``config.max_eval_batches`` batches are used. In a multi-process run every process passes
        the same number of batches, each holding either the whole global batch or only this process's rows
        (:meth:`process_batch_rows` of ``batch_size``); the result is the same on every process and equals a
        single process's loss over the whole batches.

        Args:
            state: the state to evaluate.
            batches: batches like those of training (any batch size).
            batch_size: the global size of the batches (default: :attr:`eval_batch_size`); only read in a
                multi-process run, to assemble global batches from this process's rows.

        Returns:
            The weighted mean loss.

        Raises:
            ValueError: if there are no batches (or they hold no loss tokens).
        """
        size = self.eval_batch_size if batch_size is None else batch_size
        total = weight = 0.0
        limit = self.config.max_eval_batches
        with self._on_mesh():
            for i, batch in enumerate(batches):
                if limit is not None and i >= limit:
                    break
                weighted, w = self._eval(state.model, *_BatchLayout.strip(self.shard_batch(batch, size)))
                total += float(weighted)
                weight += float(w)
        if weight <= 0:
            raise ValueError("eval_loss: no evaluation batches (or no loss tokens in them)")
        return total / weight

    # -- stopping ----------------------------------------------------------------------------------
    def request_stop(self, reason: str) -> None:
        """Ask :meth:`train` to stop after the current step and return the state (e.g. from a signal handler).

        Args:
            reason: why, for the log (e.g. ``"SIGTERM"``).
        """
        # no lock: a signal handler may call this while the main thread is inside it; the first reason wins
        if self._stop_reason is None:
            self._stop_reason = reason

    @property
    def stop_requested(self) -> str | None:
        """The reason a stop was requested, or None."""
        return self._stop_reason

    @contextlib.contextmanager
    def _sigint_stops(self) -> Iterator[None]:
        if threading.current_thread() is not threading.main_thread():
            yield
            return

        def on_sigint(signum: int, frame: Any) -> None:
            if self._stop_reason is not None:
                raise KeyboardInterrupt
            logger.warning("Ctrl-C: stopping after the current step (press Ctrl-C again to abort immediately)")
            self.request_stop("SIGINT")

        previous = signal.signal(signal.SIGINT, on_sigint)
        try:
            yield
        finally:
            signal.signal(signal.SIGINT, previous)

    # -- the loop ----------------------------------------------------------------------------------
    def train(
        self,
        state: TrainerState,
        loader: Iterable[tuple[int, Any]],
        *,
        eval_fn: Callable[[TrainerState], float | Mapping[str, float]] | None = None,
    ) -> TrainerState:
        """Train until ``num_train_steps`` steps are done, the loader ends, or a stop is requested.

        Per step: wait for the batch (timed), run :meth:`train_step`, fetch the metrics, check them for
        NaN/Inf, compute throughput (tokens/s, examples/s, MFU), call ``log_fn`` and the hooks that are
        due, and every ``steps_per_eval`` steps ``eval_fn``. The first Ctrl-C stops the loop after the
        current step (the state is returned, e.g. to checkpoint it); a second one raises
        ``KeyboardInterrupt`` at once. The step numbers in metrics and hooks count completed steps.

        Args:
            state: the state to start from (its ``step`` says where).
            loader: yields ``(step, batch)`` where ``step`` equals ``state.step`` before that step
                (e.g. ``DataLoader(dataset, batch_size, start_step=int(state.step))``).
            eval_fn: evaluates the state, returning a loss or a dict of metrics (logged as ``eval/...``).

        Returns:
            The final state.

        Raises:
            NonFiniteLossError: on a NaN/Inf loss or gradient norm when ``crash_on_nan``.
            ValueError: if the loader's step does not match the state's step.
            KeyboardInterrupt: on a second Ctrl-C.
        """
        cfg = self.config
        peak = self._peak_flops()
        num_devices = self.mesh.size
        bar = self._progress_bar(int(state.step))
        last: StepInfo | None = None
        ran_at_last: set[int] = set()
        try:
            with self._sigint_stops():
                iterator = iter(loader)
                while int(state.step) < cfg.num_train_steps and self._stop_reason is None:
                    t0 = time.perf_counter()
                    try:
                        data_step, batch = next(iterator)
                    except StopIteration:
                        logger.info("data loader exhausted at step %d", int(state.step))
                        break
                    t1 = time.perf_counter()
                    if data_step != int(state.step):
                        raise ValueError(
                            f"the loader yielded a batch for step {data_step}, but the state is at step "
                            f"{int(state.step)}; start the loader at the state's step"
                        )
                    examples = self.config.train_batch_size
                    placed = self.shard_batch(batch)  # in a multi-process run, `batch` holds this process's rows
                    tokens = _tokens_in(placed)
                    state, device_metrics = self.train_step(state, placed)
                    metrics = {k: float(v) for k, v in jax.device_get(device_metrics).items()}
                    t2 = time.perf_counter()
                    step = data_step + 1
                    self._check_finite(metrics, step)
                    logged = self._step_metrics(metrics, tokens, examples, t2 - t1, t1 - t0, peak, num_devices)
                    if self.log_fn is not None:
                        self.log_fn(logged, step)
                    last = StepInfo(state, step, metrics["loss"], logged, t2 - t1, t1 - t0)
                    ran_at_last = set()
                    for i, hook in enumerate(self.hooks):
                        if hook.due(step):
                            hook.fn(last)
                            ran_at_last.add(i)
                    if eval_fn is not None and step % cfg.steps_per_eval == 0:
                        self._run_eval(eval_fn, state, step)
                    if bar is not None:
                        bar.update(1)
                        postfix = {
                            "loss": f"{metrics['loss']:.4g}",
                            "tok/s": f"{logged['throughput/tokens_per_second']:.4g}",
                        }
                        if "throughput/mfu" in logged:
                            postfix["mfu"] = f"{100 * logged['throughput/mfu']:.1f}%"
                        bar.set_postfix(postfix)
                if self._stop_reason is not None:
                    logger.warning("training stopped at step %d: %s", int(state.step), self._stop_reason)
                if last is not None:
                    final = dataclasses.replace(last, state=state, final=True)
                    for i, hook in enumerate(self.hooks):
                        if i not in ran_at_last:
                            hook.fn(final)
        finally:
            if bar is not None:
                bar.close()
            self.last_stop_reason = self._stop_reason
            self._stop_reason = None
        return state

    def _peak_flops(self) -> float | None:
        if self.flops_per_token is None:
            return None
        return device_peak_flops(self.mesh.devices.flat[0].device_kind, jnp.dtype(self.mp.compute_dtype).name)

    def _progress_bar(self, start: int) -> Any:
        if not (self.config.progress_bar and sys.stderr.isatty()):
            return None
        from tqdm.auto import tqdm

        return tqdm(total=self.config.num_train_steps, initial=start, desc="train", unit="step")

    def _check_finite(self, metrics: Mapping[str, float], step: int) -> None:
        bad = {k: metrics[k] for k in ("loss", "grad_norm") if k in metrics and not math.isfinite(metrics[k])}
        if not bad:
            return
        message = f"step {step}: non-finite {', '.join(f'{k}={v}' for k, v in bad.items())}"
        if self.config.crash_on_nan:
            raise NonFiniteLossError(message + " (set trainer.crash_on_nan=false to continue anyway)")
        logger.error("%s; continuing because trainer.crash_on_nan is false", message)

    def _step_metrics(
        self,
        metrics: Mapping[str, float],
        tokens: int,
        examples: int,
        step_seconds: float,
        data_seconds: float,
        peak: float | None,
        num_devices: int,
    ) -> dict[str, float]:
        seconds = max(step_seconds, 1e-12)
        logged = {
            "train/loss": metrics["loss"],
            "train/grad_norm": metrics["grad_norm"],
            "throughput/tokens_per_second": tokens / seconds,
            "throughput/examples_per_second": examples / seconds,
            "throughput/step_seconds": step_seconds,
            "throughput/data_wait_seconds": data_seconds,
        }
        if "learning_rate" in metrics:
            logged["optim/learning_rate"] = metrics["learning_rate"]
        for k, v in metrics.items():
            if k not in ("loss", "grad_norm", "learning_rate"):
                logged[k if "/" in k else f"train/{k}"] = v
        if peak is not None and self.flops_per_token is not None:
            logged["throughput/mfu"] = _mfu(self.flops_per_token, tokens, seconds, peak, num_devices)
        return logged

    def _run_eval(
        self, eval_fn: Callable[[TrainerState], float | Mapping[str, float]], state: TrainerState, step: int
    ) -> None:
        result = eval_fn(state)
        values = {"loss": float(result)} if isinstance(result, (int, float)) else dict(result)
        logged = {f"eval/{k}": float(v) for k, v in values.items()}
        logger.info("step %d: %s", step, ", ".join(f"{k}={v:.4g}" for k, v in logged.items()))
        if self.log_fn is not None:
            self.log_fn(logged, step)
