"""The :class:`Trainer`: the sharded initial state, the compiled step (with gradient accumulation), the loop."""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import math
import sys
import time
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax

import ponente.namedtensor as hax
from ponente.namedtensor import NamedArray
from ponente.namedtensor.partitioning import ResourceMapping, named_jit

from ..callbacks import Hook, StepInfo, as_hook
from ..mfu import device_peak_flops
from ..mfu import mfu as _mfu
from ..run_id import new_run_id
from ..state import FilterTree, TrainerState, init_state
from ._batch import BatchLayout, check_batch, default_loss_weight, is_named, tokens_in
from ._config import TrainerConfig
from ._mesh import build_mesh, enable_compilation_cache, init_compiler_options
from ._quantization import quantize_model
from ._signals import stop_on_signals
from ._step import TrainStep

logger = logging.getLogger(__name__)

LossFn = Callable[..., Any]
"""``loss_fn(model, batch, *, key) -> scalar``: the mean loss of ``model`` on ``batch`` (a scalar array or
scalar NamedArray), or ``(loss, {name: scalar})`` to also log extra per-step metrics (e.g. a MoE router's
auxiliary loss, logged as ``train/<name>``). With gradient accumulation, each microbatch's loss and
metrics are weighted by its number of loss tokens (see :class:`Trainer`)."""


class NonFiniteLossError(FloatingPointError):
    """The loss or the gradient norm of a step is NaN or infinite and ``trainer.on_nonfinite_loss`` is ``"stop"``.

    Attributes:
        step: the step whose loss was not finite (the count of completed steps it would have made).
        state: the last good state (the bad step's update was not applied), e.g. to checkpoint it; None when the
            error was raised outside :meth:`Trainer.train`.
    """

    def __init__(self, message: str, *, step: int = 0, state: Any = None) -> None:
        super().__init__(message)
        self.step = step
        self.state = state


