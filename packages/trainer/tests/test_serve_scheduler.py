"""The server's request checking and batching scheduler, without a model or a network (fake engines)."""

import dataclasses
import threading
import time

import pytest

from ponente.trainer.inference import Completion, GenerationConfig
from ponente.trainer.serve import ApiError, BatchScheduler, Job, ServerLimits, parse_request

LIMITS = ServerLimits(model_name="tiny", max_seq_len=64, max_tokens=32, max_prompts=4)


class GatedEngine:
    """Records each ``generate`` call; a call blocks until ``gate`` is set; ``fail`` makes the next call raise."""

    max_batch_size = 4

    def __init__(self) -> None:
        self.calls: list[tuple[list[list[int]], list[GenerationConfig]]] = []
        self.gate = threading.Event()
        self.started = threading.Event()
        self.fail = False

    def generate(self, prompts, configs, *, on_token=None):
        self.calls.append((prompts, list(configs)))
        self.started.set()
        assert self.gate.wait(10)
        if self.fail:
            self.fail = False
            raise RuntimeError("device lost")
        out = []
        for i, (prompt, config) in enumerate(zip(prompts, configs, strict=True)):
            tokens = [t + config.seed for t in prompt]  # a function of the row alone
            if on_token is not None:
                for t in tokens:
                    on_token(i, t, str(t), -1.0)
            out.append(Completion(list(prompt), tokens, " ".join(map(str, tokens)), None, "length"))
        return out


def _job(prompts, results, seed=0):
    return Job(prompts, GenerationConfig(max_new_tokens=4, seed=seed), on_done=results.append)


def _wait(predicate, timeout=10.0):
    deadline = time.monotonic() + timeout
    while not predicate():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.005)


def test_requests_arriving_during_a_batch_run_together_in_the_next():
    engine = GatedEngine()
    scheduler = BatchScheduler(engine, max_batch_size=4).start()
    try:
        results: list = []
        first = _job([[1, 2]], results)
        scheduler.submit(first)
        assert engine.started.wait(10)
        waiting = [_job([[10 * k]], results, seed=k) for k in range(1, 4)]
        big = _job([[7], [8]], results)  # does not fit with the three others: waits for the batch after
        for job in [*waiting, big]:
            scheduler.submit(job)
        assert scheduler.pending == 4
        engine.gate.set()
        _wait(lambda: len(results) == 5)
        assert [len(p) for p, _ in engine.calls] == [1, 3, 2]
        assert engine.calls[1][0] == [[10], [20], [30]]
        assert [c.seed for c in engine.calls[1][1]] == [1, 2, 3]  # each row keeps its own config
        assert list(scheduler.batch_sizes) == [1, 3, 2]
        by_prompt = {tuple(c.prompt_tokens): c.tokens for r in results for c in r}
        assert by_prompt[(20,)] == [22]
        assert by_prompt[(7,)] == [7]
        assert by_prompt[(1, 2)] == [1, 2]
    finally:
        engine.gate.set()
        scheduler.stop()


def test_cancelled_jobs_are_dropped_and_failures_reach_only_their_batch():
    engine = GatedEngine()
    scheduler = BatchScheduler(engine, max_batch_size=4).start()
    try:
        results: list = []
        scheduler.submit(_job([[1]], results))
        assert engine.started.wait(10)
        gone = _job([[2]], results)
        scheduler.submit(gone)
        gone.cancelled.set()  # the client disconnected while waiting
        engine.fail = True
        engine.gate.set()
        _wait(lambda: len(results) == 1)
        assert isinstance(results[0], RuntimeError)
        scheduler.submit(_job([[3]], results))
        _wait(lambda: len(results) == 2)
        assert results[1][0].tokens == [3]
        assert [p for p, _ in engine.calls] == [[[1]], [[3]]]
    finally:
        engine.gate.set()
        scheduler.stop()


def test_streaming_callbacks_go_to_their_own_job():
    engine = GatedEngine()
    engine.gate.set()
    scheduler = BatchScheduler(engine, max_batch_size=4, gather_s=0.05).start()
    try:
        seen: dict[str, list] = {"a": [], "b": []}
        done: list = []
        for name, prompt in (("a", [[5, 6]]), ("b", [[7]])):
            job = Job(prompt, GenerationConfig(max_new_tokens=4), on_done=done.append)
            job.on_token = lambda i, t, d, lp, name=name: seen[name].append((i, t))
            scheduler.submit(job)
        _wait(lambda: len(done) == 2)
        assert seen == {"a": [(0, 5), (0, 6)], "b": [(0, 7)]}
    finally:
        scheduler.stop()


