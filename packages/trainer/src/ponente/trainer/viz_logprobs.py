"""Per-token log-probabilities of a language model, drawn as a self-contained HTML page.

:func:`document_logprobs` runs the model over some documents (rows of token ids) and returns, for every
token, ``log p(token | the tokens before it in its document)`` and the ``top_k`` most likely tokens at that
place. :func:`render_page` turns them into one HTML page: each token is a ``<span class="t">`` coloured from
green (likely) to red (unlikely) by its log-probability; hovering over it shows the value and the top
alternatives. The page holds its CSS and script inline and loads nothing from the network, so it opens
offline, from a file, or inside a W&B panel. Example::

    docs = document_logprobs(model, [{"input_ids": ids}], names=["doc 0"], top_k=5)
    write_page(render_page(docs, tokenizer, title="step 1000"), "logprobs.html")

The entry point ``ponente-viz-logprobs`` (:mod:`ponente.trainer.main.viz_logprobs`) and the training option
``viz_logprobs:`` (:class:`ponente.trainer.run.VizLogprobsConfig`) are built on these functions.
"""

from __future__ import annotations

import dataclasses
import gzip
import html
import json
import math
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import PartitionSpec

import ponente.namedtensor as hax
from ponente.models import LmExample, LmHeadModel

__all__ = [
    "LOGPROB_FLOOR",
    "DocumentLogprobs",
    "document_logprobs",
    "document_rows",
    "read_documents",
    "render_page",
    "token_texts",
    "validation_rows",
    "write_page",
]

LOGPROB_FLOOR = -10.0
"""The log-probability (nats) drawn in full red; 0 is full green, values in between are interpolated."""


@dataclasses.dataclass(frozen=True)
class DocumentLogprobs:
    """The log-probabilities of one document's tokens under a model.

    Position ``i`` describes the prediction *of* token ``i``: the model's output at position ``i - 1``. A token
    that starts a segment (the first of a row, or of a document packed after another) has no prediction.

    Attributes:
        name: the document's label on the page.
        token_ids: ``[n]`` int, the tokens.
        logprobs: ``[n]`` float32, ``log p(token_ids[i] | earlier tokens of its segment)``; NaN where the token
            starts a segment.
        top_ids: ``[n, k]`` int, the ``k`` most likely tokens at place ``i``, most likely first (-1 where the
            token starts a segment).
        top_logprobs: ``[n, k]`` float32, their log-probabilities (NaN where the token starts a segment).
    """

    name: str
    token_ids: np.ndarray
    logprobs: np.ndarray
    top_ids: np.ndarray
    top_logprobs: np.ndarray

    @property
    def mean_logprob(self) -> float:
        """The mean log-probability of the predicted tokens (NaN if none is predicted)."""
        predicted = self.logprobs[~np.isnan(self.logprobs)]
        return float(predicted.mean()) if predicted.size else math.nan


