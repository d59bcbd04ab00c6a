"""The log-prob page: values against transformers and a NumPy log-softmax, the HTML parsed back, the training hook."""

from __future__ import annotations

import json
import re
from html.parser import HTMLParser
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import numpy as np
import pytest
from finetune_support import write_tiny_llama

from ponente.trainer.config import ConfigError, load_config
from ponente.trainer.main.train_lm import TrainLmConfig
from ponente.trainer.run import VizLogprobsConfig

TEXTS = [
    'Tags <b>bold</b> & "quotes" </script><script>alert(1)</script> stay text.',
    "Write a short poem about the sea: é, 日本, done.",
    "x",
]
"""Documents with markup, quotes and multi-byte characters (one of a single token: nothing is predicted)."""


class _Page(HTMLParser):
    """The documents of a page: per ``section.doc``, its token spans ``(classes, attributes, text)``; and every tag
    met inside the token text (only spans may be there)."""

    def __init__(self) -> None:
        super().__init__(convert_charrefs=True)
        self.documents: list[list[dict[str, Any]]] = []
        self.tags_in_text: set[str] = set()
        self.stack: list[str] = []
        self.span: dict[str, Any] | None = None
        self.in_text = 0

    def handle_starttag(self, tag: str, attrs: list[tuple[str, str | None]]) -> None:
        attributes = dict(attrs)
        classes = (attributes.get("class") or "").split()
        if tag == "section" and "doc" in classes:
            self.documents.append([])
        if self.in_text:
            self.tags_in_text.add(tag)
        if tag == "div" and "text" in classes:
            self.in_text = 1
        elif self.in_text:
            self.in_text += 1
        if tag == "span" and "t" in classes:
            self.span = {"classes": classes, "attrs": attributes, "text": ""}
            self.documents[-1].append(self.span)

    def handle_endtag(self, tag: str) -> None:
        if self.in_text:
            self.in_text -= 1
        if tag == "span":
            self.span = None

    def handle_data(self, data: str) -> None:
        if self.span is not None:
            self.span["text"] += data


def _parse(page: str) -> _Page:
    parser = _Page()
    parser.feed(page)
    parser.close()
    return parser


def _log_softmax(logits: np.ndarray) -> np.ndarray:
    logits = logits.astype(np.float64)
    shifted = logits - logits.max(-1, keepdims=True)
    return shifted - np.log(np.exp(shifted).sum(-1, keepdims=True))


def _assert_self_contained(page: str) -> None:
    assert not re.search(r"https?:", page, re.IGNORECASE)
    assert not re.search(r"<(link|img|iframe)\b|\b(src|href)\s*=|@import|url\(", page, re.IGNORECASE)


@pytest.fixture(scope="module")
def llama_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_tiny_llama(tmp_path_factory.mktemp("viz") / "llama")


def test_page_from_hf_checkpoint_matches_transformers(llama_dir: Path, tmp_path: Path) -> None:
    """ponente-viz-logprobs on a jsonl: one span per token, values and top-3 equal to transformers' log-softmax."""
    import torch
    import transformers
    from tokenizers import Tokenizer

    from ponente.trainer.main.viz_logprobs import main

    docs = tmp_path / "docs.jsonl"
    docs.write_text("".join(json.dumps({"text": t}) + "\n" for t in TEXTS), encoding="utf-8")
    out = tmp_path / "pages" / "page.html"
    assert main([f"--hf_checkpoint={llama_dir}", f"--documents={docs}", "--top_k=3", f"--output={out}"]) == 0
    page = out.read_text(encoding="utf-8")
    _assert_self_contained(page)
    parsed = _parse(page)
    assert parsed.tags_in_text == {"span"}  # the markup in the documents stayed text
    assert len(parsed.documents) == len(TEXTS)

    tokenizer = Tokenizer.from_file(str(llama_dir / "tokenizer.json"))
    hf_model = transformers.AutoModelForCausalLM.from_pretrained(llama_dir, dtype=torch.float32).eval()
    for text, spans in zip(TEXTS, parsed.documents, strict=True):
        ids = tokenizer.encode(text).ids
        assert len(spans) == len(ids)
        assert "".join(s["text"] for s in spans) == tokenizer.decode(ids, skip_special_tokens=False) == text
        assert [int(s["attrs"]["data-id"]) for s in spans] == ids
        assert "start" in spans[0]["classes"]
        assert "data-lp" not in spans[0]["attrs"]
        with torch.no_grad():
            logp = _log_softmax(hf_model(torch.tensor([ids])).logits[0].numpy())
        for i, span in enumerate(spans[1:], start=1):
            assert "start" not in span["classes"]
            assert span["attrs"]["style"].startswith("background:hsl(")
            assert float(span["attrs"]["data-lp"]) == pytest.approx(logp[i - 1, ids[i]], abs=2e-5)
            top = json.loads(span["attrs"]["data-top"])
            expected = np.argsort(-logp[i - 1])[:3]
            assert [t[0] for t in top] == expected.tolist()
            np.testing.assert_allclose([t[2] for t in top], logp[i - 1, expected], atol=2e-5)
            assert [t[1] for t in top] == [tokenizer.decode([int(j)], skip_special_tokens=False) for j in expected]


