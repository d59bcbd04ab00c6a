"""Shared pieces of the lm-eval tests: an exported tiny model and offline tasks over local jsonl files.

Nothing touches the network: the model is ``finetune_support``'s random Llama, loaded into Ponente and exported
again (the Hugging Face folder ``ponente.trainer.run.export_hf`` writes), and each task is a YAML file in a
temporary folder reading a jsonl file next to it (``dataset_path: json``).
"""

from __future__ import annotations

import json
import random
from pathlib import Path

from finetune_support import write_tiny_llama

MC_TASK = "ponente_tiny_mc"
GEN_TASK = "ponente_tiny_gen"
ROLLING_TASK = "ponente_tiny_rolling"

_WORDS = ["red", "blue", "green", "cat", "dog", "bird", "one", "two", "three", "sun", "moon", "rain", "tree", "house"]


def export_tiny_model(directory: Path) -> Path:
    """A random tiny Llama, round-tripped through Ponente and exported with its tokenizer, in ``directory/hf``."""
    from tokenizers import Tokenizer

    from ponente.models.hf import load_pretrained
    from ponente.trainer.run import export_hf

    source = write_tiny_llama(directory / "source", seed=3)
    model = load_pretrained(source)
    tokenizer = Tokenizer.from_file(str(source / "tokenizer.json"))
    return Path(export_hf(model, str(directory / "hf"), tokenizer=tokenizer, seq_len=model.config.seq_len))


def write_tasks(directory: Path, rows: int = 20) -> Path:
    """Three offline tasks in ``directory``: multiple choice, generation and rolling log-likelihood."""
    rng = random.Random(0)
    directory.mkdir(parents=True, exist_ok=True)
    docs = []
    for _ in range(rows):
        words = rng.sample(_WORDS, 4)
        docs.append(
            {
                "question": f"Which word comes after {' '.join(rng.sample(_WORDS, 3))}?",
                "choices": [f" {w}" for w in words],
                "answer": rng.randrange(4),
                "text": " ".join(rng.choice(_WORDS) for _ in range(rng.randrange(5, 60))),
            }
        )
    data = directory / "tiny.jsonl"
    data.write_text("".join(json.dumps(d) + "\n" for d in docs), encoding="utf-8")
    common = f"dataset_path: json\ndataset_kwargs:\n  data_files:\n    test: {data}\ntest_split: test\n"
    (directory / f"{MC_TASK}.yaml").write_text(
        f"task: {MC_TASK}\n{common}output_type: multiple_choice\n"
        'doc_to_text: "Question: {{question}}\\nAnswer:"\n'
        'doc_to_choice: "{{choices}}"\n'
        "doc_to_target: answer\n"
        "metric_list:\n  - metric: acc\n  - metric: acc_norm\n",
        encoding="utf-8",
    )
    (directory / f"{GEN_TASK}.yaml").write_text(
        f"task: {GEN_TASK}\n{common}output_type: generate_until\n"
        'doc_to_text: "Question: {{question}}\\nAnswer:"\n'
        'doc_to_target: "{{choices[answer]}}"\n'
        'generation_kwargs:\n  until: ["\\n", "."]\n  max_gen_toks: 6\n  do_sample: false\n'
        "metric_list:\n  - metric: exact_match\n",
        encoding="utf-8",
    )
    (directory / f"{ROLLING_TASK}.yaml").write_text(
        f"task: {ROLLING_TASK}\n{common}output_type: loglikelihood_rolling\n"
        'doc_to_text: ""\n'
        'doc_to_target: "{{text}}"\n'
        "metric_list:\n  - metric: word_perplexity\n  - metric: bits_per_byte\n",
        encoding="utf-8",
    )
    return directory
