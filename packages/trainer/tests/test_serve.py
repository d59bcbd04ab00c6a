"""``ponente-serve`` against the official ``openai`` client: a live uvicorn server on localhost, a tiny random Llama.

The reference for every completion is ``Engine.generate`` called directly with the same prompt tokens and settings;
chat prompts are tokenized independently by ``transformers``' ``apply_chat_template``, and log-probs are checked
against a full forward pass of the ``transformers`` model.
"""

import concurrent.futures
import importlib.resources
import json
import threading
import time

import httpx
import numpy as np
import openai
import pytest
from finetune_support import write_tiny_llama

from ponente.trainer.inference import Engine, GenerationConfig, eos_token_ids, load_model
from ponente.trainer.serve import ChatTemplate, ServerLimits, ServerThread, create_app

MAX_SEQ_LEN = 128
MESSAGES = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Name a colour."}]


class GatedEngine:
    """The real engine, except that ``generate`` waits while ``gate`` is clear and can be made to fail once."""

    def __init__(self, engine: Engine) -> None:
        self.engine = engine
        self.gate = threading.Event()
        self.gate.set()
        self.running = threading.Event()
        self.fail = False
        self.poison: list[int] | None = None  # a prompt that fails every batch it is in
        self.token_delay_s = 0.0

    def __getattr__(self, name):
        return getattr(self.engine, name)

    def generate(self, prompts, config, *, on_token=None):
        self.running.set()
        try:
            assert self.gate.wait(60)
            if self.fail:
                self.fail = False
                raise RuntimeError("simulated device failure")
            if self.poison is not None and self.poison in [list(p) for p in prompts]:
                raise RuntimeError("simulated bad request")
            if on_token is not None and self.token_delay_s:
                inner = on_token

                def on_token(*args):  # a slow stream: the client can leave in the middle of it
                    time.sleep(self.token_delay_s)
                    inner(*args)

            return self.engine.generate(prompts, config, on_token=on_token)
        finally:
            self.running.clear()


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    path = write_tiny_llama(tmp_path_factory.mktemp("tiny_llama"))
    template = importlib.resources.files("ponente.trainer.assets").joinpath("tiny_chat_template.jinja")
    (path / "chat_template.jinja").write_text(template.read_text(encoding="utf-8"), encoding="utf-8")
    config = {"tokenizer_class": "PreTrainedTokenizerFast", "bos_token": "<s>", "eos_token": "</s>"}
    (path / "tokenizer_config.json").write_text(json.dumps(config), encoding="utf-8")
    return path


@pytest.fixture(scope="module")
def served(folder):
    model, tokenizer = load_model(str(folder))
    # static batches: these tests gate and fail whole batches (continuous batching: test_serve_continuous)
    engine = GatedEngine(Engine(model, tokenizer, max_batch_size=4, max_seq_len=MAX_SEQ_LEN, continuous=False))
    stops = eos_token_ids(str(folder))
    assert stops == (3,)  # write_tiny_llama's </s>
    app = create_app(
        engine,
        tokenizer,
        limits=ServerLimits(model_name="tiny", max_seq_len=MAX_SEQ_LEN, max_tokens=48, max_prompts=4),
        chat_template=ChatTemplate.load(tokenizer, folder),
        stop_token_ids=stops,
    )
    with ServerThread(app) as server:
        yield server, engine, app, tokenizer, stops


@pytest.fixture
def client(served):
    return openai.OpenAI(base_url=served[0].base_url, api_key="unused", max_retries=0, timeout=120)


def _direct(served, prompt_ids, **settings):
    """The reference: ``Engine.generate`` on the real engine, bypassing the server."""
    config = GenerationConfig(stop_token_ids=served[4], **settings)
    return served[1].engine.generate([prompt_ids], config)[0]


def test_models(client):
    assert [m.id for m in client.models.list()] == ["tiny"]


