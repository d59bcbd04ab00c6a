"""The run layer: the steps every entry point composes, so that an entry point is a short recipe.

A language-model entry point (``train_lm``, ``sft``, ``lora_lm``) is three calls::

    config = parse_command_line(Config, argv, prog=...)   command line -> frozen config, logging set up
    startup = start_run(config.trainer)                    start-up timing; partitionable PRNG, jax.distributed
    result = train_language_model(config, LmRecipe(...), startup)
    return print_result(result)                            the exit code: 0, trainer.preemption_exit_code (0) when
                                                           stopped early (running it again resumes), 1 when
                                                           stopped by a non-finite loss

where the :class:`LmRecipe` names what is particular to the entry point: the model config (e.g.
``hf_model_config(path)`` of a Hugging Face checkpoint), the weights it starts from (``initialize_from_hf``),
adapters and which parameters train (LoRA), the exports (``hf_exporter(path, ...)`` or the entry point's own)
and how often. :func:`train_language_model` turns the recipe into a :class:`RunTask` (how to build the model,
the loss, rows to batches, the datasets, evaluation, hooks, exports) and :func:`run_task` runs it; the speech
entry point (``train_asr``) does the same with an :class:`AsrRecipe` and :func:`train_speech_model` (Whisper
batches, the transcript loss, the greedy WER of :class:`SpeechEvaluator`). :func:`run_task` takes the shared
steps in this order::

    pad_vocab_for_partitioning(model, trainer, n)     vocab axis divisible by its shards
    resolve_train_batch_size(trainer, n)              train_batch_size -1: per_device_parallelism x data devices
    config = with_run_id(config)                      trainer.id kept or generated
    record = RunRecord.of(config)                     run id, resolved config, provenance
    record.write(tracker)                             config.yaml, git SHA, pip freeze (in the background)
    build_caches_once(data, trainer)                  process 0 builds the caches, the others follow
    Trainer.initial_state(model_init, is_trainable=...)
    compile_step(state, placeholder_batch(rows, seq_len, fields=batch_fields(data)))   (in the background)
    replace_model(state, load_hf_weights(...))        pretrained weights, placed like the initial state
    restore(state, trainer, checkpointer, record.provenance)
                                                      resume (reporting config differences) or initialize
    train_on(trainer, state, train_set, rows=..., eval_fn=Evaluator(...))
                                                      SIGTERM stops at a step boundary; exports every N steps;
                                                      logprob_pages(recipe.viz_logprobs, ...) draws validation rows;
                                                      eval_harness_hook(recipe.eval_harness, ...) scores lm-eval tasks
    final_checkpoint(checkpointer, state)             save, wait, latest committed checkpoint
    recipe.export(model, None)                        e.g. export_hf(model, path, tokenizer=..., seq_len=...)
    sample_text(model, tokenizer, vocab_size, SampleConfig(...), key)
    finish_trackers(tracker, steps=..., final_loss=..., eval_loss=...)

Each step is a plain function (or a small class) over the public interfaces of ``ponente.trainer``
(``TrainerConfig``, ``Trainer``, the checkpointer, the trackers, the data configs); nothing here holds
global state. Heavy imports (JAX, models) happen inside the functions, so that importing this package is
cheap for entry points that never touch a device (``cache_dataset``).
"""

from ._asr import (
    AsrRecipe,
    SpeechEvaluator,
    WerConfig,
    check_speech_shapes,
    export_whisper,
    hf_whisper_config,
    train_speech_model,
    whisper_batch,
    whisper_exporter,
    whisper_loss,
)
from ._cli import (
    LOG_FORMAT,
    LOG_LEVEL_ENV,
    check_inputs,
    command_line_main,
    parse_command_line,
    print_versions,
    run_cli,
)
from ._core import Exporter, RunContext, RunTask, TaskRunConfig, run_task
from ._data import RECORD_ROWS_ENV, build_caches_once, rows_recorder
from ._devices import pad_vocab_for_partitioning, resolve_train_batch_size, start_distributed
from ._differences import FIXED_ON_RESUME, config_differences
from ._eval_harness import eval_harness_hook
from ._evaluation import Evaluator, eval_batches
from ._export import export_hf, hf_exporter
from ._finish import final_checkpoint, finish_trackers
from ._outputs import output_locations, resolve_path
from ._pretrained import hf_model_config, hf_vocab_size, load_hf_weights, replace_model
from ._provenance import RunConfig, RunRecord, new_run_id, with_run_id
from ._recipe import LmRecipe, LmRunConfig, check_training_data, row_length, start_run, train_language_model
from ._restore import find_checkpoint, load_model_from_checkpoint, restore
from ._result import TrainResult, print_result
from ._run_config import check_run_inputs, parse_run_command_line, recorded_config
from ._sampling import SampleConfig, sample_text
from ._signals import NONFINITE_STOP, PREEMPTED_EXIT_CODE, stop_exit_code, stop_on_sigterm
from ._startup import Startup, process_age
from ._training import EXAMPLE_FIELDS, TEXT_FIELDS, batch_fields, placeholder_batch, placeholder_rows, train_on
from ._viz_logprobs import VizLogprobsConfig, logprob_pages

__all__ = [
    "EXAMPLE_FIELDS",
    "FIXED_ON_RESUME",
    "LOG_FORMAT",
    "LOG_LEVEL_ENV",
    "NONFINITE_STOP",
    "PREEMPTED_EXIT_CODE",
    "RECORD_ROWS_ENV",
    "TEXT_FIELDS",
    "AsrRecipe",
    "Evaluator",
    "Exporter",
    "LmRecipe",
    "LmRunConfig",
    "RunConfig",
    "RunContext",
    "RunRecord",
    "RunTask",
    "SampleConfig",
    "SpeechEvaluator",
    "Startup",
    "TaskRunConfig",
    "TrainResult",
    "VizLogprobsConfig",
    "WerConfig",
    "batch_fields",
    "build_caches_once",
    "check_inputs",
    "check_run_inputs",
    "check_speech_shapes",
    "check_training_data",
    "command_line_main",
    "config_differences",
    "eval_batches",
    "eval_harness_hook",
    "export_hf",
    "export_whisper",
    "final_checkpoint",
    "find_checkpoint",
    "finish_trackers",
    "hf_exporter",
    "hf_model_config",
    "hf_vocab_size",
    "hf_whisper_config",
    "load_hf_weights",
    "load_model_from_checkpoint",
    "logprob_pages",
    "new_run_id",
    "output_locations",
    "pad_vocab_for_partitioning",
    "parse_command_line",
    "parse_run_command_line",
    "placeholder_batch",
    "placeholder_rows",
    "print_result",
    "print_versions",
    "process_age",
    "recorded_config",
    "replace_model",
    "resolve_path",
    "resolve_train_batch_size",
    "restore",
    "row_length",
    "rows_recorder",
    "run_cli",
    "run_task",
    "sample_text",
    "start_distributed",
    "start_run",
    "stop_exit_code",
    "stop_on_sigterm",
    "train_language_model",
    "train_on",
    "train_speech_model",
    "whisper_batch",
    "whisper_exporter",
    "whisper_loss",
    "with_run_id",
]