def test_packed_rows_match_each_document_alone(llama_dir: Path) -> None:
    """Segments of a packed row are predicted as if alone; padding (segment -1) is dropped."""
    import ponente.namedtensor as hax
    from ponente.models.hf import load_pretrained
    from ponente.trainer.viz_logprobs import document_logprobs

    model = load_pretrained(str(llama_dir))
    rng = np.random.default_rng(0)
    first, second = rng.integers(4, 300, size=7), rng.integers(4, 300, size=5)
    row = {
        "input_ids": np.concatenate([first, second, [0, 0]]),
        "segment_ids": np.array([0] * 7 + [1] * 5 + [-1, -1]),
    }
    short = {"input_ids": first[:4]}
    docs = document_logprobs(model, [row, short], names=["packed", "short"], top_k=4, batch_size=2)
    assert [d.name for d in docs] == ["packed", "short"]
    packed, alone = docs
    np.testing.assert_array_equal(packed.token_ids, np.concatenate([first, second]))
    for segment, lp, top_ids, top_lp in (
        (first, packed.logprobs[:7], packed.top_ids[:7], packed.top_logprobs[:7]),
        (second, packed.logprobs[7:], packed.top_ids[7:], packed.top_logprobs[7:]),
        (first[:4], alone.logprobs, alone.top_ids, alone.top_logprobs),
    ):
        logits = np.asarray(model(hax.named(segment, "position")).array)
        reference = _log_softmax(logits)
        assert np.isnan(lp[0])
        assert (top_ids[0] == -1).all()
        np.testing.assert_allclose(lp[1:], reference[np.arange(len(segment) - 1), segment[1:]], atol=2e-5)
        expected = np.argsort(-reference[:-1], axis=-1)[:, :4]
        np.testing.assert_array_equal(top_ids[1:], expected)
        np.testing.assert_allclose(top_lp[1:], np.take_along_axis(reference[:-1], expected, -1), atol=2e-5)
    assert packed.mean_logprob == pytest.approx(np.nanmean(packed.logprobs))


class _Run:
    """A stand-in for a ``wandb.Run``: records what is logged."""

    def __init__(self) -> None:
        self.logged: list[tuple[dict[str, Any], int | None]] = []

    def log(self, values: dict[str, Any], step: int | None = None, commit: bool | None = None) -> None:
        self.logged.append((values, step))


class _Dataset:
    """Validation rows as a finished dataset: ``input_ids`` and ``segment_ids`` of two documents per row."""

    def __init__(self, rows: list[dict[str, np.ndarray]]) -> None:
        self.rows = rows

    def __len__(self) -> int:
        return len(self.rows)

    def wait_for_length(self, length: int | None = None, *, timeout: float | None = None) -> bool:
        return True

    def __getitem__(self, index: int) -> dict[str, np.ndarray]:
        return self.rows[index]


