"""``ponente-serve`` over a continuous-batching engine: requests join the running batch, ``/v1/reset_prefix_cache``.

A live server on localhost with a tiny random Llama; references: ``Engine.generate`` of each request alone.
"""

import concurrent.futures
import time

import httpx
import pytest
from finetune_support import write_tiny_llama

from ponente.trainer.inference import Engine, GenerationConfig, load_model
from ponente.trainer.serve import ServerLimits, ServerThread, create_app


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    model, tokenizer = load_model(str(write_tiny_llama(tmp_path_factory.mktemp("tiny_llama"), max_positions=64)))
    engine = Engine(model, tokenizer, max_batch_size=4, max_seq_len=64, page_size=4, prefill_chunk=8)
    app = create_app(engine, tokenizer, limits=ServerLimits(model_name="tiny", max_seq_len=64), api_key="k")
    with ServerThread(app) as server:
        yield server, engine, tokenizer


def _post(server, path, body=None, key="k"):
    headers = {} if key is None else {"Authorization": f"Bearer {key}"}
    return httpx.post(f"{server.base_url}/{path}", json=body or {}, headers=headers, timeout=120)


def test_a_short_request_sent_after_a_long_one_completes_first(served):
    server, engine, tokenizer = served
    long_ids, short_ids = tokenizer.encode("The quick brown fox").ids, tokenizer.encode("Hi").ids
    long_body = {"model": "tiny", "prompt": long_ids, "max_tokens": 40, "temperature": 0, "stop": None}
    short_body = {"model": "tiny", "prompt": short_ids, "max_tokens": 2, "temperature": 0}
    finished: list[str] = []

    def run(name, body):
        response = _post(server, "completions", body)
        finished.append(name)
        return response.json()["choices"][0]["text"]

    with concurrent.futures.ThreadPoolExecutor(2) as pool:
        first = pool.submit(run, "long", long_body)
        deadline = time.monotonic() + 60
        while not engine.busy:  # the long request is in the batch
            assert time.monotonic() < deadline
            time.sleep(0.001)
        second = pool.submit(run, "short", short_body)
        long_text, short_text = first.result(), second.result()
    assert finished == ["short", "long"]
    alone = Engine(engine.model, tokenizer, max_batch_size=4, max_seq_len=64, page_size=4, prefill_chunk=8)
    stops = GenerationConfig().stop_token_ids
    assert long_text == alone.generate([long_ids], GenerationConfig(max_new_tokens=40, stop_token_ids=stops))[0].text
    assert short_text == alone.generate([short_ids], GenerationConfig(max_new_tokens=2))[0].text


def test_reset_prefix_cache_needs_the_key_and_empties_the_cache(served):
    server, engine, tokenizer = served
    prompt = tokenizer.encode("one two three four five six seven eight nine ten").ids
    body = {"model": "tiny", "prompt": prompt, "max_tokens": 3, "temperature": 0}
    first = _post(server, "completions", body).json()["choices"][0]["text"]
    assert engine._batch is not None
    assert engine._batch.pool.cached > 0
    hits = engine.prefix_cache_hits
    assert _post(server, "completions", body).json()["choices"][0]["text"] == first
    assert engine.prefix_cache_hits > hits  # the second request reused the first one's pages
    assert _post(server, "reset_prefix_cache", key=None).status_code == 401
    assert _post(server, "reset_prefix_cache", key="wrong").status_code == 401
    response = _post(server, "reset_prefix_cache")
    assert response.status_code == 200
    assert response.json() == {"status": "ok"}
    hits = engine.prefix_cache_hits
    assert _post(server, "completions", body).json()["choices"][0]["text"] == first
    assert engine.prefix_cache_hits == hits  # nothing was cached any more
