"""The run: one :class:`Run` trains a :class:`Task`, so that an entry point is parse config → pick task → train.

A training entry point (``train_lm``, ``sft``, ``lora_lm``, ``train_asr``) is::

    startup = start_run(config.trainer)         start-up timing; partitionable PRNG, jax.distributed
    task = LmTask(config)                       ponente.trainer.tasks: the model, batches, loss, evaluation, exports
    return Run(task, startup).train()           record, caches, state, compile, restore, loop, checkpoints, export

and :func:`command_line_main` runs it from the command line (``--help``, ``--version``, one-line errors, the exit
code of :class:`TrainResult`: 0, ``trainer.preemption_exit_code`` after SIGTERM/Ctrl-C, 1 after a non-finite loss).

:meth:`Run.train` reads top to bottom and calls the task's methods (:class:`Task`); each step it takes is a plain
function of a private module here: ``_startup`` (``jax.distributed``, vocabulary padding, batch size, start-up
timing), ``_provenance`` (run id, run record, config differences), ``_data`` (caches built once across
processes), ``_pretrained`` (Hugging Face weights), ``_restore`` (resume or initialize), ``_training`` (the loop
over the loader), ``_evaluation`` (:class:`Evaluator`), ``_export``, ``_result`` (final checkpoint, trackers'
summary, outputs, :class:`TrainResult` and its exit code). The tools that
read a finished run (``export_lm_to_hf``, ``eval_lm``, ``viz_logprobs``) use :func:`parse_run_command_line` and
:func:`load_model_of` (a Hugging Face folder or a checkpoint). Heavy imports (JAX, models) happen inside the
functions, so importing this package is cheap for entry points that never touch a device (``cache_dataset``).
"""

from ._cli import check_inputs, command_line_main, parse_command_line, print_versions, run_cli, tool_main
from ._data import check_training_data
from ._eval_harness import eval_harness_hook
from ._evaluation import Evaluator, eval_batches
from ._export import export_folder, export_hf
from ._pretrained import hf_model_config, hf_vocab_size, load_hf_weights
from ._provenance import config_differences
from ._restore import ModelSource, find_checkpoint, load_model_from_checkpoint, load_model_of
from ._result import PREEMPTED_EXIT_CODE, TrainResult, resolve_path, stop_exit_code
from ._run import Run, start_run
from ._run_config import check_run_inputs, parse_run_command_line
from ._sampling import SampleConfig, sample_text
from ._startup import check_context_parallel, check_expert_parallel, pad_vocab_for_partitioning
from ._task import RunContext, Task, TaskConfig
from ._viz_logprobs import VizLogprobsConfig, logprob_pages

__all__ = [
    "PREEMPTED_EXIT_CODE",
    "Evaluator",
    "ModelSource",
    "Run",
    "RunContext",
    "SampleConfig",
    "Task",
    "TaskConfig",
    "TrainResult",
    "VizLogprobsConfig",
    "check_context_parallel",
    "check_expert_parallel",
    "check_inputs",
    "check_run_inputs",
    "check_training_data",
    "command_line_main",
    "config_differences",
    "eval_batches",
    "eval_harness_hook",
    "export_folder",
    "export_hf",
    "find_checkpoint",
    "hf_model_config",
    "hf_vocab_size",
    "load_hf_weights",
    "load_model_from_checkpoint",
    "load_model_of",
    "logprob_pages",
    "pad_vocab_for_partitioning",
    "parse_command_line",
    "parse_run_command_line",
    "print_versions",
    "resolve_path",
    "run_cli",
    "sample_text",
    "start_run",
    "stop_exit_code",
    "tool_main",
]
