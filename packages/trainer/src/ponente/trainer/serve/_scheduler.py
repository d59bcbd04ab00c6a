"""The batching scheduler: one background thread feeds queued requests to the engine, several at a time.

With a continuous-batching engine (``engine.continuous``), the thread hands each request to the engine's running
batch as soon as it arrives (:meth:`~ponente.trainer.inference.Engine.submit`) and steps the batch while it has
work: a request joins at the next step and leaves when it ends, whatever the others do. If a step fails, the
requests in the batch fail with its error and the thread carries on. Otherwise (static batches):

Requests wait in a queue. Whenever the engine is free, the scheduler takes the waiting requests in order of
arrival, up to the engine's batch size, and runs them as one ``Engine.generate`` call, each prompt with its own
request's ``GenerationConfig`` (the engine samples each row from its own seed, so a request's completion does not
depend on what it is batched with); requests arriving meanwhile wait for the next batch. A request whose client
went away is dropped before its batch starts, and its tokens are discarded if it is already running. When a batch of
several requests fails, each of its requests that has not streamed a token yet runs again alone, so one bad request
fails only itself; the thread carries on. If the thread itself dies, :attr:`BatchScheduler.error` says why (the
server's ``/health`` reports it) and new requests are refused.
"""

from __future__ import annotations

import collections
import dataclasses
import logging
import threading
import time
from collections.abc import Callable, Sequence
from typing import Any

__all__ = ["BatchScheduler", "Job", "QueueFullError"]

logger = logging.getLogger(__name__)

TokenCallback = Callable[[int, int, str, "float | None"], None]
"""``on_token(prompt_index, token_id, text_delta, logprob)``, called on the scheduler's thread."""


class QueueFullError(RuntimeError):
    """The scheduler already holds its maximum number of waiting requests."""


@dataclasses.dataclass(eq=False)
class Job:
    """One request's prompts, generated as part of a batch.

    Attributes:
        prompts: token ids of each prompt.
        config: the ``GenerationConfig`` of every prompt of the request.
        on_token: called for each generated token (streaming), or None.
        on_done: called once with the completions (one per prompt) or the exception that failed the batch.
        cancelled: set when the client is gone: a waiting job is dropped, a running one gets no more callbacks.
    """

    prompts: Sequence[Sequence[int]]
    config: Any
    on_done: Callable[[Any], None]
    on_token: TokenCallback | None = None
    cancelled: threading.Event = dataclasses.field(default_factory=threading.Event)


