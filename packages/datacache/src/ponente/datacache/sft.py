"""Processors of supervised (prompt/response) and chat records: token ids plus a per-token loss mask.

Both produce two fields per record: ``input_ids`` (int32) and ``loss_mask`` (uint8, *target-aligned*:
``loss_mask[j] = 1`` when token ``j`` is a training target, i.e. the model is trained to predict it from
the tokens before it). Packing them into fixed-length rows is the job of
:class:`~ponente.datacache.PackedExampleDataset`.

Templates are Jinja (the optional ``chat`` extra, ``pip install 'ponente-datacache[chat]'``), rendered in a
sandbox. A chat template follows the Hugging Face conventions: it sees ``messages`` (a list of
``{"role", "content"}``), ``add_generation_prompt``, ``bos_token``, ``eos_token``, a ``raise_exception(msg)``
function and a ``tojson`` filter; blocks are trimmed (``trim_blocks``, ``lstrip_blocks``) as in
``transformers``. No clock is exposed (no ``strftime_now``), so a rendering never depends on the date.
"""

from __future__ import annotations

import hashlib
import importlib
import json
import os
from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING, Any

import numpy as np

from ponente.datacache.errors import MISSING_FIELD, WRONG_TYPE, MissingExtraError
from ponente.datacache.processor import load_tokenizer

if TYPE_CHECKING:
    from tokenizers import Tokenizer

__all__ = ["CHAT_ROLES", "ChatProcessor", "SupervisedProcessor"]

CHAT_ROLES = ("system", "user", "assistant", "tool")
"""The roles a chat message may have."""

_FIELDS = {"input_ids": "int32", "loss_mask": "uint8"}


def _jinja() -> Any:
    """The ``jinja2`` module with its submodules loaded (imported by name: it is an optional extra)."""
    try:
        for name in ("jinja2.ext", "jinja2.meta", "jinja2.sandbox"):
            importlib.import_module(name)
        return importlib.import_module("jinja2")
    except ImportError as exc:
        raise MissingExtraError(
            "prompt and chat templates need jinja2, which is not installed: pip install 'ponente-datacache[chat]'"
        ) from exc


def _raise_exception(message: str) -> None:
    """``raise_exception(msg)`` of chat templates (the Hugging Face convention to reject a conversation)."""
    raise _jinja().TemplateError(message)


def _tojson(value: Any, indent: int | None = None, ensure_ascii: bool = False, sort_keys: bool = False) -> str:
    """``tojson`` filter as chat templates expect it: plain JSON, non-ASCII kept, no HTML escaping."""
    return json.dumps(value, indent=indent, ensure_ascii=ensure_ascii, sort_keys=sort_keys)


def compile_template(source: str, *, key: str, chat: bool) -> Any:
    """Compile a Jinja template in a sandbox.

    Args:
        source: The template text.
        key: The template's name in error messages (e.g. ``data.chat_template``).
        chat: Chat-template conventions (trimmed blocks, loop controls, ``raise_exception``, ``tojson``);
            otherwise a prompt template (blocks not trimmed, the trailing newline kept).

    Returns:
        The compiled ``jinja2.Template``.

    Raises:
        MissingExtraError: If jinja2 is not installed.
        ValueError: Naming ``key`` if the template has a syntax error.
    """
    jinja2 = _jinja()
    if chat:
        env = jinja2.sandbox.ImmutableSandboxedEnvironment(
            trim_blocks=True, lstrip_blocks=True, extensions=[jinja2.ext.loopcontrols]
        )
    else:
        env = jinja2.sandbox.ImmutableSandboxedEnvironment(keep_trailing_newline=True)
    env.filters["tojson"] = _tojson
    env.globals["raise_exception"] = _raise_exception
    try:
        return env.from_string(source)
    except jinja2.TemplateSyntaxError as exc:
        raise ValueError(f"{key}: Jinja syntax error on line {exc.lineno}: {exc.message}") from exc


def template_variables(source: str) -> frozenset[str]:
    """The variables a template reads from its context (those it neither sets nor gets as a global)."""
    jinja2 = _jinja()
    env = jinja2.sandbox.ImmutableSandboxedEnvironment()
    names = jinja2.meta.find_undeclared_variables(env.parse(source))
    return frozenset(n for n in names if n not in env.globals and n != "raise_exception")


