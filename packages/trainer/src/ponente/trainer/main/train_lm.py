"""Train a language model: ``python -m ponente.trainer.main.train_lm --config_path gpt2_nano`` (``ponente-train``).

The configuration is a :class:`TrainLmConfig` (``data``, ``model``, ``trainer``, ``optimizer`` sections with
Levanter's key names) read from YAML files and dotted overrides; ``--help`` lists every field. A run:

1. opens (or builds, in the background) the token caches of ``data`` and packs rows of ``model.seq_len``;
2. builds the model and optimizer state (or resumes from the latest committed checkpoint of the run);
3. trains for ``trainer.num_train_steps`` steps, logging to the trackers, evaluating every
   ``trainer.steps_per_eval`` steps and checkpointing per ``trainer.checkpointer``;
4. saves a final checkpoint (and a Hugging Face export if ``hf_save_path`` is set), samples a short
   text when ``sample.num_tokens > 0``, and prints where everything went.

The steps shared with other entry points (provenance, restore, signals, export, ...) are in
:mod:`ponente.trainer.run`; this module says what is particular to language-model pre-training.
"""

from __future__ import annotations

import dataclasses
import sys
from collections.abc import Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any, Literal

from ponente.models import Gpt2Config, LmConfig
from ponente.trainer import run
from ponente.trainer.callbacks import as_hook
from ponente.trainer.data import LMDatasetConfig, LMMixtureDatasetConfig
from ponente.trainer.lm import lm_loss_fn
from ponente.trainer.optim import AdamConfig, OptimizerConfig
from ponente.trainer.run import PREEMPTED_EXIT_CODE, SampleConfig, TrainResult, config_differences
from ponente.trainer.trainer import Trainer, TrainerConfig

__all__ = [
    "PREEMPTED_EXIT_CODE",
    "SampleConfig",
    "TrainLmConfig",
    "TrainResult",
    "config_differences",
    "main",
    "train",
]