def document_logprobs(
    model: Any,
    rows: Sequence[Mapping[str, np.ndarray]],
    *,
    names: Sequence[str],
    top_k: int = 5,
    batch_size: int = 1,
) -> list[DocumentLogprobs]:
    """The log-probability of every token of ``rows`` under ``model``, with the ``top_k`` alternatives.

    Rows are batched ``batch_size`` at a time and padded to the longest row of the batch (one compilation per
    padded length). A row is what the model sees at once: its segments (documents packed together) do not
    attend to each other, as in training and evaluation. Tokens whose ``segment_ids`` is negative are padding
    and are dropped from the result.

    Args:
        model: a language model (:class:`ponente.models.LmHeadModel`); log-probabilities are taken over its
            whole vocabulary axis, as the training loss does.
        rows: ``{"input_ids": [n] int}``, optionally with ``"segment_ids"`` (``[n]``; default: one segment) and
            ``"position_ids"`` (``[n]``, passed to the model), e.g. rows of a validation set.
        names: a label per row.
        top_k: how many alternatives to keep per token (>= 1, at most the vocabulary size).
        batch_size: rows per forward pass (>= 1).

    Returns:
        One :class:`DocumentLogprobs` per row, in order.

    Raises:
        ValueError: if ``names`` and ``rows`` differ in length, a row is empty or not 1-D, or ``top_k`` /
            ``batch_size`` is out of range.
    """
    if len(names) != len(rows):
        raise ValueError(f"names: {len(names)} names for {len(rows)} rows")
    if not 1 <= top_k <= model.Vocab.size:
        raise ValueError(f"top_k: must be in [1, {model.Vocab.size}], got {top_k}")
    if batch_size < 1:
        raise ValueError(f"batch_size: must be >= 1, got {batch_size}")
    fields = [_row_fields(row, i) for i, row in enumerate(rows)]
    with_positions = any("position_ids" in row for row in rows)
    documents: list[DocumentLogprobs] = []
    for start in range(0, len(fields), batch_size):
        chunk = fields[start : start + batch_size]
        width = max(len(ids) for ids, _, _ in chunk)
        ids = np.zeros((len(chunk), width), np.int32)
        seg = np.full((len(chunk), width), -1, np.int32)
        pos = np.zeros((len(chunk), width), np.int32)
        for r, (row_ids, row_seg, row_pos) in enumerate(chunk):
            ids[r, : len(row_ids)], seg[r, : len(row_ids)], pos[r, : len(row_ids)] = row_ids, row_seg, row_pos
        lp, top_lp, top_ids = (
            np.asarray(a) for a in _logprobs(model, ids, seg, pos if with_positions else None, top_k)
        )
        for r, (row_ids, row_seg, _) in enumerate(chunk):
            keep = row_seg >= 0
            starts = np.ones(len(row_ids), bool)
            starts[1:] = row_seg[1:] != row_seg[:-1]
            n = len(row_ids)
            logprobs = np.where(starts, np.nan, lp[r, :n]).astype(np.float32)
            tops = np.where(starts[:, None], np.nan, top_lp[r, :n]).astype(np.float32)
            top_id = np.where(starts[:, None], -1, top_ids[r, :n])
            documents.append(
                DocumentLogprobs(
                    name=names[start + r],
                    token_ids=row_ids[keep],
                    logprobs=logprobs[keep],
                    top_ids=top_id[keep],
                    top_logprobs=tops[keep],
                )
            )
    return documents


def read_documents(path: str, text_key: str, limit: int) -> list[str]:
    """The ``text_key`` field of the first ``limit`` records of a jsonl file (``.gz`` read compressed).

    Raises:
        FileNotFoundError: if ``path`` does not exist.
        ValueError: naming the file and line, for a line that is not a JSON object with a string ``text_key``.
    """
    opener: Any = gzip.open if path.endswith(".gz") else open
    texts: list[str] = []
    with opener(path, "rt", encoding="utf-8") as f:
        for number, line in enumerate(f, start=1):
            if len(texts) >= limit:
                break
            if not line.strip():
                continue
            try:
                record = json.loads(line)
            except json.JSONDecodeError as exc:
                raise ValueError(f"{path}:{number}: not valid JSON ({exc.msg})") from exc
            if not isinstance(record, dict) or not isinstance(record.get(text_key), str):
                raise ValueError(f"{path}:{number}: expected a JSON object with a string field {text_key!r}")
            texts.append(record[text_key])
    if not texts:
        raise ValueError(f"documents: {path} has no records")
    return texts


def document_rows(
    path: str, text_key: str, limit: int, tokenizer: Any, *, max_length: int
) -> tuple[list[dict[str, np.ndarray]], list[str]]:
    """The first ``limit`` documents of a jsonl file (:func:`read_documents`) as rows to draw, and their names.

    Each document is tokenized as the tokenizer's own post-processor says (e.g. with a BOS token) and cut to
    ``max_length`` tokens; a document that tokenizes to nothing is left out.

    Raises:
        ValueError: if every record tokenizes to nothing (naming the file), or as :func:`read_documents`.
    """
    rows: list[dict[str, np.ndarray]] = []
    names: list[str] = []
    for i, text in enumerate(read_documents(path, text_key, limit)):
        ids = tokenizer.encode(text).ids[:max_length]
        if ids:
            rows.append({"input_ids": np.asarray(ids, np.int32)})
            names.append(f"{Path(path).name} record {i}")
    if not rows:
        raise ValueError(f"documents: nothing to draw: every record of {path} tokenizes to nothing")
    return rows, names


