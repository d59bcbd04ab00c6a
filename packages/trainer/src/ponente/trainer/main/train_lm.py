"""Train a language model: ``python -m ponente.trainer.main.train_lm --config_path gpt2_nano`` (``ponente-train``).

The configuration is a :class:`TrainLmConfig` (``data``, ``model``, ``trainer``, ``optimizer`` sections with
Levanter's key names) read from YAML files and dotted overrides; ``--help`` lists every field. A run:

1. opens (or builds, in the background) the token caches of ``data`` and packs rows of ``model.seq_len``;
2. builds the model and optimizer state (or resumes from the latest committed checkpoint of the run);
3. trains for ``trainer.num_train_steps`` steps, logging to the trackers, evaluating every
   ``trainer.steps_per_eval`` steps and checkpointing per ``trainer.checkpointer``;
4. saves a final checkpoint (and a Hugging Face export if ``hf_save_path`` is set), samples a short
   text when ``sample.num_tokens > 0``, and prints where everything went.
"""

from __future__ import annotations

import dataclasses
import functools
import logging
import os
import signal
import sys
import threading
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path
from typing import Any

from ponente.models import Gpt2Config, LmConfig
from ponente.trainer.callbacks import as_hook
from ponente.trainer.data import LMDatasetConfig, LMMixtureDatasetConfig
from ponente.trainer.lm import lm_batch, lm_loss_fn
from ponente.trainer.optim import AdamConfig, OptimizerConfig
from ponente.trainer.trainer import Trainer, TrainerConfig

logger = logging.getLogger("ponente.trainer.train_lm")

__all__ = [
    "PREEMPTED_EXIT_CODE",
    "SampleConfig",
    "TrainLmConfig",
    "TrainResult",
    "config_differences",
    "main",
    "train",
]

PREEMPTED_EXIT_CODE = 75
"""Exit code of a run stopped by SIGTERM after saving its checkpoint (EX_TEMPFAIL: try again later)."""


@dataclasses.dataclass(frozen=True)
class SampleConfig:
    """Text sampled from the trained model at the end of a run.

    Attributes:
        num_tokens: tokens to generate (0: no sample).
        prompt: the text to continue.
        temperature: softmax temperature (0: greedy).
        top_k: sample among the ``top_k`` most likely tokens (None: all).
    """

    num_tokens: int = 0
    prompt: str = "\n"
    temperature: float = 0.8
    top_k: int | None = 40


@dataclasses.dataclass(frozen=True)
class TrainLmConfig:
    """Everything a language-model training run reads (Levanter's ``TrainLmConfig`` keys).

    Attributes:
        data: where the text is, its tokenizer and cache (a single dataset or a mixture).
        model: the model config; ``model.type`` picks the architecture (``gpt2``, ``llama``, ...).
        trainer: batch size, steps, mixed precision, mesh, tracker, checkpointer, evaluation cadence.
        optimizer: ``optimizer.type`` (``adam``, ``lion``, ``sophia-h``, ``muon``), learning rate, schedule.
        initialize_from_hf: a Hugging Face checkpoint folder (or hub id) whose weights start the run.
        use_hf_model_config: with ``initialize_from_hf``, take the model config from the checkpoint.
        z_loss_weight: weight of the z-loss ``logsumexp(logits)**2`` (0: none).
        cross_entropy_block_size: compute the loss blockwise over this many vocab entries, never
            materializing full logits (None: the plain loss).
        data_seed: seed of the data order (None: ``trainer.seed``).
        hf_save_path: if set, export the final model as a Hugging Face folder there.
        hf_save_steps: also export every this many steps (needs ``hf_save_path``).
        sample: the text sampled at the end of the run.
    """

    data: LMDatasetConfig | LMMixtureDatasetConfig = dataclasses.field(default_factory=LMDatasetConfig)
    model: LmConfig = dataclasses.field(default_factory=Gpt2Config)
    trainer: TrainerConfig = dataclasses.field(default_factory=TrainerConfig)
    optimizer: OptimizerConfig = dataclasses.field(default_factory=AdamConfig)
    initialize_from_hf: str | None = None
    use_hf_model_config: bool = False
    z_loss_weight: float = 0.0
    cross_entropy_block_size: int | None = None
    data_seed: int | None = None
    hf_save_path: str | None = None
    hf_save_steps: int | None = None
    sample: SampleConfig = dataclasses.field(default_factory=SampleConfig)

    def __post_init__(self) -> None:
        if self.hf_save_steps is not None and self.hf_save_path is None:
            raise ValueError("hf_save_steps is set but hf_save_path is not; set hf_save_path too")
        if self.use_hf_model_config and self.initialize_from_hf is None:
            raise ValueError("use_hf_model_config needs initialize_from_hf")


