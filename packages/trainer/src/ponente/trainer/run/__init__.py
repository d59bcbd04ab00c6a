"""The run layer: the steps every entry point composes, so that an entry point is a short recipe.

A training run, in the order :mod:`ponente.trainer.main.train_lm` takes the steps::

    parse_command_line(Config, argv, prog=...)        command line -> frozen config, logging set up
    Startup.since_process_start()                     start-up phase timing (logged at the first step)
    start_distributed(config.trainer.distributed)     partitionable PRNG, jax.distributed
    pad_vocab_for_partitioning(model, trainer, n)     vocab axis divisible by its shards
    config = with_run_id(config)                      trainer.id kept or generated
    record = RunRecord.of(config)                     run id, resolved config, provenance
    record.write(tracker)                             config.yaml, git SHA, pip freeze (in the background)
    build_caches_once(data, trainer)                  process 0 builds the caches, the others follow
    restore(state, trainer, checkpointer, record.provenance)
                                                      resume (reporting config differences) or initialize
    train_on(trainer, state, train_set, rows=..., eval_fn=Evaluator(...))
                                                      SIGTERM stops at a step boundary
    final_checkpoint(checkpointer, state)             save, wait, latest committed checkpoint
    export_hf(model, path, tokenizer=..., seq_len=...)
    sample_text(model, tokenizer, vocab_size, SampleConfig(...), key)
    finish_trackers(tracker, steps=..., final_loss=..., eval_loss=...)
    print_result(TrainResult(...))                    the exit code: 0, or PREEMPTED_EXIT_CODE (75) when stopped
                                                      early; running it again resumes

Each step is a plain function (or a small class) over the public interfaces of ``ponente.trainer``
(``TrainerConfig``, ``Trainer``, the checkpointer, the trackers, the data configs); nothing here holds
global state. Heavy imports (JAX, models) happen inside the functions, so that importing this package is
cheap for entry points that never touch a device (``cache_dataset``).
"""

from ._cli import LOG_FORMAT, LOG_LEVEL_ENV, parse_command_line, print_versions
from ._data import RECORD_ROWS_ENV, build_caches_once, rows_recorder
from ._devices import pad_vocab_for_partitioning, start_distributed
from ._differences import FIXED_ON_RESUME, config_differences
from ._evaluation import Evaluator, eval_batches
from ._export import export_hf
from ._finish import final_checkpoint, finish_trackers
from ._outputs import output_locations, resolve_path
from ._provenance import RunConfig, RunRecord, new_run_id, with_run_id
from ._restore import load_model_from_checkpoint, restore
from ._result import TrainResult, print_result
from ._sampling import SampleConfig, sample_text
from ._signals import PREEMPTED_EXIT_CODE, stop_on_sigterm
from ._startup import Startup, process_age
from ._training import placeholder_batch, train_on

__all__ = [
    "FIXED_ON_RESUME",
    "LOG_FORMAT",
    "LOG_LEVEL_ENV",
    "PREEMPTED_EXIT_CODE",
    "RECORD_ROWS_ENV",
    "Evaluator",
    "RunConfig",
    "RunRecord",
    "SampleConfig",
    "Startup",
    "TrainResult",
    "build_caches_once",
    "config_differences",
    "eval_batches",
    "export_hf",
    "final_checkpoint",
    "finish_trackers",
    "load_model_from_checkpoint",
    "new_run_id",
    "output_locations",
    "pad_vocab_for_partitioning",
    "parse_command_line",
    "placeholder_batch",
    "print_result",
    "print_versions",
    "process_age",
    "resolve_path",
    "restore",
    "rows_recorder",
    "sample_text",
    "start_distributed",
    "stop_on_sigterm",
    "train_on",
    "with_run_id",
]