def _token_id(tokenizer: Tokenizer, token: str | None, role: str) -> int | None:
    if token is None:
        return None
    token_id = tokenizer.token_to_id(token)
    if token_id is None:
        raise ValueError(f"{role} token {token!r} is not in the tokenizer's vocabulary")
    return int(token_id)


def message_problem(messages: Any, field: str) -> tuple[str, str] | None:
    """``(kind, detail)`` if ``messages`` (the value of record field ``field``) is not a list of well-formed chat
    messages: ``{role, content}`` strings, a known role, and non-empty assistant contents; else ``None``."""
    if not isinstance(messages, list | tuple):
        return WRONG_TYPE, f"expected field {field!r} to be a list of messages, found {type(messages).__name__}"
    for k, message in enumerate(messages):
        if not isinstance(message, Mapping):
            return WRONG_TYPE, f"field {field!r}, message {k}: expected a {{role, content}} object, found " + (
                type(message).__name__
            )
        for name in ("role", "content"):
            if name not in message:
                return MISSING_FIELD, f"field {field!r}, message {k}: no {name!r} (keys {sorted(message)})"
            if not isinstance(message[name], str):
                return WRONG_TYPE, f"field {field!r}, message {k}: expected {name!r} to be a string, found " + (
                    type(message[name]).__name__
                )
        if message["role"] not in CHAT_ROLES:
            return WRONG_TYPE, f"field {field!r}, message {k}: role {message['role']!r} is not one of " + (
                ", ".join(CHAT_ROLES)
            )
        if message["role"] == "assistant" and not message["content"].strip():
            return MISSING_FIELD, f"field {field!r}, message {k}: empty assistant response (nothing to train on)"
    return None


class _TemplateProcessor:
    """What both processors share: the tokenizer, its digest, and a template compiled lazily per process."""

    _chat = False

    def __init__(self, tokenizer: Tokenizer | str | os.PathLike[str], template: str | None, template_key: str) -> None:
        from tokenizers import Tokenizer

        self.tokenizer = tokenizer if isinstance(tokenizer, Tokenizer) else load_tokenizer(tokenizer)
        self.template_key = template_key
        self._template_source = template
        self._compiled: Any = None  # a jinja2.Template
        if template is not None:
            self._compiled = compile_template(template, key=template_key, chat=self._chat)  # fail early
        self._digest = hashlib.sha256(self.tokenizer.to_str().encode("utf-8")).hexdigest()

    def __getstate__(self) -> dict[str, Any]:
        state = dict(self.__dict__)
        state["_compiled"] = None  # compiled templates do not pickle; workers compile their own
        return state

    @property
    def fields(self) -> Mapping[str, str]:
        """``{"input_ids": "int32", "loss_mask": "uint8"}``."""
        return dict(_FIELDS)

    def _render(self, context: Mapping[str, Any], what: str) -> str:
        jinja2 = _jinja()
        if self._compiled is None:
            if self._template_source is None:
                raise RuntimeError(f"{self.template_key}: no template to render")
            self._compiled = compile_template(self._template_source, key=self.template_key, chat=self._chat)
        try:
            return str(self._compiled.render(**context))
        except jinja2.TemplateError as exc:
            raise ValueError(f"{self.template_key}: the template failed on {what}: {exc}") from exc

    def _base_config(self) -> dict[str, Any]:
        return {
            "tokenizer_sha256": self._digest,
            "vocab_size": self.tokenizer.get_vocab_size(with_added_tokens=True),
        }