@dataclasses.dataclass
class TrainResult:
    """What a run produced.

    Attributes:
        run_id: the run id.
        steps: the number of completed steps.
        final_loss: the last training loss (None if no step ran).
        eval_loss: the last evaluation loss per validation set.
        checkpoint: the latest committed checkpoint (None if none was written).
        resumed_from: the checkpoint the run resumed from (None for a fresh start).
        hf_path: the Hugging Face export folder (None if not exported).
        sample: the sampled text (None if not sampled).
        stopped: the reason the run stopped early (None when all steps ran).
        outputs: named locations the run wrote (logs, checkpoints, ...).
    """

    run_id: str
    steps: int
    final_loss: float | None
    eval_loss: dict[str, float]
    checkpoint: str | None
    resumed_from: str | None
    hf_path: str | None
    sample: str | None
    stopped: str | None
    outputs: dict[str, str]


# fields that must not change when a run resumes, or the continuation is no longer bitwise identical
_MUST_STAY_FIXED = (
    "data",
    "data_seed",
    "model",
    "trainer.seed",
    "trainer.train_batch_size",
    "trainer.per_device_parallelism",
    "trainer.model_axis_size",
    "trainer.replica_axis_size",
    "trainer.replica_dcn_axis_size",
    "trainer.tensor_parallel_axes",
    "trainer.mp",
    "num_devices",
)


def _flat(tree: Mapping[str, Any], prefix: str = "") -> dict[str, Any]:
    out: dict[str, Any] = {}
    for k, v in tree.items():
        key = f"{prefix}{k}"
        if isinstance(v, Mapping):
            out.update(_flat(v, key + "."))
        else:
            out[key] = v
    return out


def config_differences(saved: Mapping[str, Any], current: Mapping[str, Any]) -> tuple[list[str], list[str]]:
    """Compare the provenance of a checkpoint with the current run.

    Args:
        saved: the ``config`` recorded in the checkpoint (plus ``num_devices``).
        current: the same for the current run.

    Returns:
        ``(fixed, other)``: dotted keys that differ, split into those that must stay fixed for a bitwise
        resume (data, tokenizer, seq len, batch size, mesh, seed, ...) and the rest.
    """
    # keys are reported without the ``config.`` prefix: ``data.tokenizer``, ``num_devices``
    a = _flat(saved.get("config") or {}) | {k: v for k, v in saved.items() if k != "config"}
    b = _flat(current.get("config") or {}) | {k: v for k, v in current.items() if k != "config"}
    differing = sorted(k for k in a.keys() | b.keys() if a.get(k) != b.get(k) and not k.startswith("trainer.id"))
    fixed = [k for k in differing if any(k == f or k.startswith(f + ".") for f in _MUST_STAY_FIXED)]
    return fixed, [k for k in differing if k not in fixed]


def _provenance(resolved: Mapping[str, Any]) -> dict[str, Any]:
    import jax

    return {"config": dict(resolved), "num_devices": jax.device_count()}


