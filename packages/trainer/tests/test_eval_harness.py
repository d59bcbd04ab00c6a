"""lm-eval on Ponente models: the same answers as lm-eval's own Hugging Face backend, offline.

Every comparison runs the same tasks (local YAML files over a local jsonl) on the same weights: the Ponente
model through ``ponente-eval-harness`` / the training callback, and the exported folder through
``lm_eval.simple_evaluate(model="hf", ...)`` (transformers, float32).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("lm_eval", reason="needs the eval extra (pip install 'ponente-trainer[eval]')")

from eval_harness_support import GEN_TASK, MC_TASK, ROLLING_TASK, export_tiny_model, write_tasks
from finetune_support import supervised_overrides, write_tiny_llama

from ponente.trainer.eval_harness import EvalHarnessConfig, harness_metrics

MAX_LENGTH = 32
"""Short enough that rolling windows split the longer documents and long contexts are truncated."""


@pytest.fixture(autouse=True)
def _offline(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("HF_DATASETS_OFFLINE", "1")
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")


@pytest.fixture(scope="module")
def exported(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    directory = tmp_path_factory.mktemp("eval_harness")
    return export_tiny_model(directory), write_tasks(directory / "tasks")


def hf_backend(folder: Path, tasks_dir: Path, tasks: list[str], *, max_length: int | None = None) -> dict[str, Any]:
    """The tasks run by lm-eval's Hugging Face backend on ``folder`` (float32, CPU), with samples."""
    import lm_eval
    from lm_eval.tasks import TaskManager

    args = f"pretrained={folder},dtype=float32" + (f",max_length={max_length}" if max_length else "")
    results = lm_eval.simple_evaluate(
        model="hf",
        model_args=args,
        device="cpu",
        batch_size=4,
        tasks=tasks,
        task_manager=TaskManager(include_path=str(tasks_dir), include_defaults=False),
        bootstrap_iters=0,
        log_samples=True,
    )
    assert results is not None
    return dict(results)


def responses(results: dict[str, Any], task: str) -> list[Any]:
    """Each document's raw answers (doc order), as JSON would hold them (tuples as lists)."""
    samples = sorted(results["samples"][task], key=lambda s: s["doc_id"])
    return [json.loads(json.dumps(s["resps"])) for s in samples]


def test_eval_harness_command_matches_the_hugging_face_backend(tmp_path: Path, exported: tuple[Path, Path]) -> None:
    from ponente.trainer.main.eval_harness import main

    folder, tasks_dir = exported
    tasks = [MC_TASK, GEN_TASK, ROLLING_TASK]
    output = tmp_path / "results.json"
    code = main(
        [
            f"--hf_checkpoint={folder}",
            f"--include_path={tasks_dir}",
            f"--tasks=[{','.join(tasks)}]",
            f"--max_length={MAX_LENGTH}",
            "--batch_size=3",
            "--bootstrap_iters=0",
            "--log_samples=true",
            f"--output_path={output}",
        ]
    )
    assert code == 0
    ours = json.loads(output.read_text())
    theirs = hf_backend(folder, tasks_dir, tasks, max_length=MAX_LENGTH)

    # the scores
    for metric in ("acc", "acc_norm"):
        assert ours["results"][MC_TASK][f"{metric},none"] == theirs["results"][MC_TASK][f"{metric},none"]
    assert ours["results"][GEN_TASK]["exact_match,none"] == theirs["results"][GEN_TASK]["exact_match,none"]
    assert len(responses(ours, MC_TASK)) == 20

    # multiple choice: every choice's log-likelihood within 1e-4, the same greedy flags
    for mine, reference in zip(responses(ours, MC_TASK), responses(theirs, MC_TASK), strict=True):
        assert len(mine) == len(reference) == 4
        for [(logprob, greedy)], [(ref_logprob, ref_greedy)] in zip(mine, reference, strict=True):
            assert logprob == pytest.approx(ref_logprob, abs=1e-4)
            assert greedy == ref_greedy

    # generation: the same text, token for token (greedy; stop strings cut)
    mine_text = [r[0][0] for r in responses(ours, GEN_TASK)]
    assert mine_text == [r[0][0] for r in responses(theirs, GEN_TASK)]
    assert any(mine_text)  # not trivially empty

    # rolling log-likelihood: documents longer than MAX_LENGTH tokens are scored in several windows
    for [[mine_total]], [[ref_total]] in zip(
        responses(ours, ROLLING_TASK), responses(theirs, ROLLING_TASK), strict=True
    ):
        assert mine_total == pytest.approx(ref_total, rel=1e-6, abs=1e-4)


def test_rolling_windows_are_really_used(exported: tuple[Path, Path]) -> None:
    """A document longer than the window scores differently with a shorter window (so windows were cut)."""
    from lm_eval.api.instance import Instance
    from tokenizers import Tokenizer

    from ponente.models.hf import load_pretrained
    from ponente.trainer.eval_harness.adapter import PonenteLM

    folder, _ = exported
    model = load_pretrained(folder)
    tokenizer = Tokenizer.from_file(str(folder / "tokenizer.json"))
    text = " ".join(["red cat blue dog green bird"] * 6)
    request = Instance("loglikelihood_rolling", {}, (text,), 0)
    assert 2 * MAX_LENGTH < len(tokenizer.encode(text).ids) < model.config.seq_len  # several windows, or one
    short = PonenteLM(model, tokenizer, max_length=MAX_LENGTH, tokenizer_folder=folder)
    full = PonenteLM(model, tokenizer, tokenizer_folder=folder)
    [windowed], [whole] = short.loglikelihood_rolling([request]), full.loglikelihood_rolling([request])
    assert windowed != pytest.approx(whole, abs=1e-3)
    # the whole document in one window equals the summed next-token log-probs of one forward pass
    import numpy as np

    import ponente.namedtensor as hax

    ids = [short.prefix_token_id, *tokenizer.encode(text).ids]
    Pos = model.config.Pos.resize(len(ids) - 1)
    logits = np.asarray(model(hax.named(np.asarray(ids[:-1], np.int32), Pos)).array, np.float64)
    shifted = logits - logits.max(-1, keepdims=True)
    logp = shifted - np.log(np.exp(shifted).sum(-1, keepdims=True))
    assert whole == pytest.approx(float(logp[np.arange(len(ids) - 1), ids[1:]].sum()), abs=1e-3)


