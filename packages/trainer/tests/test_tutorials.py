"""The fine-tuning tutorials run as written, and the tiny fine-tuning sets the package ships are right.

The tutorials (``docs/trainer/docs/finetune-lora.md``, ``instruction-tuning.md``) are written for a user with a real
Llama checkpoint. ``test_tutorial_runs`` (``integration``) replays each page top to bottom in a scratch folder:
every ``yaml title="FILE"`` block is written to ``FILE``, every ``ponente-*`` command of a ``bash`` block runs (its
console script resolved from ``pyproject.toml``) and every ``py`` block runs (the PEFT/transformers snippets), with
the placeholder paths swapped for a tiny random Llama (``finetune_support.write_tiny_llama``) and small local data,
and with overrides that shrink the run (a few steps, short rows, float32, a JSON tracker) appended to each command.
A placeholder the test does not know, or a command that fails, fails the test; so does an output the page
promises that is not there. The fast tests check that every documented command's configuration resolves, and
that the shipped sets are what their generator writes and that their answers are right (checked by independent
code, not by the generator).
"""

from __future__ import annotations

import importlib.resources
import itertools
import json
import os
import re
import shlex
import subprocess
import sys
import tomllib
from dataclasses import dataclass
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[3]
DOCS = ROOT / "docs" / "trainer" / "docs"
PAGES = ("finetune-lora.md", "instruction-tuning.md")
ASSETS = importlib.resources.files("ponente.trainer.assets")

MODEL = "/path/to/Llama-2-7b-hf"
"""The placeholder of the base checkpoint in the tutorials."""
PLACEHOLDER = re.compile(r"/path/to/[\w.\-/]*")

_FENCE = re.compile(
    r"^(?P<indent> *)```(?P<lang>[\w-]+)(?P<attrs>[^\n]*)\n(?P<code>.*?)^(?P=indent)```[ \t]*$", re.S | re.M
)
_TITLE = re.compile(r'title="(?P<title>[^"]+)"')


@dataclass(frozen=True)
class Block:
    """A fenced block of a page: its language, ``title="..."`` (or ""), first line number and text."""

    lang: str
    title: str
    line: int
    code: str


def blocks(page: Path) -> list[Block]:
    """The fenced blocks of a Markdown page in order (indented blocks inside lists included)."""
    text = page.read_text(encoding="utf-8")
    found = []
    for m in _FENCE.finditer(text):
        indent = len(m.group("indent"))
        code = "\n".join(line[indent:] for line in m.group("code").splitlines())
        title = _TITLE.search(m.group("attrs"))
        line = text.count("\n", 0, m.start()) + 2
        found.append(Block(m.group("lang"), title.group("title") if title else "", line, code))
    return found


def commands(block: Block) -> list[list[str]]:
    """The ``ponente-*`` command lines of a ``bash`` block (continuation lines joined, comments dropped)."""
    joined = re.sub(r"\\\n", " ", block.code)
    lines = [shlex.split(line, comments=True) for line in joined.splitlines()]
    return [argv for argv in lines if argv and argv[0].startswith("ponente-")]


def console_scripts() -> dict[str, str]:
    """``{script: "module:function"}`` of the trainer's ``pyproject.toml``."""
    with open(ROOT / "packages" / "trainer" / "pyproject.toml", "rb") as f:
        return dict(tomllib.load(f)["project"]["scripts"])


def page_commands(page: str) -> list[tuple[int, list[str]]]:
    return [(b.line, argv) for b in blocks(DOCS / page) if b.lang == "bash" for argv in commands(b)]


# --- the shipped sets ------------------------------------------------------------------------------------------


def _rows(name: str) -> list[dict]:
    return [json.loads(line) for line in ASSETS.joinpath(name).read_text(encoding="utf-8").splitlines()]


def test_shipped_sets_are_what_their_generator_writes(tmp_path: Path) -> None:
    script = ROOT / "scripts" / "build_finetune_assets.py"
    subprocess.run([sys.executable, str(script), "--out", str(tmp_path)], check=True, capture_output=True)
    for name in ("tiny_instructions.jsonl", "tiny_chat.jsonl"):
        assert ASSETS.joinpath(name).read_bytes() == (tmp_path / name).read_bytes(), name


_IRREGULAR_PLURALS = {
    "child": "children", "mouse": "mice", "tooth": "teeth", "foot": "feet", "goose": "geese", "man": "men",
    "woman": "women", "sheep": "sheep", "fish": "fish", "knife": "knives", "leaf": "leaves", "wolf": "wolves",
}  # fmt: skip


def _regular_plural(noun: str) -> str:
    if noun.endswith(("s", "x", "sh", "ch")):
        return noun + "es"
    if noun.endswith("y") and noun[-2] not in "aeiou":
        return noun[:-1] + "ies"
    return noun + "s"


