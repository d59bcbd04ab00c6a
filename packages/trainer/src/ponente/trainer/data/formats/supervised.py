"""``data.format: supervised``: a prompt and a response per record; the response tokens are the targets."""

from __future__ import annotations

import dataclasses
from typing import TYPE_CHECKING

from ponente.datacache import BatchProcessor, CacheDataset, Dataset, PackedExampleDataset, SupervisedProcessor
from ponente.trainer.data.formats._base import LmDatasetFormat, check_field_name
from ponente.trainer.data.templates import read_template

if TYPE_CHECKING:
    from tokenizers import Tokenizer

    from ponente.trainer.data.tokens import TokenizerSpec

__all__ = ["SupervisedLmDatasetFormat"]


@LmDatasetFormat.register_subclass("supervised")
@dataclasses.dataclass(frozen=True)
class SupervisedLmDatasetFormat(LmDatasetFormat):
    """Instruction data: a prompt and a response per record (Levanter's ``supervised``).

    Rows: ``input_ids``, ``segment_ids``, a target-aligned ``loss_mask`` and restarting ``position_ids``. BOS goes
    before the prompt and EOS after the response, per ``data.enforce_bos``/``data.enforce_eos``.

    Attributes:
        input_field: The record field holding the prompt, when there is no ``prompt_template``.
        output_field: The record field holding the response.
        prompt_template: A Jinja template rendered over the record's fields to make the prompt (e.g. Alpaca's
            ``instruction``/``input``): inline text, or a path or ``package://`` URL of a ``.jinja`` file.
        mask_inputs: Train on the response tokens only; ``False``: on every token.
        pack: Pack several whole examples per row; ``False``: one example per row, padded.

    Example:
        ```yaml
        data:
          format: {type: supervised, input_field: question, output_field: answer}
        ```
    """

    input_field: str = "input"
    output_field: str = "output"
    prompt_template: str | None = None
    mask_inputs: bool = True
    pack: bool = True

    def __post_init__(self) -> None:
        """Raises ``ValueError`` naming the ``data.format`` key of an empty field name or a non-bool flag."""
        check_field_name(self, "input_field", "output_field")
        for key in ("mask_inputs", "pack"):
            if not isinstance(getattr(self, key), bool):
                raise ValueError(f"data.format.{key}: expected true or false, got {getattr(self, key)!r}")

    def processor(self, tokens: TokenizerSpec, folder: str | None) -> BatchProcessor:
        """A `SupervisedProcessor` (reads ``prompt_template`` when it names a file)."""
        del folder  # no paths inside the records
        eos = tokens.eos
        bos = tokens.bos
        return SupervisedProcessor(
            tokens.tokenizer,
            input_field=self.input_field,
            output_field=self.output_field,
            prompt_template=read_template(self.prompt_template, "data.format.prompt_template"),
            bos=bos,
            eos=eos,
            mask_inputs=self.mask_inputs,
            template_key="data.format.prompt_template",
        )

    def rows(self, cache: CacheDataset, seq_len: int, tokenizer: Tokenizer) -> Dataset[dict]:
        """Whole examples packed into rows of ``seq_len`` tokens (one per row when ``pack`` is off)."""
        del tokenizer
        return PackedExampleDataset(cache, seq_len, pack=self.pack)