def test_training_hook_writes_the_page_and_logs_html_to_wandb_only(llama_dir: Path, tmp_path: Path) -> None:
    import wandb
    from tokenizers import Tokenizer

    import ponente.trainer.tracker as trk
    from ponente.models.hf import load_pretrained
    from ponente.trainer.callbacks import StepInfo
    from ponente.trainer.run import logprob_pages

    class Recording(trk.NoopTracker):
        def __init__(self) -> None:
            self.logged: list[Any] = []

        def log(self, metrics: Any, *, step: int | None, commit: bool | None = None) -> None:
            self.logged.append(metrics)

    tokenizer = Tokenizer.from_file(str(llama_dir / "tokenizer.json"))
    ids = np.asarray(tokenizer.encode("To sea & back <i>again</i>, said the poem.").ids)
    rows = [{"input_ids": ids, "segment_ids": np.repeat([0, 1], [3, len(ids) - 3])} for _ in range(3)]
    run, other = _Run(), Recording()
    config = VizLogprobsConfig(num_docs=2, top_k=2, path=str(tmp_path / "pages" / "{run_id}" / "{step}.html"))
    hook = logprob_pages(
        config,
        datasets={"val": _Dataset(rows)},
        tokenizer=tokenizer,
        tracker=trk.CompositeTracker([other, trk.WandbTracker(run)]),
        run_id="r1",
        run_dir=None,
        steps_per_eval=5,
    )
    assert hook.every == 5  # at each evaluation
    model = load_pretrained(str(llama_dir))
    hook.fn(StepInfo(state=SimpleNamespace(model=model), step=5, loss=0.0, metrics={}, step_seconds=0, data_seconds=0))

    page = (tmp_path / "pages" / "r1" / "5.html").read_text(encoding="utf-8")
    _assert_self_contained(page)
    parsed = _parse(page)
    assert len(parsed.documents) == 2
    for spans in parsed.documents:
        assert [int(s["attrs"]["data-id"]) for s in spans] == ids.tolist()
        assert ["start" in s["classes"] for s in spans] == [i in (0, 3) for i in range(len(ids))]
    ((values, step),) = run.logged
    assert step == 5
    assert isinstance(values["viz/logprobs"], wandb.Html)
    assert values["viz/logprobs"].html == page  # as written, without W&B's injected stylesheet link
    assert other.logged == []


def test_viz_logprobs_config_key() -> None:
    assert load_config(TrainLmConfig).viz_logprobs is None
    config = load_config(TrainLmConfig, overrides=["viz_logprobs={every: 3, num_docs: 2}"]).viz_logprobs
    assert config == VizLogprobsConfig(every=3, num_docs=2)
    assert config.page_path(run_id="r", run_dir="logs/r", step=6) == "logs/r/logprobs/step-6.html"
    assert config.page_path(run_id="r", run_dir=None, step=6) == "logprobs/r/step-6.html"
    with pytest.raises(ConfigError, match=r"viz_logprobs.top_k: must be >= 1"):
        load_config(TrainLmConfig, overrides=["viz_logprobs={top_k: 0}"])
    with pytest.raises(ValueError, match=r"viz_logprobs.path: only \{run_id\} and \{step\}"):
        VizLogprobsConfig(path="{run}.html").page_path(run_id="r", run_dir=None, step=1)


def _pages_during_training_equal_the_command_line(tmp_path: Path, overrides: list[str]) -> None:
    """A tiny run writes a page per evaluation; the command line then draws the final checkpoint the same."""
    from ponente.trainer.main import train_lm
    from ponente.trainer.main.viz_logprobs import VizLmConfig, viz_logprobs

    overrides = [*overrides, "trainer.steps_per_eval=2", "viz_logprobs={num_docs: 2, top_k: 3}"]
    cfg = load_config(TrainLmConfig, overrides=overrides)
    result = train_lm.train(cfg)
    pages = sorted(p.name for p in (tmp_path / "runs" / "tiny" / "logprobs").iterdir())
    assert pages == ["step-2.html", "step-4.html"]
    during = _parse((tmp_path / "runs" / "tiny" / "logprobs" / "step-4.html").read_text(encoding="utf-8"))
    assert [len(spans) for spans in during.documents] == [32, 32]

    out = tmp_path / "final.html"
    viz = VizLmConfig(
        data=cfg.data, model=cfg.model, checkpoint_path=result.checkpoint, num_docs=2, top_k=3, output=str(out)
    )
    assert viz_logprobs(viz) == str(out)  # on one device, the model unsharded
    after = _parse(out.read_text(encoding="utf-8"))
    # the same rows and the same model (the final step): the same values
    for spans_during, spans_after in zip(during.documents, after.documents, strict=True):
        for a, b in zip(spans_during, spans_after, strict=True):
            assert a["attrs"].get("data-id") == b["attrs"].get("data-id")
            assert ("data-lp" in a["attrs"]) == ("data-lp" in b["attrs"])
            if "data-lp" in a["attrs"]:
                assert float(a["attrs"]["data-lp"]) == pytest.approx(float(b["attrs"]["data-lp"]), abs=1e-4)


