"""The LoRA task: a language model with low-rank adapters, only the adapters training (``lora_lm``).

:class:`LoraTask` is the :class:`~ponente.trainer.tasks.lm.LmTask` of the Hugging Face checkpoint
``initialize_from_hf`` with adapters on the linear layers ``lora.target_modules`` selects; the loss sees the
adapters' dropout keys; it exports the PEFT adapter and the merged model.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from ponente.trainer.run import hf_model_config, hf_vocab_size, resolve_path

from .lm import LmTask, lm_loss_fn, row_length

if TYPE_CHECKING:
    from ponente.models.lora import LoraConfig

__all__ = ["LoraTask"]


class LoraTask(LmTask):
    """Train LoRA adapters of a Hugging Face checkpoint (a ``LoraLmConfig``: Levanter's ``lora_lm`` keys).

    Call :func:`~ponente.trainer.run.start_run` first: the vocabulary is padded for the devices' mesh.

    Args:
        config: the configuration (``initialize_from_hf``: set, ``lora``, ``data``, ``trainer``, ``optimizer``,
            ``peft_save_path``, ``merged_hf_save_path``, ``hf_save_steps``, ``max_train_length``, ...).

    Raises:
        ValueError: if ``data`` names no training data.
    """

    log_parameter_counts = True

    def __init__(self, config: Any) -> None:
        import jax

        from ponente.trainer.run import check_training_data

        check_training_data(config.data, hint="data.train_urls=[my_data.jsonl]")
        path = config.initialize_from_hf
        model_config = hf_model_config(path)
        self._setup(
            config, model_config, hf_vocab_size(path), row_length(model_config.seq_len, config.max_train_length)
        )
        self.lora: LoraConfig = config.lora
        self.peft_save_path: str | None = config.peft_save_path
        self.merged_hf_save_path: str | None = config.merged_hf_save_path
        self.export_every = config.hf_save_steps
        self.sample = None
        self._loss_fn = lm_loss_fn()  # no z-loss, the default (blockwise where it pays) cross-entropy
        # the adapters' key derives from trainer.seed, so a built and a loaded model get the same adapters
        self.adapt_key = jax.random.fold_in(jax.random.PRNGKey(config.trainer.seed), 1)

    def adapted(self, model: Any) -> Any:
        """``model`` with fresh adapters (``lora``)."""
        from ponente.models.lora import loraize

        return loraize(model, self.lora, key=self.adapt_key)

    def build_model(self, key: Any) -> Any:
        """A freshly initialized model of the checkpoint's config, with adapters."""
        return self.adapted(super().build_model(key))

    def pretrained_model(self, mp: Any) -> Any | None:
        """The checkpoint's weights, with adapters."""
        return self.adapted(super().pretrained_model(mp))

    def trainable(self) -> Any:
        """Only the adapters train (read from the shapes of :meth:`build_model` alone)."""
        import equinox as eqx
        import jax

        from ponente.models.lora import lora_trainable_filter

        return lora_trainable_filter(eqx.filter_eval_shape(self.build_model, jax.random.PRNGKey(0)))

    def loss(self, model: Any, batch: Any, *, key: Any) -> Any:
        """The next-token loss of the model with the step's dropout keys in its adapters."""
        return super().loss(self.eval_model(model, key), batch, key=key)

    def eval_model(self, model: Any, key: Any = None) -> Any:
        """The model with the dropout keys of ``key`` in its adapters (None, when evaluating: no dropout)."""
        from ponente.models.lora import with_dropout_keys

        return with_dropout_keys(model, key)

    def export(self, model: Any, subfolder: str | None) -> dict[str, str]:
        """The PEFT adapter at ``peft_save_path`` and the merged model at ``merged_hf_save_path``, as set."""
        from ponente.models.hf import save_peft_pretrained
        from ponente.models.lora import merge_lora

        written: dict[str, str] = {}
        if self.peft_save_path is not None:
            where = resolve_path(self.peft_save_path + ("" if subfolder is None else f"/{subfolder}"))
            save_peft_pretrained(model, self.lora, where, base_model_name_or_path=self.initialize_from_hf)
            written["peft adapter"] = where
        if self.merged_hf_save_path:
            written["hugging face export"] = self._export_hf(merge_lora(model), self.merged_hf_save_path, subfolder)
        return written
