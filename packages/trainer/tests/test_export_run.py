"""``ponente-export-lm-to-hf`` exports a run as it is: model and tokenizer from the run's recorded configuration."""

import dataclasses
import json
import logging
import re
import subprocess
import sys
import time

import numpy as np
import pytest
from run_support import TINY_MODEL, TinyRun, shared_tiny_run

from ponente.trainer.data import data_tokenizer, data_vocab_size
from ponente.trainer.main import export_lm_to_hf


@pytest.fixture(scope="module")
def run(tmp_path_factory: pytest.TempPathFactory) -> TinyRun:
    return shared_tiny_run(tmp_path_factory)


def _assert_export_is_the_run(out, run: TinyRun) -> None:
    """The folder loads in transformers with the logits of the run's model (read with the checkpoint API and the
    run's own configuration), and its tokenizer is the run's."""
    import equinox as eqx
    import jax
    import torch
    import transformers

    import ponente.namedtensor as hax
    from ponente.models import AttentionMask
    from ponente.trainer.checkpoint import load_checkpoint

    vocab = data_vocab_size(run.config.data)
    template = eqx.filter_eval_shape(
        lambda: run.config.model.build(hax.Axis("vocab", vocab), key=jax.random.PRNGKey(0))
    )
    ours = load_checkpoint(template, str(run.checkpoint), subpath="model")
    ids = np.random.default_rng(0).integers(0, vocab, size=(2, TINY_MODEL["seq_len"]))
    expected = np.asarray(ours(hax.named(ids, ("batch", "position")), AttentionMask.causal()).array)
    hf_config = json.loads((out / "config.json").read_text())
    assert (hf_config["n_layer"], hf_config["n_embd"]) == (TINY_MODEL["num_layers"], TINY_MODEL["hidden_dim"])
    hf_model = transformers.AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32).eval()
    with torch.no_grad():
        got = hf_model(torch.tensor(ids)).logits.numpy()
    np.testing.assert_allclose(got, expected, atol=1e-4)
    tokenizer = transformers.AutoTokenizer.from_pretrained(out)
    assert tokenizer("ROMEO: To be")["input_ids"] == data_tokenizer(run.config.data).encode("ROMEO: To be").ids


def test_run_folder_alone_exports_the_run(run, tmp_path, capsys):
    out = tmp_path / "hf"
    assert export_lm_to_hf.main(["--checkpoint_path", str(run.checkpoints), "--output_dir", str(out)]) == 0
    assert capsys.readouterr().out.strip() == f"wrote {out}"
    _assert_export_is_the_run(out, run)


def test_the_training_file_is_accepted(run, tmp_path, caplog):
    out = tmp_path / "hf"
    argv = [
        "--config_path",
        str(run.training_file),
        "--checkpoint_path",
        str(run.checkpoint),
        "--output_dir",
        str(out),
    ]
    with caplog.at_level(logging.INFO, logger="ponente.trainer.run"):
        assert export_lm_to_hf.main(argv) == 0
    assert f"{run.training_file}: ignoring the training settings trainer, optimizer, sample" in caplog.text
    _assert_export_is_the_run(out, run)


def test_unknown_keys_of_a_training_file_are_still_errors(run, tmp_path, capsys):
    bad = tmp_path / "bad.yaml"
    bad.write_text(run.training_file.read_text() + "modle:\n  num_layers: 2\n")
    argv = ["--config_path", str(bad), "--checkpoint_path", str(run.checkpoint), "--output_dir", str(tmp_path / "x")]
    assert export_lm_to_hf.main(argv) == 2
    assert capsys.readouterr().err.startswith("error: modle: unknown key")


def _shape_error(err: str) -> tuple[str, tuple[int, ...], tuple[int, ...]]:
    (line,) = err.strip().splitlines()
    match = re.fullmatch(
        r"error: model: checkpoint parameter (\S+) has shape \(([\d, ]+)\), the configured model expects "
        r"\(([\d, ]+)\)( \(\d+ more parameters differ\))?",
        line,
    )
    assert match, line
    return match[1], tuple(map(int, match[2].split(","))), tuple(map(int, match[3].split(",")))


def _stored_shape(run: TinyRun, name: str) -> tuple[int, ...]:
    leaves = json.loads((run.checkpoint / "metadata.json").read_text())["leaves"]
    return tuple(leaves[f"model.{name}"]["shape"])


def test_a_model_that_is_not_the_checkpoints_names_parameter_and_shapes(run, tmp_path, capsys):
    # the packaged hello world's model is 4 layers of width 128; the run trained 2 layers of width 32
    out = tmp_path / "hf"
    argv = ["--config_path", "gpt2_nano", "--checkpoint_path", str(run.checkpoint), "--output_dir", str(out)]
    assert export_lm_to_hf.main(argv) == 2
    name, found, expected = _shape_error(capsys.readouterr().err)
    assert found == _stored_shape(run, name)
    assert 128 in expected
    assert 128 not in found
    assert not out.exists()

    # an override of the recorded model: the stacked layer axis is 3, the checkpoint's is 2
    argv = ["--checkpoint_path", str(run.checkpoints), "--output_dir", str(out), "--model.num_layers", "3"]
    assert export_lm_to_hf.main(argv) == 2
    name, found, expected = _shape_error(capsys.readouterr().err)
    assert found == _stored_shape(run, name)
    assert (found[0], expected[0]) == (2, 3)
    assert found[1:] == expected[1:]