@pytest.mark.integration
def test_train_lm_writes_pages_at_each_evaluation(tmp_path: Path, tiny_lm_overrides: Any) -> None:
    _pages_during_training_equal_the_command_line(tmp_path, tiny_lm_overrides(4))


@pytest.mark.multidevice
def test_sharded_run_pages_equal_one_device(tmp_path: Path, tiny_lm_overrides: Any) -> None:
    """Model sharded over 8 simulated devices (FSDP x tensor parallel): the pages equal one device's."""
    import jax

    assert jax.device_count() == 8
    _pages_during_training_equal_the_command_line(tmp_path, [*tiny_lm_overrides(4), "trainer.model_axis_size=2"])


def test_a_validation_set_shorter_than_one_window_is_drawn(llama_dir: Path, tmp_path: Path) -> None:
    """Its tokens (fewer than seq_len) are the partial last window, which the window dataset never returns."""
    from tokenizers import Tokenizer

    from ponente.trainer.main.viz_logprobs import main

    texts = TEXTS[:2]
    validation = tmp_path / "validation.jsonl"
    validation.write_text("".join(json.dumps({"text": t}) + "\n" for t in texts), encoding="utf-8")
    data = tmp_path / "data.yaml"
    data.write_text(
        f"data:\n  validation_urls: [{validation}]\n  tokenizer: {llama_dir}\n  cache_dir: {tmp_path / 'cache'}\n"
        "  workers: 0\n",
        encoding="utf-8",
    )
    out = tmp_path / "page.html"
    args = [f"--hf_checkpoint={llama_dir}", "--config_path", str(data), f"--output={out}", "--max_length=512"]
    assert main(args) == 0
    parsed = _parse(out.read_text(encoding="utf-8"))
    assert len(parsed.documents) == 1  # one row: the two documents, each its own segment
    spans = parsed.documents[0]
    tokenizer = Tokenizer.from_file(str(llama_dir / "tokenizer.json"))
    ids = [int(s["attrs"]["data-id"]) for s in spans]
    assert len(ids) < 512
    starts = [i for i, s in enumerate(spans) if "start" in s["classes"]]
    assert len(starts) == len(texts)
    for text, begin, end in zip(texts, starts, [*starts[1:], len(ids)], strict=True):
        assert text in tokenizer.decode(ids[begin:end], skip_special_tokens=True)


def test_a_validation_set_without_tokens_says_so() -> None:
    from ponente.datacache import InMemoryTokenStore, TokenSeqDataset
    from ponente.trainer.viz_logprobs import validation_rows

    empty = TokenSeqDataset(InMemoryTokenStore.from_documents([[], []]), seq_len=8)
    with pytest.raises(ValueError, match="validation set\\(s\\) notes hold no tokens"):
        validation_rows({"notes": empty}, 4)
    short = TokenSeqDataset(InMemoryTokenStore.from_documents([[1, 2, 3], [], [4, 5], [6]]), seq_len=4)
    rows, names = validation_rows({"notes": short}, 4)  # one full window, then the 2 tokens after it
    assert [r["input_ids"].tolist() for r in rows] == [[1, 2, 3, 4], [5, 6]]
    assert [r["segment_ids"].tolist() for r in rows] == [[0, 0, 0, 1], [0, 1]]
    assert names == ["notes row 0", "notes row 1 (the last 2 tokens, less than a window)"]