class BatchScheduler:
    """Runs queued :class:`Job` objects through ``engine.generate`` in batches, on one background thread.

    Args:
        engine: a ``ponente.trainer.inference.Engine`` (or anything with its ``generate``).
        max_batch_size: prompts per ``generate`` call, at most.
        max_pending: waiting jobs, at most (:meth:`submit` raises :class:`QueueFullError` beyond).
        gather_s: how long to wait, once a job arrives at an idle engine, for others to join its batch.

    Example:
        ```python
        scheduler = BatchScheduler(engine, max_batch_size=8).start()
        scheduler.submit(Job([[1, 2, 3]], GenerationConfig(max_new_tokens=8), on_done=print))
        scheduler.stop()
        ```
    """

    def __init__(self, engine: Any, *, max_batch_size: int = 8, max_pending: int = 256, gather_s: float = 0.002):
        if max_batch_size < 1:
            raise ValueError(f"max_batch_size: must be >= 1, got {max_batch_size}")
        if max_pending < 1:
            raise ValueError(f"max_pending: must be >= 1, got {max_pending}")
        self.engine = engine
        self.max_batch_size = max_batch_size
        self.max_pending = max_pending
        self.gather_s = gather_s
        self.batch_sizes: collections.deque[int] = collections.deque(maxlen=1000)
        """Prompts in each batch run so far (the most recent 1000)."""
        self._pending: collections.deque[Job] = collections.deque()
        self._cond = threading.Condition()
        self._stopping = False
        self._thread: threading.Thread | None = None
        self.error: BaseException | None = None
        """What killed the scheduler's thread, if it died (None while it runs or after a clean stop)."""

    def start(self) -> BatchScheduler:
        """Start the background thread; returns ``self``."""
        if self._thread is None:
            self._stopping = False
            self._thread = threading.Thread(target=self._loop, name="ponente-serve-scheduler", daemon=True)
            self._thread.start()
        return self

    def stop(self, timeout: float | None = None) -> None:
        """Let the running batch finish, fail the waiting jobs, and stop the thread."""
        with self._cond:
            self._stopping = True
            waiting = list(self._pending)
            self._pending.clear()
            self._cond.notify_all()
        for job in waiting:
            _call(job.on_done, RuntimeError("the server is shutting down"))
        if self._thread is not None:
            self._thread.join(timeout)
            self._thread = None

    @property
    def alive(self) -> bool:
        """Whether the background thread is running (False before :meth:`start`, after :meth:`stop`, or if it died)."""
        return self._thread is not None and self._thread.is_alive()

    @property
    def pending(self) -> int:
        """Jobs waiting for a batch (continuous batching: also the prompts waiting for a slot of the engine)."""
        return len(self._pending) + int(getattr(self.engine, "waiting", 0) if self._continuous else 0)

    @property
    def _continuous(self) -> bool:
        return bool(getattr(self.engine, "continuous", False))

    def submit(self, job: Job) -> None:
        """Queue a job.

        Raises:
            ValueError: if the job has more prompts than ``max_batch_size`` or none.
            QueueFullError: if ``max_pending`` jobs are already waiting.
            RuntimeError: if the scheduler is stopped.
        """
        if not 1 <= len(job.prompts) <= self.max_batch_size:
            raise ValueError(f"prompts: between 1 and {self.max_batch_size} per request, got {len(job.prompts)}")
        with self._cond:
            if self._stopping or not self.alive:
                cause = "" if self.error is None else f" (it failed: {type(self.error).__name__}: {self.error})"
                raise RuntimeError(f"the scheduler is not running{cause}")
            if self.pending >= self.max_pending:
                raise QueueFullError(f"{self.pending} requests are already waiting; try again later")
            self._pending.append(job)
            self._cond.notify()

    def _loop(self) -> None:
        try:
            self._serve_jobs()
        except BaseException as exc:
            logger.exception("the batching scheduler died; the server cannot generate any more")
            with self._cond:
                self.error = exc
                waiting = list(self._pending)
                self._pending.clear()
            for job in waiting:
                _call(job.on_done, RuntimeError(f"the scheduler failed: {type(exc).__name__}: {exc}"))

    def _serve_jobs(self) -> None:
        if self._continuous:
            self._serve_continuous()
            return
        while True:
            with self._cond:
                while not self._pending and not self._stopping:
                    self._cond.wait()
                if self._stopping:
                    return
            if self.gather_s > 0:
                time.sleep(self.gather_s)
            batch = self._take()
            if batch:
                self._run(batch)

    def _serve_continuous(self) -> None:
        """Feed jobs into the engine's running batch as they arrive, and step it while it has work."""
        engine = self.engine
        running: dict[int, Job] = {}
        while True:
            with self._cond:
                while not self._pending and not self._stopping and not engine.busy:
                    self._cond.wait()
                if self._stopping and not engine.busy:
                    return
                jobs = [job for job in self._pending if not job.cancelled.is_set()]
                self._pending.clear()
            for job in jobs:
                self._start(job, running)
            if not engine.busy:
                continue
            self.batch_sizes.append(len(running))
            try:
                engine.step()
            except Exception as exc:
                logger.exception("a step of the continuous batch failed; its %d requests fail", len(running))
                engine.abort()
                failed = list(running.values())
                running.clear()
                for job in failed:
                    _call(job.on_done, exc)

    def _start(self, job: Job, running: dict[int, Job]) -> None:
        """Submit a job's prompts to the continuous batch; ``on_done`` gets the completions once all are done."""
        results: list[Any] = [None] * len(job.prompts)
        left = [len(job.prompts)]

        def on_token(i: int, token: int, delta: str, logprob: float | None) -> None:
            if job.on_token is not None and not job.cancelled.is_set():
                try:
                    job.on_token(i, token, delta, logprob)
                except Exception:  # a broken consumer must not stop the batch
                    logger.exception("streaming callback failed; the request's tokens are dropped")
                    job.cancelled.set()

        def on_done(i: int, completion: Any) -> None:
            results[i] = completion
            left[0] -= 1
            if left[0] == 0 and running.pop(id(job), None) is not None:
                _call(job.on_done, results)

        running[id(job)] = job
        try:
            for i, prompt in enumerate(job.prompts):
                self.engine.submit(
                    list(prompt),
                    job.config,
                    on_done=lambda c, i=i: on_done(i, c),
                    on_token=on_token if job.on_token is not None else None,
                    cancelled=job.cancelled,
                    index=i,
                )
        except Exception as exc:
            running.pop(id(job), None)
            job.cancelled.set()  # its prompts already queued leave at the next step
            _call(job.on_done, exc)

    def _take(self) -> list[Job]:
        """The oldest live jobs, in order of arrival, up to ``max_batch_size`` prompts."""
        with self._cond:
            batch: list[Job] = []
            rows = 0
            while self._pending:
                job = self._pending[0]
                if job.cancelled.is_set():
                    self._pending.popleft()
                    continue
                if rows + len(job.prompts) > self.max_batch_size:
                    break
                batch.append(self._pending.popleft())
                rows += len(job.prompts)
            return batch

    def _run(self, batch: list[Job]) -> None:
        rows = [(job, i) for job in batch for i in range(len(job.prompts))]
        prompts = [list(job.prompts[i]) for job, i in rows]
        configs = [job.config for job, _ in rows]
        streamed: set[int] = set()  # jobs that got tokens: they cannot run again without repeating them

        def on_token(row: int, token: int, delta: str, logprob: float | None) -> None:
            job, i = rows[row]
            if job.on_token is not None and not job.cancelled.is_set():
                streamed.add(id(job))
                try:
                    job.on_token(i, token, delta, logprob)
                except Exception:  # a broken consumer must not stop the batch
                    logger.exception("streaming callback failed; the request's tokens are dropped")
                    job.cancelled.set()

        streaming = any(job.on_token is not None for job in batch)
        self.batch_sizes.append(len(prompts))
        try:
            if streaming:
                completions = self.engine.generate(prompts, configs, on_token=on_token)
            else:
                completions = self.engine.generate(prompts, configs)
        except Exception as exc:
            logger.exception("generation failed for a batch of %d prompts", len(prompts))
            if len(batch) == 1:
                _call(batch[0].on_done, exc)
                return
            # one request may be the cause: the others run again, each alone, so that it fails only itself
            for job in batch:
                if id(job) in streamed or job.cancelled.is_set():
                    _call(job.on_done, exc)
                else:
                    self._run([job])
            return
        start = 0
        for job in batch:
            _call(job.on_done, list(completions[start : start + len(job.prompts)]))
            start += len(job.prompts)


def _call(fn: Callable[[Any], None], value: Any) -> None:
    try:
        fn(value)
    except Exception:
        logger.exception("a request's completion callback failed")