def _expected_answer(instruction: str, inp: str) -> str | None:
    """The answer to an instruction of the shipped set, computed here; None for antonyms (checked separately)."""
    numbers = [int(n) for n in re.findall(r"\d+", inp or instruction)]
    words = inp.split()
    quoted = re.findall(r"'(\w+)'", instruction)
    checks = {
        r"Add the two numbers\.|What is \d+ plus \d+\?": lambda: str(sum(numbers)),
        r"Subtract the second number from the first\.|What is \d+ minus \d+\?": lambda: str(numbers[0] - numbers[1]),
        r"Multiply the two numbers\.|What is \d+ times \d+\?": lambda: str(numbers[0] * numbers[1]),
        r"Reverse the order of the words\.": lambda: " ".join(reversed(words)),
        r"Sort the words in alphabetical order\.": lambda: " ".join(sorted(words)),
        r"Capitalise the first letter of every word\.": lambda: inp.title(),
        r"Write the text in upper case\.": lambda: inp.upper(),
        r"How many times does the letter '\w' appear in the word\?": lambda: str(inp.count(quoted[0])),
        r"Write the plural of the noun\.|What is the plural of '\w+'\?": lambda: _IRREGULAR_PLURALS.get(
            (inp or quoted[0]), _regular_plural(inp or quoted[0])
        ),
        r"Say whether the number is even or odd\.": lambda: "odd" if numbers[0] % 2 else "even",
        r"Which of the two numbers is larger\?": lambda: str(max(numbers)),
        r"Spell the word backwards\.": lambda: inp[::-1],
        r"Give the opposite of the word\.|What is the opposite of '\w+'\?": lambda: None,
    }
    for pattern, answer in checks.items():
        if re.fullmatch(pattern, instruction):
            return answer()
    raise AssertionError(f"no check for the instruction {instruction!r}")


def test_shipped_instructions_are_right() -> None:
    rows = _rows("tiny_instructions.jsonl")
    assert len(rows) == 300
    assert all(list(r) == ["instruction", "input", "output"] for r in rows)
    assert all(isinstance(v, str) and v == v.strip() for r in rows for v in r.values())
    assert len({(r["instruction"], r["input"]) for r in rows}) == len(rows)
    empty = sum(r["input"] == "" for r in rows)
    assert 30 <= empty <= 150  # both branches of an {% if input %} prompt template are used
    opposites: dict[str, str] = {}
    for r in rows:
        expected = _expected_answer(r["instruction"], r["input"])
        if expected is None:
            word = r["input"] or re.findall(r"'(\w+)'", r["instruction"])[0]
            assert opposites.setdefault(word, r["output"]) == r["output"], word
        else:
            assert r["output"] == expected, r
    # antonyms: one answer per word, and the relation is symmetric where both directions are asked
    for word, opposite in opposites.items():
        assert opposite != word
        assert opposites.get(opposite, word) == word, (word, opposite)


_CHAT_ANSWERS = {
    r"(\d+) plus (\d+) is (\d+)\.|Sure: (\d+) \+ (\d+) = (\d+)\.": lambda a, b: a + b,
    r"(\d+) minus (\d+) is (\d+)\.|(\d+) - (\d+) = (\d+)\.": lambda a, b: a - b,
    r"(\d+) times (\d+) is (\d+)\.|(\d+) x (\d+) = (\d+)\.": lambda a, b: a * b,
}


def test_shipped_chats_are_well_formed_and_right() -> None:
    rows = _rows("tiny_chat.jsonl")
    assert len(rows) == 200
    multi_turn = 0
    for row in rows:
        messages = row["messages"]
        roles = [m["role"] for m in messages]
        assert all(list(m) == ["role", "content"] and m["content"].strip() for m in messages)
        turns = roles[1:] if roles[0] == "system" else roles
        assert "system" not in turns, roles
        assert turns[0] == "user", roles
        assert turns[-1] == "assistant", roles
        assert all(a != b for a, b in itertools.pairwise(turns)), roles  # user and assistant alternate
        multi_turn += turns.count("user") > 1
        for m in messages:
            for pattern, op in _CHAT_ANSWERS.items():
                match = re.fullmatch(pattern, m["content"])
                if match:
                    a, b, c = (int(g) for g in match.groups() if g is not None)
                    assert op(a, b) == c, m["content"]
    assert sum(r["messages"][0]["role"] == "system" for r in rows) >= 20
    assert multi_turn >= 40


def _chatml(messages: list[dict[str, str]], add_generation_prompt: bool) -> str:
    text = "".join(f"<|im_start|>{m['role']}\n{m['content']}<|im_end|>\n" for m in messages)
    return text + ("<|im_start|>assistant\n" if add_generation_prompt else "")