class _ByIdentity:
    """A static argument compared by identity (a filter tree may hold unhashable or array-like nodes)."""

    def __init__(self, value: Any):
        self.value = value

    def __hash__(self) -> int:
        return id(self.value)

    def __eq__(self, other: object) -> bool:
        return isinstance(other, _ByIdentity) and other.value is self.value


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
        after_update: ``after_update(model, extra) -> model``, run inside the step on the updated model, outside the
            gradient; ``extra`` is the loss function's extra outputs (e.g. a mixture of experts' load per expert, for
            its balancing bias). The result is part of the state, so it is checkpointed and resumes bitwise.

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
        after_update: Callable[[Any, Mapping[str, Any]], Any] | None = None,
    ):
        import jmp

        if optimizer_metrics_fn is None:
            from ..optim import optimizer_metrics

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
        self.run_id = config.id if config.id is not None else new_run_id()
        try:
            self.mp = jmp.get_policy(config.mp)
        except ValueError as e:
            raise ValueError(f"trainer.mp: {config.mp!r} is not a jmp policy such as 'p=f32,c=bfloat16': {e}") from e
        if config.compilation_cache_dir:
            enable_compilation_cache(config.compilation_cache_dir)

        self.mesh = build_mesh(config, list(jax.devices() if devices is None else devices))
        self.data_axis_size = self.mesh.shape["replica"] * self.mesh.shape["data"] * self.mesh.shape["expert"]
        """Shards of the batch: the sizes of the ``replica``, ``data`` and ``expert`` mesh axes multiplied."""
        self.num_microbatches = self._microbatches(config.train_batch_size, config.per_device_parallelism, "train")
        self.compute_axis_mapping: ResourceMapping = config.compute_axis_mapping
        self.parameter_axis_mapping: ResourceMapping = config.parameter_axis_mapping
        # The state enters and leaves by the parameter mapping. The batch is passed as plain arrays plus its
        # (static) axes, so that named_jit does not constrain it by that mapping; the step shards it by the
        # compute mapping instead.
        step = TrainStep(
            loss_fn=loss_fn,
            optimizer=self.optimizer,
            mp=self.mp,
            batch_axis=config.batch_axis,
            num_microbatches=self.num_microbatches,
            compute_axis_mapping=self.compute_axis_mapping,
            loss_weight_fn=self.loss_weight_fn,
            optimizer_metrics_fn=self.optimizer_metrics_fn,
            lr_schedule=lr_schedule,
            on_nonfinite_loss=config.on_nonfinite_loss,
            after_update=after_update,
        )
        self._step = named_jit(
            step.train,
            self.compute_axis_mapping,
            in_axis_resources=self.parameter_axis_mapping,
            out_axis_resources=self.parameter_axis_mapping,
            donate_args=(True, False, False),
        )
        self._eval = named_jit(step.eval, self.compute_axis_mapping, in_axis_resources=self.parameter_axis_mapping)
        # compiled once per (model_init, is_trainable): both are static arguments
        self._init = named_jit(
            self._build_state, self.parameter_axis_mapping, compiler_options=init_compiler_options(self.mesh)
        )
        self._stop_reason: str | None = None
        self._compiled_step: Any = None  # the step compile_step built (a named_jit CompiledCall), used by train_step
        self.last_stop_reason: str | None = None
        """Why the last :meth:`train` call stopped early (e.g. ``"SIGINT"``), or None if it ran to the end."""
        self.skipped_steps = 0
        """Steps whose update was dropped for a non-finite loss or gradient norm (``on_nonfinite_loss: skip``)."""

    def _microbatches(self, batch_size: int, per_device: int, what: str) -> int:
        data = self.data_axis_size
        if batch_size % data != 0:
            raise ValueError(
                f"trainer.train_batch_size={batch_size} is not divisible by the data axis size {data} "
                f"({self.mesh.size} devices / model_axis_size {self.config.model_axis_size}; the batch is split "
                "over the replica, data and expert mesh axes)"
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

        return jax.tree_util.tree_map(place, batch, is_leaf=is_named)

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
        model = self.prepare_model(model_init(model_key))
        return init_state(model, self.optimizer, training_key, is_trainable=is_trainable.value)

    def prepare_model(self, model: Any) -> Any:
        """A model as this trainer's state holds it: in the parameter dtype of ``mp``, its products quantized as
        ``trainer.quantization`` says (fresh FP8 state). Use it for weights that replace the initial state's model
        (e.g. pretrained ones); :func:`ponente.trainer.trainer.plain_model` undoes the quantization for export.

        Raises:
            ValueError: if ``trainer.quantization.targets`` selects no layer of the model.
        """
        model = self.mp.cast_to_param(model)
        if self.config.quantization is not None:
            model = quantize_model(model, self.config.quantization)
        return model

    def compile_step(self, state: TrainerState, batch: Any) -> jax.stages.Compiled:
        """Compile the training step for a state and batches like these, without running it.

        The next :meth:`train_step` (or :meth:`train`) with arrays of the same shapes, dtypes and shardings
        then starts at once. Only the structure of ``state`` and ``batch`` is read, never their values, and
        nothing is donated, so a placeholder batch of zeros will do. XLA releases the GIL while it compiles:
        call this from a background thread to compile the step while the rest of the run gets ready
        (data, checkpoint restore, trackers). :meth:`train_step` then runs this executable (it does not trace
        or compile again); for a state or batch of other shapes or dtypes it compiles the step anew, with the same
        result.

        Args:
            state: the state the first step will get (e.g. from :meth:`initial_state`).
            batch: a batch with the layout of the training batches: the whole global batch, or (several
                processes) this process's rows, as :meth:`shard_batch` takes.

        Returns:
            The compiled step: its ``memory_analysis()`` and ``cost_analysis()`` say what XLA planned (e.g. the
            scratch memory of the step under a ``gradient_checkpointing`` policy).

        Raises:
            ValueError: if the batch does not have ``train_batch_size`` examples.

        Example:
            >>> import optax, jax.numpy as jnp
            >>> cfg = TrainerConfig(train_batch_size=4, num_train_steps=2, compilation_cache_dir=None)
            >>> trainer = Trainer(cfg, optax.sgd(0.1), lambda model, batch, *, key: jnp.mean((batch - model) ** 2))
            >>> state = trainer.initial_state(lambda key: jnp.zeros(()))
            >>> compiled = trainer.compile_step(state, jnp.zeros(4))  # the step below does not compile again
            >>> state, metrics = trainer.train_step(state, jnp.ones(4))
        """
        placed = self.shard_batch(batch)
        check_batch(placed, self.config.batch_axis, self.config.train_batch_size)
        start = time.perf_counter()
        with self._on_mesh():
            self._compiled_step = self._step.compile(state, *BatchLayout.strip(placed))
        logger.debug("training step compiled in %.2f s", time.perf_counter() - start)
        return self._compiled_step.compiled

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
        check_batch(batch, self.config.batch_axis, self.config.train_batch_size)
        step = self._step if self._compiled_step is None else self._compiled_step  # compile_step's executable
        with self._on_mesh():
            return step(state, *BatchLayout.strip(batch))

    # -- evaluation --------------------------------------------------------------------------------
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
        return self.eval_metrics(state, batches, batch_size=batch_size)["loss"]

    def eval_metrics(
        self, state: TrainerState, batches: Iterable[Any], *, batch_size: int | None = None
    ) -> dict[str, float]:
        """:meth:`eval_loss` (same arguments) with the loss function's own metrics: ``{"loss": ..., name: ...}``,
        each the mean over ``batches`` weighted as the loss is.

        Raises:
            ValueError: if there are no batches (or they hold no loss tokens).
        """
        size = self.eval_batch_size if batch_size is None else batch_size
        totals: dict[str, float] = {}
        weight = 0.0
        limit = self.config.max_eval_batches
        with self._on_mesh():
            for i, batch in enumerate(batches):
                if limit is not None and i >= limit:
                    break
                weighted, w = self._eval(state.model, *BatchLayout.strip(self.shard_batch(batch, size)))
                for name, value in weighted.items():
                    totals[name] = totals.get(name, 0.0) + float(value)
                weight += float(w)
        if weight <= 0:
            raise ValueError("eval_loss: no evaluation batches (or no loss tokens in them)")
        return {name: total / weight for name, total in totals.items()}

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
        due, and every ``steps_per_eval`` steps ``eval_fn``. The first Ctrl-C or SIGTERM stops the loop after
        the current step (the state is returned, e.g. to checkpoint it; :attr:`last_stop_reason` says which); a
        second Ctrl-C raises ``KeyboardInterrupt`` at once, a second SIGTERM ends the process
        (:func:`~ponente.trainer.trainer.stop_on_signals`). The step numbers in metrics and hooks count completed
        steps.

        Args:
            state: the state to start from (its ``step`` says where).
            loader: yields ``(step, batch)`` where ``step`` equals ``state.step`` before that step
                (e.g. ``DataLoader(dataset, batch_size, start_step=int(state.step))``).
            eval_fn: evaluates the state, returning a loss or a dict of metrics (logged as ``eval/...``).

        Returns:
            The final state.

        Raises:
            NonFiniteLossError: on a NaN/Inf loss or gradient norm when ``on_nonfinite_loss`` is ``"stop"``; its
                ``state`` is the last good state (with ``"skip"`` the step's update is dropped and counted).
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
            with stop_on_signals(self.request_stop, lambda: self._stop_reason):
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
                    tokens = tokens_in(placed)
                    state, device_metrics = self.train_step(state, placed)
                    metrics = {k: float(v) for k, v in jax.device_get(device_metrics).items()}
                    t2 = time.perf_counter()
                    step = data_step + 1
                    self._check_finite(metrics, step, state)
                    logged = self._step_metrics(metrics, tokens, examples, t2 - t1, t1 - t0, peak, num_devices)
                    logged["train/skipped_steps"] = float(self.skipped_steps)
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

    def _check_finite(self, metrics: Mapping[str, float], step: int, state: TrainerState) -> None:
        """Count a skipped step, or raise with the last good state (the step itself dropped the update)."""
        bad = {k: metrics[k] for k in ("loss", "grad_norm") if k in metrics and not math.isfinite(metrics[k])}
        if not bad:
            return
        message = f"step {step}: non-finite {', '.join(f'{k}={v}' for k, v in bad.items())}"
        if self.config.on_nonfinite_loss == "stop":
            raise NonFiniteLossError(
                message + f"; its update was not applied, the state is that of step {step - 1} "
                "(trainer.on_nonfinite_loss: stop)",
                step=step,
                state=state,
            )
        self.skipped_steps += 1
        logger.error(
            "%s; its update was skipped (%d skipped step(s) so far; trainer.on_nonfinite_loss: skip)",
            message,
            self.skipped_steps,
        )

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