def test_submit_limits():
    engine = GatedEngine()
    scheduler = BatchScheduler(engine, max_batch_size=2, max_pending=1)
    with pytest.raises(RuntimeError, match="not running"):
        scheduler.submit(_job([[1]], []))
    scheduler.start()
    try:
        with pytest.raises(ValueError, match="prompts"):
            scheduler.submit(_job([[1], [2], [3]], []))
    finally:
        engine.gate.set()
        scheduler.stop()


def test_parse_completion_request():
    req = parse_request(
        {
            "model": "tiny",
            "prompt": ["a", "b"],
            "max_tokens": 5,
            "temperature": 0,
            "stop": "\n",
            "logprobs": 1,
            "seed": 3,
            "stream": True,
            "stream_options": {"include_usage": True},
        },
        "completions",
        LIMITS,
    )
    assert (req.prompts, req.max_tokens, req.temperature, req.stop, req.logprobs, req.seed) == (
        ("a", "b"),
        5,
        0.0,
        ("\n",),
        True,
        3,
    )
    assert req.stream
    assert req.include_usage
    assert parse_request({"prompt": [[1, 2], [3]]}, "completions", LIMITS).prompts == ((1, 2), (3,))
    assert parse_request({"prompt": [1, 2]}, "completions", LIMITS).prompts == ((1, 2),)


def test_parse_chat_request():
    req = parse_request(
        {
            "messages": [{"role": "user", "content": [{"type": "text", "text": "Hi"}, {"type": "text", "text": "!"}]}],
            "max_completion_tokens": 3,
            "logprobs": True,
            "top_p": 0.5,
        },
        "chat",
        LIMITS,
    )
    assert req.messages == ({"role": "user", "content": "Hi!"},)
    assert (req.max_tokens, req.logprobs, req.top_p, req.temperature) == (3, True, 0.5, 1.0)


@pytest.mark.parametrize(
    ("endpoint", "body", "param"),
    [
        ("completions", [], None),
        ("completions", {}, "prompt"),
        ("completions", {"prompt": None}, "prompt"),
        ("completions", {"prompt": []}, "prompt"),
        ("completions", {"prompt": [[]]}, "prompt"),
        ("completions", {"prompt": [1.5]}, "prompt"),
        ("completions", {"prompt": [-1]}, "prompt"),
        ("completions", {"prompt": ["a"] * 5}, "prompt"),
        ("completions", {"prompt": "a", "max_tokens": 0}, "max_tokens"),
        ("completions", {"prompt": "a", "max_tokens": 33}, "max_tokens"),
        ("completions", {"prompt": "a", "max_tokens": "8"}, "max_tokens"),
        ("completions", {"prompt": "a", "temperature": "hot"}, "temperature"),
        ("completions", {"prompt": "a", "temperature": 3}, "temperature"),
        ("completions", {"prompt": "a", "top_p": 0}, "top_p"),
        ("completions", {"prompt": "a", "n": 2}, "n"),
        ("completions", {"prompt": "a", "logprobs": 5}, "logprobs"),
        ("completions", {"prompt": "a", "echo": True}, "echo"),
        ("completions", {"prompt": "a", "stop": [1]}, "stop"),
        ("completions", {"prompt": "a", "stop": ["a", "b", "c", "d", "e"]}, "stop"),
        ("completions", {"prompt": "a", "stream": "yes"}, "stream"),
        ("completions", {"prompt": "a", "frequency_penalty": 1}, "frequency_penalty"),
        ("completions", {"prompt": "a", "seed": 2**64}, "seed"),
        ("completions", {"prompt": "a", "bogus": 1}, "bogus"),
        ("chat", {"messages": "hi"}, "messages"),
        ("chat", {"messages": []}, "messages"),
        ("chat", {"messages": [{"content": "hi"}]}, "messages"),
        ("chat", {"messages": [{"role": "user", "content": 3}]}, "messages"),
        ("chat", {"messages": [{"role": "user", "content": "hi"}], "top_logprobs": 3}, "top_logprobs"),
        ("chat", {"messages": [{"role": "user", "content": "hi"}], "prompt": "x"}, "prompt"),
    ],
)
def test_bad_requests_name_the_parameter(endpoint, body, param):
    with pytest.raises(ApiError) as info:
        parse_request(body, endpoint, LIMITS)
    assert info.value.status == 400
    assert info.value.param == param
    error = info.value.body()["error"]
    assert error["type"] == "invalid_request_error"
    assert "\n" not in error["message"]


def test_unknown_model_is_404():
    with pytest.raises(ApiError) as info:
        parse_request({"model": "gpt-4", "prompt": "a"}, "completions", LIMITS)
    assert info.value.status == 404
    assert info.value.code == "model_not_found"


def test_limits_are_checked():
    with pytest.raises(ValueError, match="max_tokens"):
        dataclasses.replace(LIMITS, max_tokens=0)