def test_shipped_chat_template_renders_chatml_in_transformers() -> None:
    import transformers

    tokenizer = transformers.PreTrainedTokenizerFast(tokenizer_file=str(ASSETS.joinpath("shakespeare_tokenizer.json")))
    tokenizer.chat_template = ASSETS.joinpath("tiny_chat_template.jinja").read_text(encoding="utf-8")
    for row in _rows("tiny_chat.jsonl")[:50]:
        messages = row["messages"]
        assert tokenizer.apply_chat_template(messages, tokenize=False) == _chatml(messages, False)
        prompt = messages[:-1]
        assert tokenizer.apply_chat_template(prompt, tokenize=False, add_generation_prompt=True) == _chatml(
            prompt, True
        )
    with pytest.raises(Exception, match="unknown role 'tool'"):
        tokenizer.apply_chat_template([{"role": "tool", "content": "42"}], tokenize=False)
    late_system = [{"role": "user", "content": "hi"}, {"role": "system", "content": "be brief"}]
    with pytest.raises(Exception, match="system message may only come first"):
        tokenizer.apply_chat_template(late_system, tokenize=False)


# --- the tutorials -------------------------------------------------------------------------------------------


def _split_args(args: list[str]) -> tuple[list[str], list[str]]:
    """``--config_path A B --x.y V --z=W`` -> (``[A, B]``, ``["x.y=V", "z=W"]``)."""
    paths: list[str] = []
    overrides: list[str] = []
    i = 0
    while i < len(args):
        arg = args[i]
        assert arg.startswith("--"), f"unexpected argument {arg!r}"
        if arg == "--config_path":
            i += 1
            while i < len(args) and not args[i].startswith("--"):
                paths.append(args[i])
                i += 1
        elif "=" in arg:
            overrides.append(arg[2:])
            i += 1
        else:
            overrides.append(f"{arg[2:]}={args[i + 1]}")
            i += 2
    return paths, overrides


def _config_class(script: str) -> type:
    from ponente.trainer.main.lora_lm import LoraLmConfig
    from ponente.trainer.main.sft import SftConfig

    return {"ponente-sft": SftConfig, "ponente-lora-lm": LoraLmConfig}[script]


def _write_config_files(page: str, directory: Path) -> None:
    for block in blocks(DOCS / page):
        if block.lang == "yaml" and block.title:
            (directory / block.title).write_text(block.code + "\n", encoding="utf-8")