def test_completion_equals_the_engine_and_logprobs_equal_transformers(client, served, folder):
    import torch
    import transformers

    tokenizer = served[3]
    prompt = "The quick brown fox"
    ids = tokenizer.encode(prompt).ids
    response = client.completions.create(model="tiny", prompt=prompt, max_tokens=10, temperature=0, logprobs=1)
    choice = response.choices[0]
    expected = _direct(served, ids, max_new_tokens=10, logprobs=True)
    assert choice.text == expected.text
    assert choice.finish_reason == expected.finish_reason
    assert response.usage.prompt_tokens == len(ids)
    assert response.usage.completion_tokens == len(expected.tokens)
    got = np.asarray(choice.logprobs.token_logprobs)
    np.testing.assert_allclose(got, expected.logprobs, atol=1e-6)

    hf = transformers.AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32)
    sequence = torch.tensor([ids + expected.tokens])
    with torch.no_grad():
        logits = hf(sequence).logits[0].double()
    reference = torch.log_softmax(logits, -1)[len(ids) - 1 : -1].gather(1, sequence[0, len(ids) :, None])[:, 0]
    np.testing.assert_allclose(got, reference.numpy(), atol=2e-4)
    # the greedy tokens are the argmax of the independent forward
    assert expected.tokens == logits[len(ids) - 1 : -1].argmax(-1).tolist()


def test_token_id_prompts_and_several_prompts(client, served):
    prompts = [[5, 6, 7], [8, 9]]
    response = client.completions.create(model="tiny", prompt=prompts, max_tokens=6, temperature=0)
    assert [c.index for c in response.choices] == [0, 1]
    for ids, choice in zip(prompts, response.choices, strict=True):
        assert choice.text == _direct(served, ids, max_new_tokens=6).text


def test_seeded_sampling_equals_the_engine_whatever_the_batch(client, served):
    tokenizer = served[3]
    prompt = "Once upon a time"
    settings = {"max_tokens": 12, "temperature": 1.0, "top_p": 0.9, "seed": 1234}
    expected = _direct(served, tokenizer.encode(prompt).ids, max_new_tokens=12, temperature=1.0, top_p=0.9, seed=1234)
    with concurrent.futures.ThreadPoolExecutor(2) as pool:
        texts = list(pool.map(lambda _: client.completions.create(model="tiny", prompt=prompt, **settings), range(2)))
    assert [r.choices[0].text for r in texts] == [expected.text] * 2


def test_chat_equals_the_engine_on_the_transformers_chat_template(client, served, folder):
    import transformers

    hf_tokenizer = transformers.AutoTokenizer.from_pretrained(folder)
    ids = hf_tokenizer.apply_chat_template(MESSAGES, add_generation_prompt=True, tokenize=True)
    ids = list(ids["input_ids"] if isinstance(ids, dict) or hasattr(ids, "keys") else ids)
    response = client.chat.completions.create(
        model="tiny", messages=MESSAGES, max_tokens=8, temperature=0, logprobs=True
    )
    expected = _direct(served, ids, max_new_tokens=8, logprobs=True)
    choice = response.choices[0]
    assert choice.message.role == "assistant"
    assert choice.message.content == expected.text
    assert response.usage.prompt_tokens == len(ids)
    np.testing.assert_allclose([t.logprob for t in choice.logprobs.content], expected.logprobs, atol=1e-6)


def test_streaming_completion(client, served):
    tokenizer = served[3]
    prompt = "Hello there"
    chunks = list(
        client.completions.create(
            model="tiny",
            prompt=prompt,
            max_tokens=12,
            temperature=0,
            stream=True,
            stream_options={"include_usage": True},
        )
    )
    expected = _direct(served, tokenizer.encode(prompt).ids, max_new_tokens=12)
    text = "".join(c.choices[0].text for c in chunks if c.choices)
    assert text == expected.text
    finishes = [c.choices[0].finish_reason for c in chunks if c.choices]
    assert finishes[-1] == expected.finish_reason
    assert set(finishes[:-1]) == {None}
    assert chunks[-1].usage.completion_tokens == len(expected.tokens)
    assert len({c.id for c in chunks}) == 1