def _restore(
    state: Any, tcfg: TrainerConfig, checkpointer: Any, provenance: Mapping[str, Any]
) -> tuple[Any, str | None]:
    """Resume or initialize ``state`` per ``trainer.load_checkpoint*`` / ``trainer.initialize_from``."""
    import equinox as eqx

    from ponente.trainer.checkpoint import latest_checkpoint_path, load_checkpoint, read_metadata

    source: str | None = None
    if tcfg.load_checkpoint is not False:
        if tcfg.load_checkpoint_path is not None:
            source = latest_checkpoint_path(tcfg.load_checkpoint_path) or tcfg.load_checkpoint_path
        else:
            source = checkpointer.latest_checkpoint_path()
        if source is None and tcfg.load_checkpoint:
            raise FileNotFoundError(
                f"trainer.load_checkpoint is true but {checkpointer.run_path} has no committed checkpoint"
            )
    if source is not None:
        metadata = read_metadata(source)
        if metadata is None:
            raise FileNotFoundError(f"trainer.load_checkpoint_path: {source} is not a committed checkpoint")
        saved = {k: metadata.get("metadata", {}).get(k) for k in ("config", "num_devices")}
        fixed, other = config_differences(saved, provenance)
        if fixed:
            message = (
                f"resuming from {source} with a configuration that changes {', '.join(fixed)}: the continuation "
                "will not be bitwise identical to an uninterrupted run"
            )
            if not tcfg.allow_config_change:
                raise ValueError(message + " (set trainer.allow_config_change=true to resume anyway)")
            logger.warning("%s (allowed by trainer.allow_config_change)", message)
        if other:
            logger.info("resuming with changed config keys: %s", ", ".join(other))
        logger.info("resuming from %s", source)
        return load_checkpoint(state, source), source
    if tcfg.initialize_from is not None:
        logger.info("initializing the model from %s", tcfg.initialize_from)
        model = load_checkpoint(state.model, tcfg.initialize_from, subpath="model")
        return eqx.tree_at(lambda s: s.model, state, model), None
    return state, None


