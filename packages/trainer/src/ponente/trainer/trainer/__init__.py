"""The training loop: :class:`TrainerConfig` and :class:`Trainer` (jitted step, accumulation, metrics, hooks).

A :class:`Trainer` owns the device mesh and the two axis mappings (parameters are stored by one,
computation runs by the other), compiles one training step with ``named_jit`` and runs it in a loop
that measures throughput, calls hooks and stops cleanly on Ctrl-C and SIGTERM. The model, the loss and the
optimizer come from the caller, so the loop knows nothing about language models or trackers.

One concept per module, each importing only those below it:

- ``_loop``: :class:`Trainer` (the sharded state, batches onto devices, evaluation, the loop, its metrics) and
  :class:`NonFiniteLossError`.
- ``_step``: what one compiled step computes (loss, gradients accumulated over microbatches, update, metrics).
- ``_signals``: :func:`stop_on_signals`, the one place SIGINT and SIGTERM are handled.
- ``_mesh``: the ``(replica, data, expert, context, model)`` device mesh and the compiler settings.
- ``_batch``: a batch's static layout, size checks, token counts and microbatches (:func:`default_loss_weight`).
- ``_config``: :class:`TrainerConfig`.
- ``_quantization``: its ``quantization`` section (:class:`QuantizationConfig`, FP8/int8 products) and
  :func:`plain_model`, the unquantized model to export.
"""

from ._batch import default_loss_weight
from ._config import TrainerConfig
from ._loop import LossFn, NonFiniteLossError, Trainer
from ._quantization import QuantizationConfig, plain_model
from ._signals import stop_on_signals

__all__ = [
    "LossFn",
    "NonFiniteLossError",
    "QuantizationConfig",
    "Trainer",
    "TrainerConfig",
    "default_loss_weight",
    "plain_model",
    "stop_on_signals",
]