def test_streaming_chat_with_a_stop_string(client, served):
    tokenizer = served[3]
    full = client.chat.completions.create(model="tiny", messages=MESSAGES, max_tokens=16, temperature=0)
    content = full.choices[0].message.content
    stop = content[len(content) // 2 : len(content) // 2 + 2]
    assert stop.strip(), content
    chunks = list(
        client.chat.completions.create(
            model="tiny", messages=MESSAGES, max_tokens=16, temperature=0, stop=stop, stream=True
        )
    )
    assert chunks[0].choices[0].delta.role == "assistant"
    text = "".join(c.choices[0].delta.content or "" for c in chunks)
    assert text == content[: content.index(stop)]
    assert chunks[-1].choices[0].finish_reason == "stop"
    assert tokenizer is not None


def test_sse_wire_format(served):
    body = {"model": "tiny", "prompt": "Hi", "max_tokens": 3, "temperature": 0, "stream": True}
    with httpx.stream("POST", f"{served[0].base_url}/completions", json=body, timeout=60) as response:
        assert response.headers["content-type"].startswith("text/event-stream")
        events = [line for line in response.iter_lines() if line]
    assert all(e.startswith("data: ") for e in events)
    assert events[-1] == "data: [DONE]"
    assert all(json.loads(e[6:])["object"] == "text_completion" for e in events[:-1])


@pytest.mark.parametrize(
    ("call", "param"),
    [
        (lambda c: c.completions.create(model="tiny", prompt="Hi", temperature="hot"), "temperature"),
        (lambda c: c.completions.create(model="tiny", prompt="Hi", n=2), "n"),
        (lambda c: c.completions.create(model="tiny", prompt="Hi", max_tokens=10_000), "max_tokens"),
        (lambda c: c.completions.create(model="tiny", prompt="", max_tokens=4), "prompt"),
        (lambda c: c.completions.create(model="tiny", prompt=[[10_000_000]]), "prompt"),
        (lambda c: c.completions.create(model="tiny", prompt="Hi", extra_body={"bogus": 1}), "bogus"),
        (lambda c: c.chat.completions.create(model="tiny", messages=[{"role": "robot", "content": "x"}]), "messages"),
        (lambda c: c.chat.completions.create(model="tiny", messages=[{"role": "user"}]), "messages"),
    ],
)
def test_bad_request_is_a_400_json_error(client, call, param):
    with pytest.raises(openai.BadRequestError) as info:
        call(client)
    assert info.value.status_code == 400
    assert info.value.body["type"] == "invalid_request_error"
    assert info.value.body["param"] == param
    assert client.completions.create(model="tiny", prompt="Hi", max_tokens=2).choices[0].text is not None


def test_over_long_prompt_is_a_400(client, served):
    prompt = " ".join(["word"] * 300)
    assert len(served[3].encode(prompt).ids) > MAX_SEQ_LEN
    with pytest.raises(openai.BadRequestError) as info:
        client.completions.create(model="tiny", prompt=prompt, max_tokens=4)
    assert info.value.code == "context_length_exceeded"
    assert info.value.param == "prompt"
    fits = " ".join(["word"] * 100)
    room = MAX_SEQ_LEN - len(served[3].encode(fits).ids)
    with pytest.raises(openai.BadRequestError) as info:
        client.completions.create(model="tiny", prompt=fits, max_tokens=room + 1)
    assert info.value.code == "context_length_exceeded"
    assert info.value.param == "max_tokens"
    assert client.completions.create(model="tiny", prompt=fits, max_tokens=room).usage.completion_tokens <= room


@pytest.mark.parametrize(
    ("path", "content", "status"),
    [
        ("/completions", b"{not json", 400),
        ("/completions", b"\xff\xfe", 400),
        ("/completions", b"[1, 2]", 400),
        ("/completions", b"[" * 20_000 + b"]" * 20_000, 400),  # nested too deep for the JSON parser
        ("/chat/completions", b'{"messages": null}', 400),
        ("/nowhere", b"{}", 404),
    ],
)
def test_garbage_gets_a_json_error(served, path, content, status):
    headers = {"Content-Type": "application/json"}
    response = httpx.post(f"{served[0].base_url}{path}", content=content, headers=headers, timeout=60)
    assert response.status_code == status
    assert set(response.json()["error"]) == {"message", "type", "param", "code"}


def test_unknown_model_is_404(client):
    with pytest.raises(openai.NotFoundError):
        client.completions.create(model="gpt-4", prompt="Hi")


def test_disconnect_mid_stream_then_the_server_still_answers(client, served):
    engine = served[1]
    body = {"model": "tiny", "prompt": "A long story", "max_tokens": 40, "temperature": 0, "stream": True}
    engine.token_delay_s = 0.05  # 40 tokens take 2 s
    try:
        for _ in range(2):
            with httpx.stream("POST", f"{served[0].base_url}/completions", json=body, timeout=60) as response:
                first = next(response.iter_lines())
                assert first.startswith("data: ")
            assert engine.running.is_set()  # the connection closed in the middle of the generation
    finally:
        engine.token_delay_s = 0.0
    deadline = time.monotonic() + 60
    while served[2].state.scheduler.pending or engine.running.is_set():
        assert time.monotonic() < deadline
        time.sleep(0.01)
    tokenizer = served[3]
    response = client.completions.create(model="tiny", prompt="Hello there", max_tokens=5, temperature=0)
    assert response.choices[0].text == _direct(served, tokenizer.encode("Hello there").ids, max_new_tokens=5).text


def test_concurrent_requests_are_batched(client, served):
    engine, scheduler, tokenizer = served[1], served[2].state.scheduler, served[3]
    prompts = ["one", "two two", "three three three", "four"]
    before = len(scheduler.batch_sizes)
    engine.gate.clear()
    try:
        with concurrent.futures.ThreadPoolExecutor(len(prompts)) as pool:
            first = pool.submit(
                client.completions.create, model="tiny", prompt=prompts[0], max_tokens=6, temperature=0
            )
            assert engine.running.wait(60)
            rest = [
                pool.submit(client.completions.create, model="tiny", prompt=p, max_tokens=6, temperature=0)
                for p in prompts[1:]
            ]
            deadline = time.monotonic() + 60
            while scheduler.pending < len(rest):
                assert time.monotonic() < deadline
                time.sleep(0.01)
            engine.gate.set()
            responses = [first.result(), *(f.result() for f in rest)]
    finally:
        engine.gate.set()
    assert list(scheduler.batch_sizes)[before:] == [1, 3]
    for prompt, response in zip(prompts, responses, strict=True):
        assert response.choices[0].text == _direct(served, tokenizer.encode(prompt).ids, max_new_tokens=6).text


def test_engine_failure_is_a_500_and_the_server_carries_on(client, served):
    served[1].fail = True
    with pytest.raises(openai.InternalServerError) as info:
        client.completions.create(model="tiny", prompt="Hi", max_tokens=3)
    assert "simulated device failure" in info.value.body["message"]
    assert client.completions.create(model="tiny", prompt="Hi", max_tokens=3).choices[0].finish_reason == "length"


def test_api_key(served):
    engine, tokenizer = served[1], served[3]
    app = create_app(
        engine, tokenizer, limits=ServerLimits(model_name="tiny", max_seq_len=MAX_SEQ_LEN), api_key="s3cret"
    )
    with ServerThread(app) as server:
        wrong = openai.OpenAI(base_url=server.base_url, api_key="guess", max_retries=0)
        with pytest.raises(openai.AuthenticationError) as info:
            wrong.models.list()
        assert info.value.status_code == 401
        assert info.value.body["code"] == "invalid_api_key"
        assert httpx.post(f"{server.base_url}/completions", json={"prompt": "Hi"}).status_code == 401
        right = openai.OpenAI(base_url=server.base_url, api_key="s3cret", max_retries=0)
        assert right.completions.create(model="tiny", prompt="Hi", max_tokens=2).usage.completion_tokens >= 1


@pytest.mark.integration
def test_entry_point_builds_the_app_from_a_folder(folder):
    from starlette.testclient import TestClient

    from ponente.trainer.main.serve import ServeConfig, build_app, main

    assert main(["--port", "8000"]) == 2  # no model: a configuration error (exit 2), not a traceback
    app = build_app(ServeConfig(hf_checkpoint=str(folder), max_tokens=8))
    assert app.state.limits.max_seq_len == 128  # the model's max_position_embeddings
    with TestClient(app) as http:
        assert http.get("/v1/models").json()["data"][0]["id"] == folder.name
        chat = {"messages": [{"role": "user", "content": "Hi"}], "max_tokens": 4, "temperature": 0}
        response = http.post("/v1/chat/completions", json=chat)
        assert response.status_code == 200, response.text
        assert response.json()["choices"][0]["message"]["role"] == "assistant"
        assert http.post("/v1/completions", json={"prompt": "Hi", "max_tokens": 9}).status_code == 400


def _small_request_answers(client):
    """A small request, answered while the server deals with hostile ones."""
    return client.completions.create(model="tiny", prompt="Hi", max_tokens=2, temperature=0).choices[0].text


@pytest.mark.parametrize(
    ("headers", "content", "status", "says"),
    [
        ({}, b'{"prompt": "Hi"}', 415, "Content-Type: expected application/json, got 'none'"),
        ({"Content-Type": "text/plain"}, b'{"prompt": "Hi"}', 415, "got 'text/plain'"),
        ({"Content-Type": "application/json"}, b'{"prompt": "a\\ud800b"}', 400, "prompt: not valid Unicode"),
        ({"Content-Type": "application/json"}, b'{"prompt": ["ok", "\\udfff"]}', 400, "prompt[1]: not valid"),
        (
            {"Content-Type": "application/json; charset=utf-8"},
            b'{"messages": [{"role": "user", "content": "\\ud83d"}]}',
            400,
            "messages[0].content: not valid Unicode",
        ),
    ],
)
def test_hardening_answers_4xx(served, client, headers, content, status, says):
    url = served[0].base_url + ("/chat/completions" if b"messages" in content else "/completions")
    response = httpx.post(url, content=content, headers=headers, timeout=60)
    assert response.status_code == status, response.text
    assert says in response.json()["error"]["message"]
    assert response.json()["error"]["type"] == "invalid_request_error"
    assert _small_request_answers(client)


def test_oversized_bodies_and_texts_are_refused_before_tokenizing(served, client):
    from ponente.trainer.serve import MAX_BODY_BYTES, body_limit, longest_token_chars

    tokenizer = served[3]
    longest = longest_token_chars(tokenizer)
    # independently: the longest token string of the vocabulary
    assert longest == max(len(t) for t in tokenizer.get_vocab(with_added_tokens=True))
    limit = body_limit(MAX_SEQ_LEN, 4, longest)
    assert limit < MAX_BODY_BYTES
    url = f"{served[0].base_url}/completions"
    calls = []
    original = tokenizer.encode

    def counting_encode(text, *args, **kwargs):
        calls.append(len(text))
        return original(text, *args, **kwargs)

    with concurrent.futures.ThreadPoolExecutor(2) as pool:
        small = pool.submit(_small_request_answers, client)
        # a body larger than any request to this context: 413 (declared length, and streamed without a length)
        big = json.dumps({"model": "tiny", "prompt": "x" * (limit + 10)}).encode()
        declared = httpx.post(url, content=big, headers={"Content-Type": "application/json"}, timeout=60)
        streamed = httpx.post(
            url, content=iter([big[i : i + 65536] for i in range(0, len(big), 65536)]),
            headers={"Content-Type": "application/json"}, timeout=60,
        )  # fmt: skip
        assert small.result(timeout=120)
    for response in (declared, streamed):
        assert response.status_code == 413, response.text
        assert f"({limit} bytes)" in response.json()["error"]["message"]
    # a text under the body limit but longer than the context can hold: refused without tokenizing it
    too_long = "y" * (MAX_SEQ_LEN * longest * 2 + 1)
    assert len(json.dumps({"prompt": too_long})) < limit
    served[1].engine.tokenizer.encode = counting_encode
    try:
        with pytest.raises(openai.BadRequestError) as info:
            client.completions.create(model="tiny", prompt=too_long, max_tokens=2)
        with pytest.raises(openai.BadRequestError) as chat_info:
            client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": too_long}])
    finally:
        del served[1].engine.tokenizer.encode
    assert info.value.code == "context_length_exceeded"
    assert "characters cannot fit" in info.value.body["message"]
    assert chat_info.value.param == "messages"
    assert not [n for n in calls if n >= len(too_long)], "the over-long text was tokenized"


def test_docs_are_off_unless_asked_for(served):
    base = served[0].base_url.removesuffix("/v1")
    for path in ("/docs", "/redoc", "/openapi.json"):
        assert httpx.get(base + path, timeout=30).status_code == 404
    engine, tokenizer = served[1], served[3]
    app = create_app(engine, tokenizer, limits=ServerLimits(model_name="tiny", max_seq_len=MAX_SEQ_LEN), docs=True)
    with ServerThread(app) as server:
        schema = httpx.get(server.base_url.removesuffix("/v1") + "/openapi.json", timeout=30)
        assert schema.status_code == 200
        assert "/v1/completions" in schema.json()["paths"]


def test_one_bad_request_fails_only_itself_in_a_batch(client, served):
    engine, scheduler, tokenizer = served[1], served[2].state.scheduler, served[3]
    engine.poison = tokenizer.encode("poison").ids
    before = len(scheduler.batch_sizes)
    engine.gate.clear()
    try:
        with concurrent.futures.ThreadPoolExecutor(3) as pool:
            first = pool.submit(client.completions.create, model="tiny", prompt="warm", max_tokens=2, temperature=0)
            assert engine.running.wait(60)
            bad = pool.submit(client.completions.create, model="tiny", prompt="poison", max_tokens=4, temperature=0)
            good = pool.submit(client.completions.create, model="tiny", prompt="fine", max_tokens=4, temperature=0)
            deadline = time.monotonic() + 60
            while scheduler.pending < 2:
                assert time.monotonic() < deadline
                time.sleep(0.01)
            engine.gate.set()
            first.result()
            assert (
                good.result().choices[0].text == _direct(served, tokenizer.encode("fine").ids, max_new_tokens=4).text
            )
            with pytest.raises(openai.InternalServerError) as info:
                bad.result()
    finally:
        engine.gate.set()
        engine.poison = None
    assert "simulated bad request" in info.value.body["message"]
    # the warm-up alone, the batch of two that failed, then each of its requests alone
    assert list(scheduler.batch_sizes)[before:] == [1, 2, 1, 1]


def test_health_reports_a_dead_scheduler(served):
    engine, tokenizer = served[1], served[3]
    app = create_app(engine, tokenizer, limits=ServerLimits(model_name="tiny", max_seq_len=MAX_SEQ_LEN))
    with ServerThread(app) as server:
        base = server.base_url.removesuffix("/v1")
        assert httpx.get(base + "/health", timeout=30).json()["status"] == "ok"
        scheduler = app.state.scheduler

        def broken():
            raise MemoryError("simulated crash of the scheduler")

        scheduler._take = broken
        response = httpx.post(
            f"{server.base_url}/completions", json={"model": "tiny", "prompt": "Hi", "max_tokens": 2}, timeout=60
        )
        assert response.status_code == 500
        assert "simulated crash" in response.json()["error"]["message"]
        health = httpx.get(base + "/health", timeout=30)
        assert health.status_code == 503
        assert "died: MemoryError: simulated crash" in health.json()["scheduler"]
        again = httpx.post(
            f"{server.base_url}/completions", json={"model": "tiny", "prompt": "Hi", "max_tokens": 2}, timeout=60
        )
        assert again.status_code == 503
        assert "scheduler is not running" in again.json()["error"]["message"]


def _hf_greedy(folder, ids, n, tokenizer):
    """The reference: the text of transformers' greedy generation of ``n`` tokens from the folder's weights, cut at
    the server's stop token."""
    import torch
    import transformers

    hf = transformers.AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32)
    out = hf.generate(torch.tensor([ids]), max_new_tokens=n, do_sample=False, eos_token_id=None, pad_token_id=0)
    tokens = out[0, len(ids) :].tolist()
    tokens = tokens[: tokens.index(3)] if 3 in tokens else tokens  # write_tiny_llama's </s> ends a completion
    return tokenizer.decode(tokens)