class SupervisedProcessor(_TemplateProcessor):
    """Tokenize prompt/response records; the loss mask marks the response tokens (and EOS) as targets.

    The prompt is ``record[input_field]``, or, with ``prompt_template``, that Jinja template rendered over the
    record's fields (so an Alpaca record's ``instruction``/``input`` can be laid out with an
    ``{% if input %}`` branch). The response is ``record[output_field]``. Prompt and response are tokenized
    separately and concatenated, ``[bos] + prompt + response + [eos]``, so the prompt tokens are exactly
    those a model sees when it is prompted at inference time. With ``mask_inputs`` the targets are the
    response tokens and EOS; without it, every token is a target.

    Bad records (reported by `check`, so the builder's ``bad_records`` policy names the row): a missing
    response or prompt field (or a field the template uses) and an empty response are ``missing_field``;
    a non-string prompt or response is ``wrong_type``.

    Args:
        tokenizer: A ``tokenizers.Tokenizer``, a ``tokenizer.json`` path, a directory containing one, or a hub id.
        input_field: The record field holding the prompt (without ``prompt_template``).
        output_field: The record field holding the response.
        prompt_template: Jinja text rendered over the record's fields to make the prompt, or ``None``. A
            trailing newline is kept.
        bos: Token to put before the prompt, or ``None``.
        eos: Token to put after the response (a target), or ``None``.
        mask_inputs: Train on the response only (``False``: on every token).
        template_key: How errors name the prompt template (the trainer passes ``data.prompt_template``).

    Raises:
        ValueError: If ``bos``/``eos`` is not in the vocabulary or the template has a syntax error.
        MissingExtraError: If ``prompt_template`` is given and jinja2 is not installed.

    Example:
        ```python
        processor = SupervisedProcessor(
            "tokenizer.json",
            prompt_template="{{ instruction }}{% if input %}\\n{{ input }}{% endif %}\\nAnswer: ",
            output_field="output",
            eos="</s>",
        )
        out = processor([{"instruction": "Add 2 and 3.", "input": "", "output": "5"}])
        out["input_ids"][0], out["loss_mask"][0]  # the last two tokens ("5", "</s>") are targets
        ```
    """

    def __init__(
        self,
        tokenizer: Tokenizer | str | os.PathLike[str],
        *,
        input_field: str = "input",
        output_field: str = "output",
        prompt_template: str | None = None,
        bos: str | None = None,
        eos: str | None = None,
        mask_inputs: bool = True,
        template_key: str = "prompt_template",
    ) -> None:
        super().__init__(tokenizer, prompt_template, template_key)
        self.input_field, self.output_field = input_field, output_field
        self.bos, self.eos = bos, eos
        self.mask_inputs = bool(mask_inputs)
        self._bos_id = _token_id(self.tokenizer, bos, "bos")
        self._eos_id = _token_id(self.tokenizer, eos, "eos")
        self._prompt_fields = (
            (input_field,) if prompt_template is None else tuple(sorted(template_variables(prompt_template)))
        )

    def config(self) -> dict[str, Any]:
        """Tokenizer hash, fields, template text, BOS/EOS and ``mask_inputs`` (what determines the output)."""
        return {
            "type": "supervised",
            **self._base_config(),
            "input_field": None if self._template_source is not None else self.input_field,
            "output_field": self.output_field,
            "prompt_template": self._template_source,
            "bos": self.bos,
            "eos": self.eos,
            "mask_inputs": self.mask_inputs,
        }

    def check(self, record: Mapping[str, Any]) -> tuple[str, str] | None:
        """Require a non-empty string response and the prompt's fields (a string prompt without a template)."""
        if not isinstance(record, Mapping):
            return MISSING_FIELD, f"expected a record with fields {sorted({*self._prompt_fields, self.output_field})}"
        for name in (*self._prompt_fields, self.output_field):
            if name not in record:
                what = "response" if name == self.output_field else "prompt"
                return MISSING_FIELD, f"expected a {what} field {name!r}, found keys {sorted(record)}"
        if self._template_source is None and not isinstance(record[self.input_field], str):
            found = type(record[self.input_field]).__name__
            return WRONG_TYPE, f"expected the prompt field {self.input_field!r} to be a string, found {found}"
        response = record[self.output_field]
        if not isinstance(response, str):
            return WRONG_TYPE, f"expected the response field {self.output_field!r} to be a string, found " + (
                type(response).__name__
            )
        if not response.strip():
            return MISSING_FIELD, f"empty response: field {self.output_field!r} holds no text to train on"
        return None

    def prompt(self, record: Mapping[str, Any]) -> str:
        """The prompt text of a checked record (the rendered template, or the input field)."""
        if self._template_source is None:
            return str(record[self.input_field])
        return self._render(record, f"a record with fields {sorted(record)}")

    def __call__(self, records: Sequence[Mapping[str, Any]]) -> dict[str, list[np.ndarray]]:
        """Tokenize the prompts and responses of checked records; see the class docstring."""
        encode = getattr(self.tokenizer, "encode_batch_fast", self.tokenizer.encode_batch)
        prompts = encode([self.prompt(r) for r in records], add_special_tokens=False)
        responses = encode([r[self.output_field] for r in records], add_special_tokens=False)
        prefix = [self._bos_id] if self._bos_id is not None else []
        suffix = [self._eos_id] if self._eos_id is not None else []
        ids, masks = [], []
        for prompt, response in zip(prompts, responses, strict=True):
            head = prefix + prompt.ids
            tail = response.ids + suffix
            ids.append(np.array(head + tail, dtype=np.int32))
            mask = np.ones(len(head) + len(tail), dtype=np.uint8)
            if self.mask_inputs:
                mask[: len(head)] = 0
            masks.append(mask)
        return {"input_ids": ids, "loss_mask": masks}


