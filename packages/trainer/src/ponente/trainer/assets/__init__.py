"""Packaged hello-world data: the works of Shakespeare, a byte-level BPE tokenizer, tiny fine-tuning sets.

Files (address them in configs as ``package://ponente.trainer.assets/<file>``):

- ``shakespeare_train.jsonl.gz``: 39 works, one ``{"text", "title"}`` JSON object per line;
- ``shakespeare_validation.jsonl.gz``: 3 held-out works (The Comedy of Errors, A Lover's Complaint, Macbeth);
- ``shakespeare_tokenizer.json``: byte-level BPE, 4096 entries, ``<|endoftext|>`` is id 0;
- ``tiny_instructions.jsonl``: 300 ``{"instruction", "input", "output"}`` records (supervised fine-tuning);
- ``tiny_chat.jsonl``: 200 ``{"messages": [{"role", "content"}, ...]}`` conversations (chat fine-tuning);
- ``tiny_chat_template.jinja``: a ChatML-style chat template for ``data.chat_template``.

See ``README.md`` next to this file for provenance, licence and how to rebuild them.
"""