def test_update_weights_swaps_in_place_and_a_bad_folder_keeps_the_old_ones(client, served, folder, tmp_path, caplog):
    import logging

    import jax
    import torch
    import transformers

    engine, tokenizer = served[1], served[3]
    url = f"{served[0].base_url}/update_weights"
    ids = tokenizer.encode("The quick brown fox").ids

    def greedy():
        return client.completions.create(model="tiny", prompt=ids, max_tokens=6, temperature=0).choices[0].text

    before = _hf_greedy(folder, ids, 6, tokenizer)
    assert greedy() == before
    other = write_tiny_llama(tmp_path / "other", seed=1)
    after = _hf_greedy(other, ids, 6, tokenizer)
    assert after != before  # the two models really differ here
    try:
        with jax.log_compiles(True), caplog.at_level(logging.WARNING, logger="jax"):
            response = httpx.post(url, json={"path": str(other)}, timeout=120)
            assert response.status_code == 200, response.text
            assert greedy() == after
        compiled = [r.getMessage() for r in caplog.records if r.getMessage().startswith("Compiling")]
        assert not [m for m in compiled if "prefill" in m or "decode" in m], compiled
        # another shape: 400 naming the parameter, and the engine keeps the weights it had
        config = transformers.AutoConfig.from_pretrained(other)
        config.intermediate_size = 48
        transformers.LlamaForCausalLM(config).to(torch.float32).save_pretrained(tmp_path / "wider")
        bad = httpx.post(url, json={"path": str(tmp_path / "wider")}, timeout=120)
        assert bad.status_code == 400
        assert "mlp" in bad.json()["error"]["message"]
        assert "keeps its weights" in bad.json()["error"]["message"]
        missing = httpx.post(url, json={"path": str(tmp_path / "nowhere")}, timeout=120)
        assert missing.status_code == 400
        assert missing.json()["error"]["param"] == "path"
        assert greedy() == after
    finally:
        assert httpx.post(url, json={"path": str(folder)}, timeout=120).status_code == 200
    assert greedy() == before
    assert engine.engine.weights_version >= 2


def test_serve_config_steps_per_call_reaches_the_engine(monkeypatch):
    from ponente.trainer.main import serve as main_serve
    from ponente.trainer.main.serve import ServeConfig

    with pytest.raises(ValueError, match="steps_per_call: must be >= 1"):
        ServeConfig(hf_checkpoint="model", steps_per_call=0)
    import ponente.trainer.inference as inference
    import ponente.trainer.serve as serve_pkg

    seen: dict = {}
    monkeypatch.setattr(inference, "load_model", lambda *args, **kwargs: (object(), object()))
    monkeypatch.setattr(inference, "eos_token_ids", lambda source: ())
    monkeypatch.setattr(serve_pkg, "tokenizer_folder", lambda source: None)
    monkeypatch.setattr(serve_pkg, "app_for_model", lambda model, tokenizer, **kwargs: seen.update(kwargs))
    main_serve.build_app(ServeConfig(hf_checkpoint="model", steps_per_call=3))
    assert seen["engine_options"]["steps_per_call"] == 3