def validation_rows(datasets: Mapping[str, Any], count: int) -> tuple[list[dict[str, np.ndarray]], list[str]]:
    """The first ``count`` rows of each validation set, and their names, to draw.

    A set of text windows (``TokenSeqDataset``) never returns its last, partial window: when it has fewer than
    ``count`` full windows, the tokens after the last full one are drawn too, as a shorter row (so a validation
    set shorter than one window still shows its documents).

    Args:
        datasets: the validation sets by name (rows with ``input_ids``, ``segment_ids``, ...).
        count: the rows wanted per set.

    Returns:
        ``(rows, names)``, in order.

    Raises:
        ValueError: if the sets hold no token at all (naming them).
    """
    from ponente.datacache import TokenSeqDataset

    rows: list[dict[str, np.ndarray]] = []
    names: list[str] = []
    for name, dataset in datasets.items():
        dataset.wait_for_length(count)
        full = min(count, len(dataset))
        rows.extend(dataset[i] for i in range(full))
        names.extend(f"{name} row {i}" for i in range(full))
        if full < count and isinstance(dataset, TokenSeqDataset) and (tail := _partial_window(dataset)) is not None:
            rows.append(tail)
            names.append(f"{name} row {full} (the last {tail['input_ids'].size} tokens, less than a window)")
    if not rows:
        raise ValueError(f"nothing to draw: the validation set(s) {', '.join(datasets)} hold no tokens")
    return rows, names


def _partial_window(dataset: Any) -> dict[str, np.ndarray] | None:
    """The tokens of a ``TokenSeqDataset`` after its last full window, with their segment ids (None: no token)."""
    store, start = dataset.cache, len(dataset) * dataset.seq_len
    stop = store.num_tokens()
    if stop <= start:
        return None
    offsets = np.asarray(store.row_offsets(0, len(store)), np.int64)
    documents = np.searchsorted(offsets, np.arange(start, stop), side="right")  # one id per document
    segments = np.unique(documents, return_inverse=True)[1].astype(np.int32)
    return {"input_ids": np.asarray(store.read_flat(start, stop)), "segment_ids": segments}