def test_tutorial_commands_resolve(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Every documented command names a console script, and its configuration resolves (nothing runs)."""
    from ponente.trainer.config import load_config

    monkeypatch.chdir(tmp_path)
    scripts = console_scripts()
    resolved = 0
    for page in PAGES:
        _write_config_files(page, tmp_path)
        for line, argv in page_commands(page):
            assert argv[0] in scripts, f"{page}:{line}: {argv[0]} is not a console script of ponente-trainer"
            if "--help" in argv:
                continue
            paths, overrides = _split_args(argv[1:])
            load_config(_config_class(argv[0]), paths, overrides=overrides)
            resolved += 1
    assert resolved >= 6


def _stand_ins(directory: Path, model: Path) -> dict[str, str]:
    """Local stand-ins for the checkpoint and the data files the pages name by placeholder paths."""
    instructions = _rows("tiny_instructions.jsonl")
    corpus = directory / "corpus.jsonl"
    lines = [json.dumps({"text": " ".join(v for v in r.values() if v)}) for r in instructions]
    corpus.write_text("\n".join(lines) + "\n", encoding="utf-8")
    alpaca = directory / "alpaca_data.json"  # a JSON list, as Stanford's file is
    alpaca.write_text(json.dumps(instructions, indent=1), encoding="utf-8")
    qa = directory / "my_qa.jsonl"
    lines = [
        json.dumps({"question": f"{r['instruction']} {r['input']}".strip(), "answer": r["output"]})
        for r in instructions
    ]
    qa.write_text("\n".join(lines) + "\n", encoding="utf-8")
    return {
        MODEL: str(model),
        "/path/to/corpus.jsonl": str(corpus),
        "/path/to/alpaca_data.json": str(alpaca),
        "/path/to/my_qa.jsonl": str(qa),
        "/path/to/my_chats.jsonl": str(ASSETS.joinpath("tiny_chat.jsonl")),
    }


def _swap(text: str, stand_ins: dict[str, str], where: str) -> str:
    unknown = sorted(set(PLACEHOLDER.findall(text)) - set(stand_ins))
    assert not unknown, f"{where}: placeholders {unknown} have no stand-in in test_tutorials.py"
    return PLACEHOLDER.sub(lambda m: stand_ins[m.group(0)], text)


def _shrink(run: int) -> list[str]:
    """Overrides appended to every training command: a few short float32 steps on one CPU, logged locally."""
    return [
        "--trainer.num_train_steps", "3",
        "--trainer.train_batch_size", "4",
        "--trainer.per_device_parallelism", "-1",
        "--trainer.tensor_parallel_axes", "null",
        "--trainer.mp", "f32",
        "--trainer.wandb", "null",
        "--trainer.tracker", f"{{type: json, path: metrics-{run}.jsonl}}",
        "--trainer.steps_per_eval", "1000",
        "--trainer.max_eval_batches", "1",
        "--trainer.compilation_cache_dir", "null",
        "--trainer.progress_bar", "false",
        "--max_train_length", "64",
        "--data.workers", "0",
    ]  # fmt: skip


def _run_command(argv: list[str], run: int, where: str, workdir: Path) -> str:
    module, function = console_scripts()[argv[0]].split(":")
    args = argv[1:] if "--help" in argv else argv[1:] + _shrink(run)
    code = f"import sys; from {module} import {function}; sys.exit({function}())"
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "JAX_PLATFORMS": "cpu"}
    done = subprocess.run(
        [sys.executable, "-c", code, *args], cwd=workdir, env=env, capture_output=True, text=True, timeout=900
    )
    assert done.returncode == 0, f"{where}: {' '.join(argv)} failed:\n{done.stdout[-3000:]}\n{done.stderr[-6000:]}"
    return done.stdout


@pytest.fixture(scope="module")
def tiny_llama(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from finetune_support import write_tiny_llama

    return write_tiny_llama(tmp_path_factory.mktemp("checkpoint") / "Llama-2-7b-hf")


_PROMISED = {
    "finetune-lora.md": [
        "out/lora-adapter/adapter_config.json",
        "out/lora-adapter/adapter_model.safetensors",
        "out/lora-merged/config.json",
        "out/lora-merged/model.safetensors",
        "checkpoints/llama2-lora",
    ],
    "instruction-tuning.md": [
        "out/tiny-sft/config.json",
        "out/alpaca-sft/config.json",
        "out/qa-sft/config.json",
        "out/chat-sft/config.json",
        "out/alpaca-lora/adapter_config.json",
        "out/alpaca-lora-merged/config.json",
    ],
}
"""Outputs each page says its commands write."""


@pytest.mark.integration
@pytest.mark.parametrize("page", PAGES)
def test_tutorial_runs(page: str, tiny_llama: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Replay the page: its config files, its commands (shrunk), its Python blocks, on a tiny random Llama."""
    import numpy as np

    workdir = tmp_path / "work"
    workdir.mkdir()
    stand_ins = _stand_ins(tmp_path, tiny_llama)
    namespace: dict[str, object] = {"__name__": "__tutorial__"}
    runs = 0
    monkeypatch.chdir(workdir)
    for block in blocks(DOCS / page):
        where = f"{page}:{block.line}"
        if block.lang == "yaml" and block.title:
            (workdir / block.title).write_text(_swap(block.code, stand_ins, where) + "\n", encoding="utf-8")
        elif block.lang == "bash":
            for argv in commands(block):
                argv = [_swap(arg, stand_ins, where) for arg in argv]
                out = _run_command(argv, runs, where, workdir)
                if "--help" in argv:
                    assert "lora" in out or "data" in out, f"{where}: --help printed {out[:200]!r}"
                    continue
                records = [json.loads(line) for line in (workdir / f"metrics-{runs}.jsonl").read_text().splitlines()]
                losses = [r["train/loss"] for r in records if "train/loss" in r]
                assert len(losses) == 3, f"{where}: losses {losses}"
                assert np.all(np.isfinite(losses)), f"{where}: losses {losses}"
                runs += 1
        elif block.lang == "py":
            exec(compile(_swap(block.code, stand_ins, where), where, "exec"), namespace)
    assert runs >= 1
    missing = [p for p in _PROMISED[page] if not (workdir / p).exists()]
    assert not missing, f"{page}: promised outputs not written: {missing}"
    if page == "finetune-lora.md":
        _check_peft_matches_merged(namespace)


def _check_peft_matches_merged(namespace: dict[str, object]) -> None:
    """The page's PEFT model and merged model agree, and the trained adapter is not a no-op."""
    import torch

    model, merged, inputs = namespace["model"], namespace["merged"], namespace["inputs"]
    with torch.no_grad():
        adapted = model(**inputs).logits  # type: ignore[operator]
        plain = merged(**inputs).logits  # type: ignore[operator]
        with model.disable_adapter():  # type: ignore[attr-defined]
            base = model(**inputs).logits  # type: ignore[operator]
    assert torch.allclose(adapted, plain, atol=1e-4), float((adapted - plain).abs().max())
    assert float((adapted - base).abs().max()) > 1e-6, "the trained adapter does not change the logits"
