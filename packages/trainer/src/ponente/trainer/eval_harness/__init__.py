"""EleutherAI's ``lm-eval`` harness on Ponente models (the ``eval`` extra: ``pip install 'ponente-trainer[eval]'``).

- :class:`EvalHarnessConfig`: which tasks, how many documents, how often during training (no ``lm_eval`` needed
  to read it);
- :class:`~ponente.trainer.eval_harness.adapter.PonenteLM` (in ``ponente.trainer.eval_harness.adapter``, which
  imports ``lm_eval``): a model and its tokenizer answering lm-eval's ``loglikelihood``,
  ``loglikelihood_rolling`` and ``generate_until`` requests;
- :func:`run_harness`: ``lm_eval.simple_evaluate`` over the configured tasks (local task YAMLs from
  ``include_path``); :func:`harness_metrics` flattens the scores to ``lm_eval/<task>/<metric>`` for the
  trackers; :func:`write_results` writes them as JSON.

Example::

    from ponente.models.hf import load_pretrained
    from ponente.trainer.eval_harness import EvalHarnessConfig, run_harness
    from ponente.trainer.eval_harness.adapter import PonenteLM
    from tokenizers import Tokenizer

    lm = PonenteLM(load_pretrained(folder), Tokenizer.from_file(f"{folder}/tokenizer.json"), tokenizer_folder=folder)
    results = run_harness(lm, EvalHarnessConfig(tasks=["my_task"], include_path="tasks/"))
"""

from .config import MISSING_EXTRA, EvalHarnessConfig
from .harness import harness_metrics, run_harness, task_manager, write_results

__all__ = ["MISSING_EXTRA", "EvalHarnessConfig", "harness_metrics", "run_harness", "task_manager", "write_results"]