@pytest.mark.parametrize("config", [[], ["--config_path", "gpt2_nano"]])
def test_missing_checkpoint_is_one_line_before_the_hub(tmp_path, capsys, monkeypatch, config):
    # the hub is unreachable and not offline: touching it (the default tokenizer "gpt2") would retry for long
    monkeypatch.setenv("HF_HUB_OFFLINE", "0")
    monkeypatch.setenv("HF_ENDPOINT", "http://127.0.0.1:9")
    missing = tmp_path / "nonexistent"
    begun = time.perf_counter()
    code = export_lm_to_hf.main([*config, "--checkpoint_path", str(missing), "--output_dir", str(tmp_path / "x")])
    assert time.perf_counter() - begun < 2
    assert (code, capsys.readouterr().err) == (1, f"error: no checkpoint at {missing} (checkpoint_path)\n")


def test_incomplete_checkpoint_is_named(tmp_path, capsys):
    (tmp_path / "run" / "step-7").mkdir(parents=True)
    (tmp_path / "run" / "step-7" / "process-0.json").write_text("{}")
    assert export_lm_to_hf.main(["--checkpoint_path", str(tmp_path / "run"), "--output_dir", str(tmp_path / "x")]) == 1
    assert capsys.readouterr().err == (
        f"error: no committed checkpoint at {tmp_path / 'run'} (checkpoint_path): step-7 is incomplete "
        "(no metadata.json; the run may have been stopped while writing)\n"
    )


def test_checkpoint_without_a_recorded_configuration_asks_for_one(tmp_path, capsys):
    from ponente.trainer.checkpoint import save_checkpoint

    where = save_checkpoint({"model": {"w": np.zeros(3, np.float32)}}, str(tmp_path / "step-1"), step=1)
    assert export_lm_to_hf.main(["--checkpoint_path", where, "--output_dir", str(tmp_path / "x")]) == 2
    assert capsys.readouterr().err == (
        f"error: model: checkpoint {where} records no configuration; pass the run's training config with "
        "--config_path (or --model.* options)\n"
    )


def test_console_script_exit_status_and_one_line(tmp_path):
    missing = tmp_path / "nonexistent"
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "ponente.trainer.main.export_lm_to_hf",
            "--checkpoint_path",
            str(missing),
            "--output_dir",
            "x",
        ],
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 1, proc.stderr
    assert "Traceback" not in proc.stderr
    assert proc.stderr.strip().splitlines()[-1] == f"error: no checkpoint at {missing} (checkpoint_path)"


def test_parameters_load_in_the_dtype_the_checkpoint_stores(tmp_path):
    # a run with trainer.mp p=bf16 stores bfloat16 parameters; the configured model is built in float32
    import equinox as eqx
    import jax
    import jax.numpy as jnp

    import ponente.namedtensor as hax
    from ponente.models import Gpt2Config
    from ponente.trainer.checkpoint import save_checkpoint
    from ponente.trainer.run import load_model_from_checkpoint

    config = Gpt2Config(seq_len=8, hidden_dim=8, intermediate_dim=16, num_layers=2, num_heads=2, num_kv_heads=2)
    shapes = eqx.filter_eval_shape(lambda: config.build(hax.Axis("vocab", 20), key=jax.random.PRNGKey(1)))
    rng = np.random.default_rng(0)
    bf16 = jax.tree_util.tree_map(  # random values, stored as bfloat16 (building a model eagerly is slow)
        lambda x: jnp.asarray(rng.normal(size=x.shape), jnp.bfloat16) if isinstance(x, jax.ShapeDtypeStruct) else x,
        shapes,
    )
    where = save_checkpoint({"model": bf16}, str(tmp_path / "step-1"), step=1)
    loaded = load_model_from_checkpoint(config, None, str(tmp_path))  # the vocabulary size from the checkpoint
    ours, theirs = jax.tree_util.tree_leaves(loaded), jax.tree_util.tree_leaves(bf16)
    assert [x.dtype for x in ours] == [x.dtype for x in theirs]
    assert np.dtype(jnp.bfloat16) in {x.dtype for x in ours}
    for a, b in zip(ours, theirs, strict=True):
        np.testing.assert_array_equal(np.asarray(a, np.float32), np.asarray(b, np.float32))

    with pytest.raises(ValueError, match=r"^model: checkpoint parameter transformer\.h\.stacked\.\S+ has shape \(2,"):
        load_model_from_checkpoint(dataclasses.replace(config, num_layers=3), None, where)
