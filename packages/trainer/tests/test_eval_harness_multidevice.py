"""The lm-eval adapter on a model sharded like training (8 simulated devices) answers as on one device.

Run in the multidevice session (``XLA_FLAGS=--xla_force_host_platform_device_count=8``).
"""

from __future__ import annotations

from pathlib import Path

import jax
import pytest

pytest.importorskip("lm_eval", reason="needs the eval extra (pip install 'ponente-trainer[eval]')")

from finetune_support import write_tiny_llama

pytestmark = pytest.mark.multidevice


def test_sharded_answers_equal_single_device_answers(tmp_path: Path) -> None:
    from lm_eval.api.instance import Instance
    from tokenizers import Tokenizer

    import ponente.namedtensor as hax
    from ponente.models.hf import load_pretrained
    from ponente.namedtensor.partitioning import make_mesh
    from ponente.trainer.eval_harness.adapter import PonenteLM
    from ponente.trainer.trainer import TrainerConfig

    if jax.device_count() < 8:
        pytest.fail("needs 8 devices: XLA_FLAGS=--xla_force_host_platform_device_count=8")
    folder = write_tiny_llama(tmp_path / "tiny", seed=2)
    tokenizer = Tokenizer.from_file(str(folder / "tokenizer.json"))
    model = load_pretrained(folder)
    contexts = ["Write a short poem about", "Give three tips for", "What is the capital of", "Explain"]
    likelihood = [
        Instance("loglikelihood", {}, (c, cont), i)
        for i, (c, cont) in enumerate((c, cont) for c in contexts for cont in (" the sea", " staying healthy"))
    ]
    generation = [
        Instance("generate_until", {}, (c, {"until": ["\n"], "max_gen_toks": 5}), i) for i, c in enumerate(contexts)
    ]

    single = PonenteLM(model, tokenizer, batch_size=4)
    expected_ll, expected_text = single.loglikelihood(likelihood), single.generate_until(generation)

    config = TrainerConfig(model_axis_size=2, fsdp_axis="embed")
    mesh = make_mesh({"replica": 1, "data": -1, "model": 2})
    sharded_model = hax.shard(model, config.parameter_axis_mapping, mesh)
    assert len(jax.tree_util.tree_leaves(sharded_model)[0].sharding.device_set) > 1
    sharded = PonenteLM(
        sharded_model,
        tokenizer,
        batch_size=4,
        mesh=mesh,
        axis_mapping=config.compute_axis_mapping,
        parameter_axis_mapping=config.parameter_axis_mapping,
    )
    got_ll, got_text = sharded.loglikelihood(likelihood), sharded.generate_until(generation)
    for (logprob, greedy), (ref_logprob, ref_greedy) in zip(got_ll, expected_ll, strict=True):
        assert logprob == pytest.approx(ref_logprob, abs=1e-4)
        assert greedy == ref_greedy
    assert got_text == expected_text
