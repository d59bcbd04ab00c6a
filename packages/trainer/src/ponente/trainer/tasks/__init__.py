"""Tasks: what a :class:`~ponente.trainer.run.Run` trains, one module each.

A task (a :class:`~ponente.trainer.run.Task`) holds its resolved config and says how to build or load the model,
make a batch, compute the loss, evaluate and export; the run does everything else (start-up, restore, the loop,
checkpoints, hooks, signals). The tasks:

- :mod:`ponente.trainer.tasks.lm`: :class:`LmTask`, language-model pre-training (``train_lm``) and supervised /
  chat fine-tuning (``sft``), with the LM batch (:func:`~ponente.trainer.tasks.lm.lm_batch`) and loss
  (:func:`~ponente.trainer.tasks.lm.lm_loss_fn`);
- :mod:`ponente.trainer.tasks.lora`: :class:`LoraTask`, LoRA adapters of a Hugging Face checkpoint (``lora_lm``);
- :mod:`ponente.trainer.tasks.asr`: :class:`AsrTask`, Whisper speech recognition (``train_asr``).

:mod:`ponente.trainer.tasks.lm_eval` evaluates a finished language model on LM batches (``eval_lm``: loss,
perplexity, bits per byte).

A new kind of training (preference tuning, RL, ...) is one new module with one subclass of
:class:`~ponente.trainer.run.Task` (see the docs page "Adding a task").
"""

from ponente.trainer.run import Task

from .asr import AsrTask
from .lm import LmTask
from .lora import LoraTask

__all__ = ["AsrTask", "LmTask", "LoraTask", "Task"]