# the run-layer steps under the names this module had before they moved there (tests and users import them)
_eval_batches = run.eval_batches
_pad_vocab_for_partitioning = run.pad_vocab_for_partitioning
_process_age = run.process_age
_restore = run.restore


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
            materializing full logits (None: the plain loss; ``auto``: blockwise from
            ``ponente.models.lm.FUSED_LOSS_MIN_VOCAB`` (65536) vocabulary entries on, where the model allows it).
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
    cross_entropy_block_size: int | Literal["auto"] | None = "auto"
    data_seed: int | None = None
    hf_save_path: str | None = None
    hf_save_steps: int | None = None
    sample: SampleConfig = dataclasses.field(default_factory=SampleConfig)

    def __post_init__(self) -> None:
        if self.hf_save_steps is not None and self.hf_save_path is None:
            raise ValueError("hf_save_steps is set but hf_save_path is not; set hf_save_path too")
        if self.use_hf_model_config and self.initialize_from_hf is None:
            raise ValueError("use_hf_model_config needs initialize_from_hf")


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
    startup = run.Startup.since_process_start()
    run.start_distributed(config.trainer.distributed)  # before anything touches a device
    import jax

    import ponente.namedtensor as hax
    from ponente.trainer.tracker import init_trackers

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
    model_config = run.pad_vocab_for_partitioning(model_config, config.trainer, jax.device_count())
    Vocab = hax.Axis("vocab", data.the_vocab_size)
    seq_len = model_config.seq_len
    config = dataclasses.replace(run.with_run_id(config), model=model_config)
    tcfg = config.trainer
    record = run.RunRecord.of(config)
    startup.mark("config and tokenizer")

    # trackers are created before any other thread starts: the tensorboard tracker hides torch while it imports
    tracker = init_trackers(tcfg.tracker, record.run_id)
    startup.mark("trackers")
    # Until the first step, four things proceed at once (XLA compiles and tokenizers release the GIL): the
    # run record (git, pip freeze), the token caches (built in their own threads; the datasets wait for the
    # first rows), the compilation of the training step, and on this thread the initial state and checkpoint.
    with ThreadPoolExecutor(max_workers=3, thread_name_prefix="ponente-startup") as pool:
        recorded = startup.background(pool, "run record", record.write, tracker)
        checkpointer = tcfg.checkpointer.create(record.run_id, metadata=record.provenance)
        outputs = run.output_locations(record, checkpoints=checkpointer.run_path, trackers=tcfg.tracker)
        data_seed = tcfg.seed if config.data_seed is None else config.data_seed
        run.build_caches_once(data, tcfg)

        def datasets() -> tuple[Any, dict[str, Any]]:
            train_set = data.train_set(seq_len, seed=data_seed, batch_size=tcfg.train_batch_size)
            return train_set, data.validation_sets(seq_len)

        data_ready = startup.background(pool, "datasets (first cache rows)", datasets)
        trainer = Trainer(
            tcfg,
            config.optimizer.build(tcfg.num_train_steps),
            lm_loss_fn(config.z_loss_weight, config.cross_entropy_block_size),
            lr_schedule=config.optimizer.lr_scheduler(tcfg.num_train_steps),
            log_fn=lambda metrics, step: tracker.log(metrics, step=step),
            flops_per_token=model_config.flops_per_token(data.the_vocab_size),
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
            compile_args = (state, run.placeholder_batch(rows, seq_len))
            step_compiled = startup.background(pool, "train step compile", trainer.compile_step, *compile_args)
        state, resumed_from = run.restore(state, tcfg, checkpointer, record.provenance)
        startup.mark("checkpoint restore")
        recorded.result()
        # the log then holds each step once: records a killed run wrote after its last checkpoint are dropped
        tracker.resume_from(int(state.step))
        train_set, validation = data_ready.result()
        if step_compiled is not None:
            step_compiled.result()
        startup.mark("waiting for the background work")

    evaluator = run.Evaluator(trainer, validation, tcfg.max_eval_batches)
    losses: list[float] = []

    def on_step(info: Any) -> None:
        startup.first_step()
        if not info.final:
            losses.append(info.loss)
            checkpointer.on_step(info.state, info.step)
        if config.hf_save_steps and info.step % config.hf_save_steps == 0 and not info.final:
            _export_hf(info.state.model, f"{config.hf_save_path}/step-{info.step}", data, model_config)

    trainer.hooks.append(as_hook(on_step))
    state = run.train_on(trainer, state, train_set, rows=rows, eval_fn=evaluator if validation else None)
    stopped = trainer.last_stop_reason
    steps = int(state.step)
    checkpoint_path = run.final_checkpoint(checkpointer, state)

    hf_path = None
    if config.hf_save_path and stopped is None:
        hf_path = outputs["hugging face export"] = _export_hf(state.model, config.hf_save_path, data, model_config)
    sample = None
    if config.sample.num_tokens > 0 and stopped is None:
        key = jax.random.fold_in(state.training_key, 1)
        sample = run.sample_text(state.model, data.the_tokenizer, data.the_vocab_size, config.sample, key)
        tracker.log_summary({"sample": sample})
    final_loss = losses[-1] if losses else None
    run.finish_trackers(tracker, steps=steps, final_loss=final_loss, eval_loss=evaluator.last)
    return TrainResult(
        run_id=record.run_id,
        steps=steps,
        final_loss=final_loss,
        eval_loss=dict(evaluator.last),
        checkpoint=checkpoint_path,
        resumed_from=resumed_from,
        hf_path=hf_path,
        sample=sample,
        stopped=stopped,
        outputs=outputs,
    )


def _export_hf(model: Any, path: str, data: Any, model_config: LmConfig) -> str:
    where = run.resolve_path(path)
    return run.export_hf(model, where, tokenizer=data.the_tokenizer, seq_len=model_config.seq_len)


def main(argv: Sequence[str] | None = None) -> int:
    """Run the entry point; returns the process exit code."""
    if "--version" in (sys.argv[1:] if argv is None else argv):
        run.print_versions()
        return 0
    return run.print_result(train(run.parse_command_line(TrainLmConfig, argv, prog="ponente-train")))


if __name__ == "__main__":
    raise SystemExit(main())