def _row_fields(row: Mapping[str, np.ndarray], index: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    ids = np.asarray(row["input_ids"], np.int32)
    if ids.ndim != 1 or ids.size == 0:
        raise ValueError(f"rows[{index}]: input_ids must be a non-empty 1-D array, got shape {ids.shape}")
    seg = np.asarray(row.get("segment_ids", np.zeros_like(ids)), np.int32)
    pos = np.asarray(row.get("position_ids", np.arange(ids.size)), np.int32)
    if seg.shape != ids.shape or pos.shape != ids.shape:
        raise ValueError(f"rows[{index}]: segment_ids and position_ids must have the shape of input_ids {ids.shape}")
    return ids, seg, pos


@eqx.filter_jit
def _logprobs(model: LmHeadModel, ids: Any, seg: Any, pos: Any, top_k: int) -> Any:
    """``(logprob [b, n], top_logprobs [b, n, k], top_ids [b, n, k])`` of each token (place 0 is filler)."""
    axes = ("batch", "position")
    example = LmExample.causal(
        hax.named(ids, axes), segment_ids=hax.named(seg, axes), pos_ids=None if pos is None else hax.named(pos, axes)
    )
    logits = model(example.tokens, example.attn_mask, pos_ids=example.pos_ids)
    logits_array = logits.rearrange(("batch", "position", model.Vocab.name)).array.astype(jnp.float32)
    logp = jax.nn.log_softmax(logits_array[:, :-1], axis=-1)  # position i - 1 predicts token i
    chosen = jnp.take_along_axis(logp, ids[:, 1:, None], axis=-1)[..., 0]
    top_lp, top_ids = jax.lax.top_k(logp, top_k)
    out = (
        jnp.pad(chosen, ((0, 0), (1, 0))),
        jnp.pad(top_lp, ((0, 0), (1, 0), (0, 0))),
        jnp.pad(top_ids, ((0, 0), (1, 0), (0, 0))),
    )
    if not jax.sharding.get_abstract_mesh().empty:  # replicated, so that every process can read the results
        out = jax.lax.with_sharding_constraint(out, PartitionSpec())
    return out


# --- the page ---------------------------------------------------------------------------------------------


def token_texts(tokenizer: Any, token_ids: Sequence[int] | np.ndarray) -> list[str]:
    """The text each token adds to the decoded document (special tokens included), in order.

    The pieces concatenate to the decoded text. A token that ends inside a multi-byte character adds ``""``
    and the token that completes the character adds all of it.

    Args:
        tokenizer: a ``tokenizers.Tokenizer``.
        token_ids: the document's tokens.

    Returns:
        One string per token.
    """
    from tokenizers.decoders import DecodeStream

    stream = DecodeStream(skip_special_tokens=False)
    return [stream.step(tokenizer, int(i)) or "" for i in token_ids]


def render_page(
    documents: Sequence[DocumentLogprobs], tokenizer: Any, *, title: str = "Token log-probabilities"
) -> str:
    """One self-contained HTML page showing every token of ``documents`` coloured by its log-probability.

    Each token is a ``<span class="t">`` (its text HTML-escaped); a predicted token carries ``data-lp`` (its
    log-probability, 6 decimals), ``data-top`` (JSON ``[[token id, text, log-prob], ...]`` of the top
    alternatives) and a background from green (log-prob 0) to red (:data:`LOGPROB_FLOOR` or below). A token
    that starts a segment has class ``t start`` and no value. No URL, stylesheet or script is loaded.

    Args:
        documents: from :func:`document_logprobs`.
        tokenizer: the ``tokenizers.Tokenizer`` of the token ids.
        title: the page's title and heading.

    Returns:
        The HTML text.
    """
    vocab = int(tokenizer.get_vocab_size(with_added_tokens=True))
    alternatives: dict[int, str] = {}

    def alternative(token_id: int) -> str:
        if token_id not in alternatives:
            known = 0 <= token_id < vocab and tokenizer.id_to_token(token_id) is not None
            text = tokenizer.decode([token_id], skip_special_tokens=False) if known else ""
            alternatives[token_id] = text if text else f"<id {token_id}>"
        return alternatives[token_id]

    sections = []
    for doc in documents:
        spans = []
        for text, token_id, lp, top_ids, top_lps in zip(
            token_texts(tokenizer, doc.token_ids),
            doc.token_ids,
            doc.logprobs,
            doc.top_ids,
            doc.top_logprobs,
            strict=True,
        ):
            body = html.escape(text)
            if math.isnan(lp):
                spans.append(f'<span class="t start" data-id="{int(token_id)}">{body}</span>')
                continue
            top = [[int(i), alternative(int(i)), round(float(v), 6)] for i, v in zip(top_ids, top_lps, strict=True)]
            spans.append(
                f'<span class="t" data-id="{int(token_id)}" data-lp="{float(lp):.6f}" '
                f'data-top="{html.escape(json.dumps(top, ensure_ascii=False), quote=True)}" '
                f'style="background:{_colour(float(lp))}">{body}</span>'
            )
        predicted = int(np.sum(~np.isnan(doc.logprobs)))
        sections.append(
            f'<section class="doc"><h2>{html.escape(doc.name)}</h2>'
            f'<p class="stats">{len(doc.token_ids)} tokens, mean log-prob {_number(doc.mean_logprob)} over '
            f"{predicted} predicted</p>"
            f'<div class="text">{"".join(spans)}</div></section>'
        )
    legend = "".join(
        f'<span class="swatch" style="background:{_colour(v)}">{v:g}</span>'
        for v in np.linspace(0.0, LOGPROB_FLOOR, 6)
    )
    return _PAGE.format(
        title=html.escape(title), legend=legend, documents="\n".join(sections), style=_STYLE, script=_SCRIPT
    )


def write_page(page: str, path: str) -> str:
    """Write ``page`` to ``path`` (a local path or an fsspec URL), creating the folder; returns ``path``."""
    import fsspec

    fs, where = fsspec.core.url_to_fs(path)
    parent = where.rpartition("/")[0]
    if parent:
        fs.makedirs(parent, exist_ok=True)
    with fs.open(where, "w", encoding="utf-8") as f:
        f.write(page)
    return path


def _colour(lp: float) -> str:
    """Green at log-prob 0, through yellow, to red at :data:`LOGPROB_FLOOR` and below."""
    t = min(max(lp / LOGPROB_FLOOR, 0.0), 1.0)
    return f"hsl({120 * (1 - t):.0f},75%,75%)"


def _number(value: float) -> str:
    return "n/a" if math.isnan(value) else f"{value:.3f}"


_STYLE = """
body{font-family:system-ui,sans-serif;margin:1.5em;color:#222}
h1{font-size:1.3em}h2{font-size:1.05em;margin:1.2em 0 .2em}
.stats{color:#666;font-size:.85em;margin:0 0 .4em}
.text{font-family:ui-monospace,monospace;white-space:pre-wrap;line-height:1.7;border:1px solid #ddd;padding:.6em}
.t{border-radius:2px;cursor:default}
.t:hover{outline:1px solid #333}
.t.start{background:#eee;border-left:2px solid #888}
.t:empty::after{content:"\\00b7";color:#999}
.swatch{display:inline-block;padding:0 .6em;margin-right:2px;font-size:.85em}
#tip{position:fixed;z-index:10;background:#fff;border:1px solid #888;box-shadow:0 2px 6px rgba(0,0,0,.2);
padding:.4em .6em;font-size:.85em;pointer-events:none;max-width:28em}
#tip table{border-collapse:collapse}#tip td{padding:0 .5em 0 0;font-family:ui-monospace,monospace}
#tip .chosen{font-weight:bold}
"""

_SCRIPT = """
(function(){
  var tip=document.getElementById('tip');
  function show(s){return JSON.stringify(s).slice(1,-1);}
  function cell(row,text,cls){var td=document.createElement('td');td.textContent=text;if(cls)td.className=cls;
    row.appendChild(td);}
  document.addEventListener('mouseover',function(e){
    var t=e.target;
    if(!t.classList||!t.classList.contains('t')){tip.hidden=true;return;}
    tip.textContent='';
    var head=document.createElement('div');
    var id=t.getAttribute('data-id');
    if(!t.hasAttribute('data-lp')){head.textContent='"'+show(t.textContent)+'" (id '+id+'): first token of a '+
      'segment, not predicted';tip.appendChild(head);tip.hidden=false;return;}
    var lp=parseFloat(t.getAttribute('data-lp'));
    head.textContent='"'+show(t.textContent)+'" (id '+id+')  log p = '+lp.toFixed(4)+'  p = '+
      Math.exp(lp).toPrecision(3);
    tip.appendChild(head);
    var table=document.createElement('table');
    JSON.parse(t.getAttribute('data-top')).forEach(function(a){
      var row=document.createElement('tr');var cls=String(a[0])===id?'chosen':'';
      cell(row,'"'+show(a[1])+'"',cls);cell(row,a[2].toFixed(4),cls);cell(row,Math.exp(a[2]).toPrecision(3),cls);
      table.appendChild(row);});
    tip.appendChild(table);tip.hidden=false;
  });
  document.addEventListener('mousemove',function(e){
    if(tip.hidden)return;
    var x=Math.min(e.clientX+12,window.innerWidth-tip.offsetWidth-4),y=e.clientY+16;
    if(y+tip.offsetHeight>window.innerHeight)y=e.clientY-tip.offsetHeight-8;
    tip.style.left=Math.max(0,x)+'px';tip.style.top=Math.max(0,y)+'px';
  });
})();
"""

_PAGE = """<!DOCTYPE html>
<html lang="en"><head><meta charset="utf-8"><title>{title}</title><style>{style}</style></head>
<body>
<h1>{title}</h1>
<p>Each token is coloured by the log-probability the model gave it (hover for the value and the most likely
alternatives): {legend}</p>
{documents}
<div id="tip" hidden></div>
<script>{script}</script>
</body></html>
"""