def test_harness_metrics_flatten_lm_eval_scores() -> None:
    results = {
        "results": {
            "task_a": {"alias": "task_a", "acc,none": 0.5, "acc_stderr,none": "N/A", "sample_len": 4},
            "task_b": {"exact_match,strict-match": 1.0, "exact_match,none": 0.25},
        }
    }
    assert harness_metrics(results) == {
        "lm_eval/task_a/acc": 0.5,
        "lm_eval/task_a/sample_len": 4.0,
        "lm_eval/task_b/exact_match_strict-match": 1.0,
        "lm_eval/task_b/exact_match": 0.25,
    }


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        ({"tasks": []}, "eval_harness.tasks"),
        ({"every": 0}, "eval_harness.every"),
        ({"limit": 0}, "eval_harness.limit"),
        ({"batch_size": 0}, "eval_harness.batch_size"),
    ],
)
def test_eval_harness_config_rejects_bad_values(overrides: dict[str, Any], message: str) -> None:
    with pytest.raises(ValueError, match=message):
        EvalHarnessConfig(**{"tasks": ["t"], **overrides})


def test_a_missing_extra_is_one_line_naming_it(monkeypatch: pytest.MonkeyPatch) -> None:
    import importlib.util

    from ponente.trainer.run import eval_harness_hook

    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "lm_eval" else real(name, *a))
    with pytest.raises(ImportError, match=r"pip install 'ponente-trainer\[eval\]'"):
        eval_harness_hook(EvalHarnessConfig(tasks=["t"]), tokenizer=None, tracker=None)  # type: ignore[arg-type]


@pytest.mark.integration
def test_training_callback_logs_the_scores_of_the_hugging_face_backend(tmp_path: Path) -> None:
    """``eval_harness:`` in a fine-tuning run logs lm_eval/<task>/<metric>, equal to the HF backend's on the export."""
    from ponente.trainer.config import load_config
    from ponente.trainer.main.sft import SftConfig, train

    model_dir = write_tiny_llama(tmp_path / "tiny", seed=1)
    tasks_dir = write_tasks(tmp_path / "tasks")
    overrides = [
        *supervised_overrides(tmp_path, model_dir, 2),
        f"hf_save_path={tmp_path / 'hf'}",
        f"eval_harness={{tasks: [{MC_TASK}], include_path: {tasks_dir}, every: 2, bootstrap_iters: 0}}",
    ]
    config = load_config(SftConfig, overrides=overrides)
    assert config.eval_harness == EvalHarnessConfig(tasks=[MC_TASK], include_path=str(tasks_dir), every=2)
    result = train(config)
    assert result.steps == 2
    records = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    logged = {k: v for r in records if r.get("step") == 2 for k, v in r.items() if k.startswith("lm_eval/")}
    assert set(logged) >= {f"lm_eval/{MC_TASK}/acc", f"lm_eval/{MC_TASK}/acc_norm"}
    theirs = hf_backend(tmp_path / "hf", tasks_dir, [MC_TASK])
    assert logged[f"lm_eval/{MC_TASK}/acc"] == theirs["results"][MC_TASK]["acc,none"]
    assert logged[f"lm_eval/{MC_TASK}/acc_norm"] == theirs["results"][MC_TASK]["acc_norm,none"]

    # ponente-eval-harness on the run's checkpoint (architecture and tokenizer from its saved configuration)
    from ponente.trainer.main.eval_harness import main

    output = tmp_path / "from_checkpoint.json"
    args = [f"--checkpoint_path={result.checkpoint}", f"--include_path={tasks_dir}", f"--tasks=[{MC_TASK}]"]
    assert main([*args, f"--output_path={output}"]) == 0
    scores = json.loads(output.read_text())["results"][MC_TASK]
    assert scores["acc,none"] == logged[f"lm_eval/{MC_TASK}/acc"]
    assert scores["acc_norm,none"] == logged[f"lm_eval/{MC_TASK}/acc_norm"]


def test_an_unknown_task_is_one_line_naming_tasks_and_close_names(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    from ponente.trainer.main.eval_harness import main

    tasks_dir = write_tasks(tmp_path / "tasks")
    (tmp_path / "model").mkdir()  # never loaded: the tasks are checked first (lm-eval's registry is local)
    misspelt = MC_TASK.replace("_mc", "_mq")
    code = main([f"--hf_checkpoint={tmp_path / 'model'}", f"--include_path={tasks_dir}", f"--tasks=[{misspelt}]"])
    err = capsys.readouterr().err
    assert code == 1
    lines = [line for line in err.splitlines() if line.startswith("error:")]
    assert len(lines) == 1, err
    assert "Traceback" not in err, err
    assert lines[0].startswith(f"error: --tasks: unknown task '{misspelt}'"), lines[0]
    assert MC_TASK in lines[0]  # the close name
    assert "internal error" not in lines[0]