def _pad_vocab_for_partitioning(model_config: LmConfig, tcfg: TrainerConfig, num_devices: int) -> LmConfig:
    """Round the vocabulary up (``vocab_padding_multiple``) so that it splits evenly where it is sharded."""
    import math

    model = tcfg.model_axis_size
    replica = tcfg.replica_axis_size * tcfg.replica_dcn_axis_size
    sizes = {"model": model, "replica": replica, "data": max(num_devices // (model * replica), 1)}
    shards = 1
    for mapping in (tcfg.parameter_axis_mapping, tcfg.compute_axis_mapping):
        physical = mapping.get("vocab")
        names = [physical] if isinstance(physical, str) else list(physical or ())
        shards = math.lcm(shards, math.prod(sizes.get(n, 1) for n in names))
    multiple = math.lcm(model_config.vocab_padding_multiple, shards)
    if multiple == model_config.vocab_padding_multiple:
        return model_config
    logger.info(
        "vocab_padding_multiple %d -> %d: the vocab axis is split %d ways",
        model_config.vocab_padding_multiple,
        multiple,
        shards,
    )
    return dataclasses.replace(model_config, vocab_padding_multiple=multiple)


def _build_caches_once(data: Any, tcfg: TrainerConfig) -> None:
    """In a multi-process run, process 0 builds the caches (on Ray with ``data.backend: ray``); the others follow.

    Process 0 starts the background build of every split that has data (of every component of a mixture)
    and returns once each has committed its first rows; its ``train_set``/``validation_sets`` then reuse the
    running builds. After a barrier the other processes switch to follower mode (`follow_cache_builds`):
    they read the caches while process 0 commits rows and never write them, so no two processes ever write
    the same cache and training starts before the corpus is fully tokenized.
    """
    import jax

    if getattr(data, "backend", "local") == "ray" or any(
        getattr(c, "backend", "local") == "ray" for c in getattr(data, "configs", {}).values()
    ):
        head = (tcfg.distributed.coordinator_address or "").rpartition(":")[0] or None
        tcfg.ray.initialize(process_index=jax.process_index(), num_processes=jax.process_count(), head_host=head)
    if jax.process_count() == 1:
        return
    from ponente.trainer.data import follow_cache_builds
    from ponente.trainer.distributed import barrier

    if jax.process_index() == 0:
        logger.info("process 0 builds the data caches in the background; the other processes follow them")
        for split in ("train", "validation"):
            if isinstance(data, LMMixtureDatasetConfig) or data.has_split(split):
                data.build_caches(split, background=True, progress=False)  # returns once the first rows commit
    barrier("ponente.train_lm: data caches started")
    if jax.process_index() != 0:
        follow_cache_builds(True)


def _rows_recorder(rows: slice, batch_size: int) -> Any:
    """``record(step, batch) -> batch``; with ``$PONENTE_RECORD_ROWS`` set, it appends the global example indices
    and the number of rows this process loaded for each step to ``$PONENTE_RECORD_ROWS.<process index>``."""
    where = os.environ.get("PONENTE_RECORD_ROWS")

    def record(step: int, batch: Any) -> Any:
        if where:
            import json

            import jax

            from ponente.trainer.data.loader import step_indices

            line = {
                "step": step,
                "indices": step_indices(step, batch_size, rows).tolist(),
                "loaded": len(batch["input_ids"]),
            }
            with open(f"{where}.{jax.process_index()}", "a", encoding="utf-8") as f:
                f.write(json.dumps(line) + "\n")
        return batch

    return record


def _eval_batches(
    dataset: Any, batch_size: int, limit: int | None, rows: slice | None = None
) -> Iterator[dict[str, Any]]:
    """The evaluation batches of ``dataset``: only the positions ``rows`` of each global batch of ``batch_size``.

    Every example counts once: the last, partial batch is filled up with wrapped-around rows whose loss mask
    is zero. The number of batches depends only on the dataset's length, so every process of a multi-process
    run evaluates the same number of batches (each with its own rows), as their collectives require.
    """
    import numpy as np

    import ponente.namedtensor as hax
    from ponente.trainer.data import batch_for_step
    from ponente.trainer.data.loader import step_indices

    dataset.wait_for_length(None)  # evaluation uses the whole (finished) validation cache
    length = len(dataset)
    num = -(-length // batch_size)
    if limit is not None:
        num = min(num, limit)
    for step in range(num):
        batch = lm_batch(batch_for_step(dataset, step, batch_size, rows=rows))
        padding = step_indices(step, batch_size, rows) >= length
        if padding.any():
            mask = batch["loss_mask"]
            batch["loss_mask"] = hax.named(np.asarray(mask.array) * ~padding[:, None], mask.axes)
        yield batch


def _process_age() -> float | None:
    """Seconds since this process started (Linux ``/proc``; None elsewhere)."""
    try:
        with open("/proc/self/stat", encoding="ascii") as f:
            started_ticks = int(f.read().rpartition(")")[2].split()[19])
        with open("/proc/uptime", encoding="ascii") as f:
            uptime = float(f.read().split()[0])
    except (OSError, ValueError, IndexError):
        return None
    return max(uptime - started_ticks / os.sysconf("SC_CLK_TCK"), 0.0)


class _Startup:
    """Wall-clock times of the phases between the process start and the first step, for the logs.

    Phases on the main thread end with :meth:`mark` (each lasts since the previous mark); work started in a
    background thread with :meth:`background` reports its own duration. Each phase is logged at DEBUG as it
    ends; :meth:`first_step` logs them all at INFO once.
    """

    def __init__(self, start: float) -> None:
        self.start = start
        self.last = start
        self.phases: dict[str, float] = {}
        self._lock = threading.Lock()
        self._reported = False

    def _record(self, name: str, seconds: float) -> None:
        with self._lock:
            self.phases[name] = seconds
        logger.debug("startup: %s took %.2f s (%.2f s after start)", name, seconds, time.perf_counter() - self.start)

    def mark(self, name: str) -> None:
        now = time.perf_counter()
        self._record(name, now - self.last)
        self.last = now

    def background(self, pool: ThreadPoolExecutor, name: str, fn: Callable[..., Any], *args: Any) -> Future[Any]:
        """Run ``fn(*args)`` in ``pool``; its duration is recorded as the phase ``name`` (``[bg]`` in the log)."""
        begun = time.perf_counter()

        def task() -> Any:
            try:
                return fn(*args)
            finally:
                self._record(f"[bg] {name}", time.perf_counter() - begun)

        return pool.submit(task)

    def first_step(self) -> None:
        if self._reported:
            return
        self._reported = True
        with self._lock:
            detail = ", ".join(f"{name} {seconds:.2f} s" for name, seconds in self.phases.items())
        logger.info("first step done %.1f s after start (%s)", time.perf_counter() - self.start, detail)


def _placeholder_batch(rows: slice, seq_len: int) -> dict[str, Any]:
    """Zeros in the layout of this process's training batches, to compile the step before data arrives."""
    import numpy as np

    zeros = np.zeros((rows.stop - rows.start, seq_len), dtype=np.int32)
    return lm_batch({"input_ids": zeros, "segment_ids": zeros})


def _resolve(path: str) -> str:
    return path if "://" in path else str(Path(path).resolve())


def train(config: TrainLmConfig) -> TrainResult:
    """Run training as configured (see the module docstring).

    Args:
        config: the resolved configuration.

    Returns:
        What the run produced.

    Raises:
        ValueError: for a configuration that cannot run (no training data, bad sizes, a resume that
            changes a field that must stay fixed, ...).
        FileNotFoundError: if ``trainer.load_checkpoint`` is true and there is no checkpoint.
    """
    import jax

    age = _process_age()
    startup = _Startup(time.perf_counter() - (age or 0.0))
    if age is not None:
        startup.mark("interpreter start and imports")
    # partitionable threefry: random bits do not depend on how arrays are sharded, so a run resumed on
    # another mesh draws the same dropout masks and the same initialization
    jax.config.update("jax_threefry_partitionable", True)
    config.trainer.distributed.initialize()  # before anything touches a device

    import ponente.namedtensor as hax
    from ponente.trainer.config import config_to_dict
    from ponente.trainer.data import DataLoader
    from ponente.trainer.tracker import init_trackers, log_run_info

    data = config.data
    if isinstance(data, LMDatasetConfig) and not data.train_urls and data.id is None:
        raise ValueError(
            "data.train_urls is empty and data.id is not set: nothing to train on "
            "(for the packaged hello world, pass --config_path gpt2_nano)"
        )
    model_config = config.model
    if config.initialize_from_hf and config.use_hf_model_config:
        from ponente.models.hf import load_pretrained

        model_config = load_pretrained(config.initialize_from_hf).config
    model_config = _pad_vocab_for_partitioning(model_config, config.trainer, jax.device_count())
    vocab_size = data.the_vocab_size
    Vocab = hax.Axis("vocab", vocab_size)
    seq_len = model_config.seq_len

    tcfg = config.trainer
    run_id = tcfg.id or _run_id()
    tcfg = dataclasses.replace(tcfg, id=run_id)
    config = dataclasses.replace(config, trainer=tcfg, model=model_config)
    resolved = config_to_dict(config)
    provenance = _provenance(resolved)
    startup.mark("config and tokenizer")

    # trackers are created before any other thread starts: the tensorboard tracker hides torch while it imports
    tracker = init_trackers(tcfg.tracker, run_id)
    startup.mark("trackers")
    # Until the first step, four things proceed at once (XLA compiles and tokenizers release the GIL): the
    # run record (git, pip freeze), the token caches (built in their own threads; the datasets wait for the
    # first rows), the compilation of the training step, and on this thread the initial state and checkpoint.
    with ThreadPoolExecutor(max_workers=3, thread_name_prefix="ponente-startup") as pool:
        run_dir = tcfg.run_dir.format(run_id=run_id) if tcfg.run_dir else None
        recorded = startup.background(
            pool, "run record", functools.partial(log_run_info, run_dir=run_dir), tracker, resolved
        )
        checkpointer = tcfg.checkpointer.create(run_id, metadata=provenance)
        outputs: dict[str, str] = {"checkpoints": _resolve(checkpointer.run_path)}
        if run_dir is not None:
            outputs["run record"] = _resolve(run_dir)
        for tracker_config in tcfg.tracker if isinstance(tcfg.tracker, tuple) else (tcfg.tracker,):
            for attr in ("logdir", "path"):
                where = getattr(tracker_config, attr, None)
                if isinstance(where, str):
                    outputs[f"{tracker_config.choice_name} logs"] = _resolve(where.format(run_id=run_id))

        data_seed = tcfg.seed if config.data_seed is None else config.data_seed
        _build_caches_once(data, tcfg)

        def datasets() -> tuple[Any, dict[str, Any]]:
            train_set = data.train_set(seq_len, seed=data_seed, batch_size=tcfg.train_batch_size)
            return train_set, data.validation_sets(seq_len)

        data_ready = startup.background(pool, "datasets (first cache rows)", datasets)

        optimizer = config.optimizer
        trainer = Trainer(
            tcfg,
            optimizer.build(tcfg.num_train_steps),
            lm_loss_fn(config.z_loss_weight, config.cross_entropy_block_size),
            lr_schedule=optimizer.lr_scheduler(tcfg.num_train_steps),
            log_fn=lambda metrics, step: tracker.log(metrics, step=step),
            flops_per_token=model_config.flops_per_token(vocab_size),
        )
        rows = trainer.process_batch_rows()  # this process loads only the rows of its own devices
        state = trainer.initial_state(lambda key: model_config.build(Vocab, key=key))
        startup.mark("model and optimizer init")
        step_compiled: Future[Any] | None = None
        if config.initialize_from_hf and tcfg.initialize_from is None:
            import equinox as eqx

            from ponente.models.hf import load_pretrained

            pretrained = trainer.mp.cast_to_param(load_pretrained(config.initialize_from_hf))
            state = eqx.tree_at(lambda s: s.model, state, pretrained)
        else:  # the checkpoint restored below has the same shapes and shardings
            step_compiled = startup.background(
                pool, "train step compile", trainer.compile_step, state, _placeholder_batch(rows, seq_len)
            )
        state, resumed_from = _restore(state, tcfg, checkpointer, provenance)
        start_step = int(state.step)
        startup.mark("checkpoint restore")
        recorded.result()
        # the log then holds each step once: records a killed run wrote after its last checkpoint are dropped
        tracker.resume_from(start_step)
        train_set, validation = data_ready.result()
        if step_compiled is not None:
            step_compiled.result()
        startup.mark("waiting for the background work")

    eval_batch = trainer.eval_batch_size
    eval_rows = trainer.process_batch_rows(eval_batch)  # like training, each process loads its own rows
    last_eval: dict[str, float] = {}
    losses: list[float] = []

    def eval_fn(s: Any) -> dict[str, float]:
        results = {
            f"{name}/loss": trainer.eval_loss(
                s, _eval_batches(ds, eval_batch, tcfg.max_eval_batches, eval_rows), batch_size=eval_batch
            )
            for name, ds in validation.items()
        }
        last_eval.clear()
        last_eval.update(results)
        return results

    def on_step(info: Any) -> None:
        startup.first_step()
        if not info.final:
            losses.append(info.loss)
            checkpointer.on_step(info.state, info.step)
        if config.hf_save_steps and info.step % config.hf_save_steps == 0 and not info.final:
            _export_hf(info.state.model, f"{config.hf_save_path}/step-{info.step}", data, model_config)

    trainer.hooks.append(as_hook(on_step))

    def on_sigterm(signum: int, frame: Any) -> None:
        logger.warning("SIGTERM: checkpointing at the next step boundary, then exiting (again: exit at once)")
        trainer.request_stop("SIGTERM")
        signal.signal(signal.SIGTERM, signal.SIG_DFL)

    previous_term = signal.signal(signal.SIGTERM, on_sigterm) if _main_thread() else None
    loader = DataLoader(
        train_set, tcfg.train_batch_size, start_step=start_step, stop_step=tcfg.num_train_steps, rows=rows
    )
    record = _rows_recorder(rows, tcfg.train_batch_size)
    try:
        named = ((step, lm_batch(record(step, batch))) for step, batch in loader)
        state = trainer.train(state, named, eval_fn=eval_fn if validation else None)
    finally:
        loader.close()
        if previous_term is not None:
            signal.signal(signal.SIGTERM, previous_term)
    stopped = trainer.last_stop_reason
    steps = int(state.step)
    if steps > 0:
        checkpointer.on_step(state, steps, force=True)
    checkpointer.close()
    checkpoint_path = checkpointer.latest_checkpoint_path()

    hf_path = None
    if config.hf_save_path and stopped is None:
        hf_path = _export_hf(state.model, config.hf_save_path, data, model_config)
        outputs["hugging face export"] = hf_path

    sample_text = None
    if config.sample.num_tokens > 0 and stopped is None:
        sample_text = _sample(state.model, data, config.sample, jax.random.fold_in(state.training_key, 1))
        tracker.log_summary({"sample": sample_text})
    summary: dict[str, Any] = {"steps": steps}
    if losses:
        summary["final/train_loss"] = losses[-1]
    tracker.log_summary(summary | {f"final/eval/{k}": v for k, v in last_eval.items()})
    tracker.finish()
    return TrainResult(
        run_id=run_id,
        steps=steps,
        final_loss=losses[-1] if losses else None,
        eval_loss=dict(last_eval),
        checkpoint=checkpoint_path,
        resumed_from=resumed_from,
        hf_path=hf_path,
        sample=sample_text,
        stopped=stopped,
        outputs=outputs,
    )


def _main_thread() -> bool:
    import threading

    return threading.current_thread() is threading.main_thread()


def _export_hf(model: Any, path: str, data: Any, model_config: Any) -> str:
    from ponente.models.hf import save_pretrained
    from ponente.trainer.hf_tokenizer import HfTokenizerFiles

    where = _resolve(path)
    save_pretrained(
        model, where, tokenizer=HfTokenizerFiles(data.the_tokenizer, model_max_length=model_config.seq_len)
    )
    return where


def _sample(model: Any, data: Any, cfg: SampleConfig, key: Any) -> str:
    from ponente.trainer.sample import sample_tokens

    tokenizer = data.the_tokenizer
    prompt = tokenizer.encode(cfg.prompt).ids or [0]
    ids = sample_tokens(
        model,
        prompt,
        num_tokens=cfg.num_tokens,
        key=key,
        temperature=cfg.temperature,
        top_k=cfg.top_k,
        vocab_size=data.the_vocab_size,
    )
    return cfg.prompt + tokenizer.decode(ids)


def _run_id() -> str:
    import secrets

    return time.strftime("%Y%m%d-%H%M%S") + "-" + secrets.token_hex(3)


def _print_versions() -> None:
    import jax

    from ponente.trainer.versions import ponente_versions, runtime_versions

    for dist, version in ponente_versions().items():
        print(f"{dist} {version}")
    for dist, version in runtime_versions().items():
        print(f"  {dist} {version}")
    devices = jax.devices()
    print(f"JAX backend: {jax.default_backend()} with {len(devices)} device(s): {', '.join(map(str, devices))}")


def main(argv: Sequence[str] | None = None) -> int:
    """Run the entry point; returns the process exit code."""
    from ponente.trainer.config import parse_config

    args = list(sys.argv[1:] if argv is None else argv)
    if "--version" in args:
        _print_versions()
        return 0
    logging.basicConfig(
        level=os.environ.get("PONENTE_LOG_LEVEL", "INFO"), format="%(levelname)s %(name)s: %(message)s"
    )
    config = parse_config(TrainLmConfig, args, prog="ponente-train")
    result = train(config)
    print(f"run {result.run_id}: {result.steps} steps, final train loss {result.final_loss}")
    for name, loss in result.eval_loss.items():
        print(f"  eval {name}: {loss:.4f}")
    if result.checkpoint:
        print(f"  checkpoint: {result.checkpoint}")
    for name, where in result.outputs.items():
        print(f"  {name}: {where}")
    if result.sample is not None:
        print("  sample:")
        for line in result.sample.splitlines():
            print(f"    {line}")
    if result.stopped is not None:
        print(f"stopped early: {result.stopped}", file=sys.stderr)
        return PREEMPTED_EXIT_CODE
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