class ChatProcessor(_TemplateProcessor):
    """Render ``[{role, content}]`` conversations with a chat template; the loss mask marks assistant turns.

    The conversation is rendered whole (``add_generation_prompt=False``) and tokenized with character
    offsets (``add_special_tokens=False``: the template writes its own special tokens). The targets of
    assistant message ``k`` are the characters between the rendering of messages ``0..k-1`` with
    ``add_generation_prompt=True`` (everything up to where the assistant starts writing) and the rendering
    of messages ``0..k`` (the turn's end, e.g. an end-of-turn token, included); a token is a target when
    its text overlaps such a span (as ``transformers``' assistant masks: a token merging the template's
    last space with the first word of the response, like ``" Paris"``, is a target). This needs a template
    whose rendering of a prefix of the conversation is a prefix of the whole rendering, which is an error
    otherwise. With ``mask_inputs=False`` every token is a target.

    Bad records (reported by `check`): a missing ``messages_field``, a message without ``role``/``content``,
    no assistant message, or an assistant message with empty content are ``missing_field``; a
    non-list, a non-dict message, a non-string role or content, or a role not in
    ``system``/``user``/``assistant``/``tool`` are ``wrong_type``. A template that rejects a conversation
    (``raise_exception``, e.g. a role it does not know) stops the build with an error naming
    ``template_key``.

    Args:
        tokenizer: A ``tokenizers.Tokenizer``, a ``tokenizer.json`` path, a directory containing one, or a hub id.
        messages_field: The record field holding the list of messages.
        chat_template: The Jinja chat template text (e.g. the ``chat_template`` of a ``tokenizer_config.json``).
        mask_inputs: Train on assistant turns only (``False``: on every token).
        bos: The template's ``bos_token`` (``None``: an empty string).
        eos: The template's ``eos_token`` (``None``: an empty string).
        template_key: How errors name the chat template (the trainer passes ``data.chat_template``).

    Raises:
        ValueError: Naming ``template_key`` if the template is missing or has a syntax error; if
            ``bos``/``eos`` is not in the vocabulary.
        MissingExtraError: If jinja2 is not installed.

    Example:
        ```python
        template = (
            "{% for m in messages %}<|{{ m.role }}|>{{ m.content }}{{ eos_token }}{% endfor %}"
            "{% if add_generation_prompt %}<|assistant|>{% endif %}"
        )
        processor = ChatProcessor("tokenizer.json", chat_template=template, eos="</s>")
        record = {"messages": [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello!"}]}
        processor([record])["loss_mask"][0]  # 1 on "Hello!</s>", 0 elsewhere
        ```
    """

    _chat = True

    def __init__(
        self,
        tokenizer: Tokenizer | str | os.PathLike[str],
        *,
        messages_field: str = "messages",
        chat_template: str | None,
        mask_inputs: bool = True,
        bos: str | None = None,
        eos: str | None = None,
        template_key: str = "chat_template",
    ) -> None:
        if chat_template is None or not str(chat_template).strip():
            raise ValueError(f"{template_key}: a chat template is needed to render conversations, and none was given")
        super().__init__(tokenizer, chat_template, template_key)
        self.messages_field = messages_field
        self.mask_inputs = bool(mask_inputs)
        self.bos, self.eos = bos, eos
        _token_id(self.tokenizer, bos, "bos")
        _token_id(self.tokenizer, eos, "eos")

    def config(self) -> dict[str, Any]:
        """Tokenizer hash, messages field, template text, BOS/EOS and ``mask_inputs``."""
        return {
            "type": "chat",
            **self._base_config(),
            "messages_field": self.messages_field,
            "chat_template": self._template_source,
            "bos": self.bos,
            "eos": self.eos,
            "mask_inputs": self.mask_inputs,
        }

    def check(self, record: Mapping[str, Any]) -> tuple[str, str] | None:
        """Require a list of ``{role, content}`` string messages with known roles and a non-empty assistant turn."""
        if not isinstance(record, Mapping) or self.messages_field not in record:
            keys = sorted(record) if isinstance(record, Mapping) else type(record).__name__
            return MISSING_FIELD, f"expected a messages field {self.messages_field!r}, found keys {keys}"
        problem = message_problem(record[self.messages_field], self.messages_field)
        if problem is not None:
            return problem
        has_assistant = any(m["role"] == "assistant" for m in record[self.messages_field])
        if not has_assistant:
            return MISSING_FIELD, "no assistant message: nothing to train on"
        return None

    def render(self, messages: Sequence[Mapping[str, Any]], *, add_generation_prompt: bool = False) -> str:
        """Render ``messages`` with the chat template (as ``transformers``' ``apply_chat_template(tokenize=False)``).

        Raises:
            ValueError: Naming ``template_key`` if the template rejects the conversation.
        """
        roles = [m.get("role") for m in messages]
        context = {
            "messages": [dict(m) for m in messages],
            "add_generation_prompt": add_generation_prompt,
            "bos_token": self.bos or "",
            "eos_token": self.eos or "",
        }
        return self._render(context, f"a conversation with roles {roles}")

    def target_spans(self, messages: Sequence[Mapping[str, Any]], text: str) -> list[tuple[int, int]]:
        """Character spans ``[start, stop)`` of ``text`` (the whole rendering) written by the assistant.

        Raises:
            ValueError: Naming ``template_key`` if a rendering of a prefix of the conversation is not a
                prefix of ``text``.
        """
        spans = []
        for k, message in enumerate(messages):
            if message["role"] != "assistant":
                continue
            before = self.render(messages[:k], add_generation_prompt=True)
            through = self.render(messages[: k + 1])
            if not (text.startswith(before) and text.startswith(through) and len(before) <= len(through)):
                raise ValueError(
                    f"{self.template_key}: rendering the conversation up to assistant message {k} does not give a "
                    "prefix of the whole rendering, so the assistant turns cannot be located; use a template whose "
                    "renderings of the first messages are prefixes of the whole, or set mask_inputs to false"
                )
            spans.append((len(before), len(through)))
        return spans

    def __call__(self, records: Sequence[Mapping[str, Any]]) -> dict[str, list[np.ndarray]]:
        """Render, tokenize and mask checked records; see the class docstring."""
        ids, masks = [], []
        for record in records:
            messages = record[self.messages_field]
            text = self.render(messages)
            encoding = self.tokenizer.encode(text, add_special_tokens=False)
            if self.mask_inputs:
                offsets = np.array(encoding.offsets, dtype=np.int64).reshape(-1, 2)
                mask = np.zeros(len(offsets), dtype=bool)
                for lo, hi in self.target_spans(messages, text):
                    mask |= (offsets[:, 0] < hi) & (offsets[:, 1] > lo)
                masks.append(mask.astype(np.uint8))
            else:
                masks.append(np.ones(len(encoding.ids), dtype=np.uint8))
            ids.append(np.array(encoding.ids, dtype=np.int32))
        return {"input_ids": ids, "loss_mask": masks}
