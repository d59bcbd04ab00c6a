"""Building datacache caches on demand, in a background thread, and ``package://`` URLs.

A training run should not wait for a whole corpus to be tokenized: `build_in_background` starts
``ponente.datacache.build_cache`` in a daemon thread and returns the cache as soon as its first rows are
committed. The returned `ponente.datacache.CacheDataset` keeps growing while the build runs; if the build
fails, the next read that asks the cache for its length or state (``len``, ``is_finished``, waiting for
rows) raises the build's exception instead of waiting forever.

One process never runs two builds of the same cache location: a second request while a build is running
returns another reader of the same build.

In a run of several processes only one process (process 0) builds; the others call `follow_cache_builds`,
after which `open_or_build` never builds: it waits for the cache that the builder commits at the same
location and returns it while it still grows.
"""

from __future__ import annotations

import atexit
import contextlib
import importlib.resources
import logging
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any, NamedTuple

from ponente.datacache import CacheDataset, CacheNotFoundError, Ledger, build_cache, open_cache
from ponente.datacache.builder import BuildStopped

__all__ = [
    "DEFAULT_FOLLOW_TIMEOUT",
    "PACKAGE_SCHEME",
    "CacheBuildError",
    "FollowMode",
    "build_in_background",
    "follow_cache_builds",
    "open_or_build",
    "resolve_url",
]

logger = logging.getLogger(__name__)

PACKAGE_SCHEME = "package://"
"""URL prefix of files shipped inside an installed Python package: ``package://<module>/<file>``."""

_POLL_SECONDS = 0.05
_FOLLOW_POLL_MAX_SECONDS = 1.0

DEFAULT_FOLLOW_TIMEOUT = 600.0
"""Seconds a follower waits, by default, for a cache to appear (a ledger and a first committed row)."""


class CacheBuildError(RuntimeError):
    """A background cache build failed; raised by reads of its cache. The build's exception is the cause."""


def resolve_url(url: str) -> str:
    """Turn ``package://<module>/<path>`` into the local path of that packaged file; return other URLs unchanged.

    Args:
        url: A path, fsspec URL or ``package://`` URL, e.g.
            ``package://ponente.trainer.assets/shakespeare_train.jsonl.gz``.

    Returns:
        A local file path for ``package://`` URLs, else ``url`` itself.

    Raises:
        ValueError: If the URL has no module or file part, names a module outside ``ponente.*``, or a file part
            that could leave the package (``..``, an absolute path, a link pointing outside it).
        ModuleNotFoundError: If the module is not importable.
        FileNotFoundError: If the module has no such file (the message lists the files it has).

    Example:
        ```python
        from ponente.trainer.data import resolve_url

        path = resolve_url("package://ponente.trainer.assets/shakespeare_tokenizer.json")
        assert path.endswith("shakespeare_tokenizer.json")
        ```
    """
    if not url.startswith(PACKAGE_SCHEME):
        return url
    module, _, name = url[len(PACKAGE_SCHEME) :].partition("/")
    if not module or not name:
        raise ValueError(f"malformed URL {url!r}: expected {PACKAGE_SCHEME}<module>/<file>")
    if module != "ponente" and not module.startswith("ponente."):
        # importing a module runs its code: only our own packages' files are addressable this way
        raise ValueError(f"{url!r}: {PACKAGE_SCHEME} URLs address files of ponente.* packages only, not {module!r}")
    parts = name.split("/")
    if any(part in ("", ".", "..") for part in parts) or name.startswith(("/", "\\")) or "\\" in name:
        raise ValueError(f"{url!r}: the file part must be a relative path inside the package, without '..' or '.'")
    root = importlib.resources.files(module)
    if any(ch in name for ch in "*?[{"):
        return str(Path(str(root), name))  # a glob: datacache expands it (its parts cannot leave the package)
    target = root.joinpath(*parts)
    if not target.is_file():
        available = sorted(p.name for p in root.iterdir() if p.is_file() and not p.name.endswith((".py", ".pyc")))
        raise FileNotFoundError(f"{url!r}: module {module!r} has no file {name!r}; it has {available}")
    path = Path(str(target))
    if not path.is_file():
        raise FileNotFoundError(f"{url!r}: the package is not installed as plain files (e.g. zipped); cannot read it")
    # a symbolic link inside the package must not lead outside it
    if not path.resolve().is_relative_to(Path(str(root)).resolve()):
        raise ValueError(f"{url!r}: resolves to {path.resolve()}, outside the package {module!r}")
    return str(path)


class _Build:
    """One background build: its thread and, once it ended, its outcome."""

    def __init__(self, location: str, run: Callable[[], CacheDataset]) -> None:
        self.location = location
        self.error: BaseException | None = None
        self.done = threading.Event()
        self._run = run
        self.thread = threading.Thread(target=self._main, name=f"build-cache:{location}", daemon=True)

    def _main(self) -> None:
        try:
            self._run()
        except BuildStopped:
            logger.info("stopped the background build of the cache at %s (it resumes on the next run)", self.location)
        except BaseException as exc:  # surfaced to readers through check()
            logger.error("building the cache at %s failed: %s", self.location, exc)
            self.error = exc
        finally:
            self.done.set()

    def check(self) -> None:
        """Raise `CacheBuildError` from the build's exception if it failed."""
        if self.error is not None:
            raise CacheBuildError(f"building the cache at {self.location!r} failed: {self.error}") from self.error


class _GrowingCache(CacheDataset):
    """A `CacheDataset` whose every ledger refresh first checks its background build for a failure."""

    def __init__(self, location: str, build: _Build, **kwargs: Any) -> None:
        self._build = build
        super().__init__(location, **kwargs)

    def refresh(self) -> Ledger:
        """Re-read the ledger; raise `CacheBuildError` if the build failed (before it finished the cache)."""
        ledger = super().refresh()
        if not ledger.finished:
            self._build.check()
        return ledger

    def wait_until(self, *, rows: int | None = None, timeout: float | None = None) -> bool:
        """Like `CacheDataset.wait_until`, but raises `CacheBuildError` as soon as the build fails."""
        deadline = None if timeout is None else time.monotonic() + timeout
        while True:
            ledger = self.refresh()
            if ledger.finished or (rows is not None and ledger.rows >= rows):
                return True
            if deadline is not None and time.monotonic() >= deadline:
                return False
            if self._build.done.wait(_POLL_SECONDS):
                self._build.check()

    def wait_for_length(self, length: int | None = None, *, timeout: float | None = None) -> bool:
        """Rows are the examples: see `wait_until`."""
        return self.wait_until(rows=length, timeout=timeout)


_BUILDS: dict[str, _Build] = {}
_BUILDS_LOCK = threading.Lock()
_EXITING = threading.Event()
_EXIT_WAIT_SECONDS = 60.0


def _stop_builds_at_exit() -> None:
    """Stop the running background builds, and wait for them, before the interpreter tears down.

    A build thread still inside TensorStore or the tokenizer when the process exits can abort it (``terminate
    called without an active exception``); each build stops at its next batch and commits what it wrote, so the
    cache resumes on the next run.
    """
    _EXITING.set()
    with _BUILDS_LOCK:
        running = [b for b in _BUILDS.values() if not b.done.is_set()]
    for build in running:
        build.thread.join(timeout=_EXIT_WAIT_SECONDS)


atexit.register(_stop_builds_at_exit)


def build_in_background(location: str, *, timeout: float | None = None, **build_kwargs: Any) -> CacheDataset:
    """Start ``build_cache(output=location, **build_kwargs)`` in a thread; return the cache once rows commit.

    If a background build of ``location`` is already running in this process, no second one starts. A
    finished cache is verified (its fingerprint must match the request) and opened.

    Args:
        location: The cache location (``output`` of ``build_cache``).
        timeout: The most seconds to wait for the first committed row; ``None`` waits as long as it takes.
        **build_kwargs: Everything else ``ponente.datacache.build_cache`` takes (``inputs``, ``tokenizer``...).

    Returns:
        The cache, with at least one committed row or finished. It grows while the build runs; a read of
        its length or state after the build failed raises `CacheBuildError`.

    Raises:
        CacheBuildError: If the build failed before its first rows committed.
        TimeoutError: If no row committed within ``timeout`` seconds.
    """
    location = str(location)
    with _BUILDS_LOCK:
        build = _BUILDS.get(location)
        if build is None or build.done.is_set():
            build = _Build(location, lambda: build_cache(output=location, should_stop=_EXITING.is_set, **build_kwargs))
            _BUILDS[location] = build
            build.thread.start()
    deadline = None if timeout is None else time.monotonic() + timeout
    cache: _GrowingCache | None = None
    while True:
        finished = build.done.is_set()
        build.check()
        if cache is None:
            try:
                cache = _GrowingCache(location, build)
            except CacheNotFoundError:
                if finished:  # the build ended without error and without a cache: should not happen
                    raise
        if cache is not None and (len(cache) > 0 or cache.is_finished):
            return cache
        if deadline is not None and time.monotonic() >= deadline:
            raise TimeoutError(f"no rows were committed to the cache at {location!r} within {timeout} s")
        build.done.wait(_POLL_SECONDS)


class FollowMode(NamedTuple):
    """Whether `open_or_build` follows builds of other processes instead of building (see `follow_cache_builds`).

    Attributes:
        enabled: Follow instead of build.
        timeout: The most seconds a follower waits for a cache to appear; ``None`` waits as long as it takes.
    """

    enabled: bool
    timeout: float | None


_FOLLOW = FollowMode(False, DEFAULT_FOLLOW_TIMEOUT)
_FOLLOW_LOCK = threading.Lock()


def follow_cache_builds(enabled: bool = True, *, timeout: float | None = DEFAULT_FOLLOW_TIMEOUT) -> FollowMode:
    """Make this process a follower of cache builds (or, with ``enabled=False``, a builder again).

    In a run of several processes, process 0 builds every cache and the other processes follow: in
    follower mode `open_or_build` (so also ``LMDatasetConfig.build_caches``, ``train_set``,
    ``validation_sets`` and the mixture's) never writes anything. It waits until the cache at the requested
    location has a ledger and at least one committed row (or is finished) and returns a
    `ponente.datacache.CacheDataset` that keeps growing while the builder, another process, commits rows.
    A request for a finished cache (``background=False``) waits, after the cache appeared, until it is
    finished. The follower does not check the cache's fingerprint: the builder does, and fails on a
    mismatch.

    The mode holds for the whole process (every thread) until changed.

    Args:
        enabled: ``True``: follow; ``False``: build (the default mode of a process).
        timeout: The most seconds a follower waits for a cache to appear; ``None`` waits as long as it
            takes. The wait for more rows, or for a cache to finish, has no limit.

    Returns:
        The previous mode, e.g. to restore it with ``follow_cache_builds(prev.enabled, timeout=prev.timeout)``.

    Raises:
        ValueError: If ``timeout`` is negative.

    Example:
        ```python
        from ponente.trainer.data import follow_cache_builds

        previous = follow_cache_builds(timeout=60)  # open_or_build now waits for another process's caches
        follow_cache_builds(previous.enabled, timeout=previous.timeout)
        ```
    """
    global _FOLLOW
    if timeout is not None and timeout < 0:
        raise ValueError(f"follow_cache_builds: timeout must be >= 0 seconds or None, got {timeout}")
    with _FOLLOW_LOCK:
        previous = _FOLLOW
        _FOLLOW = FollowMode(bool(enabled), timeout)
    return previous


def _follow(location: str, *, finished: bool, timeout: float | None) -> CacheDataset:
    """Wait for the cache another process builds at ``location``; never write to it."""
    deadline = None if timeout is None else time.monotonic() + timeout
    delay = _POLL_SECONDS
    cache: CacheDataset | None = None
    while True:
        if cache is None:
            with contextlib.suppress(CacheNotFoundError):  # not there yet: keep waiting
                cache = open_cache(location)
        if cache is not None and (len(cache) > 0 or cache.is_finished):
            break
        if deadline is not None and time.monotonic() >= deadline:
            state = "no cache" if cache is None else "a cache without committed rows"
            raise TimeoutError(
                f"this process follows cache builds (follow_cache_builds) and found {state} at {location!r} "
                f"within {timeout} s; another process (process 0 of the run) is expected to build it there. "
                "Check that process 0 is building it (its log) and that every process reaches the same location "
                "(a shared file system or an object store such as gs://, not a disk of one host)."
            )
        time.sleep(delay)
        delay = min(delay * 2, _FOLLOW_POLL_MAX_SECONDS)
    logger.info("following the cache at %s that another process builds (%d rows committed)", location, len(cache))
    if finished and not cache.is_finished:
        logger.info("waiting for another process to finish the cache at %s", location)
        cache.wait_until(rows=None)
    return cache


def open_or_build(location: str, *, background: bool, **build_kwargs: Any) -> CacheDataset:
    """Open the cache at ``location`` when it is finished and current, else build it (see `build_in_background`).

    ``build_cache`` itself checks the fingerprint of an existing cache and opens a finished one at once, so
    this only decides between the calling thread and a background thread. In follower mode (see
    `follow_cache_builds`) it never builds: it waits for the cache another process builds at ``location``.

    Args:
        location: The cache location (``output`` of ``build_cache``).
        background: Build in a background thread and return once the first rows commit; ``False`` builds in
            this thread (a follower waits until the cache is finished) and returns the finished cache.
        **build_kwargs: Everything else ``ponente.datacache.build_cache`` takes; unused by a follower.

    Returns:
        The cache: with at least one committed row or finished, and finished when ``background`` is false.

    Raises:
        TimeoutError: In follower mode, if no cache with committed rows appeared at ``location`` in time (the
            message names the location).
        CacheBuildError: If a background build failed before its first rows committed.
    """
    mode = _FOLLOW
    if mode.enabled:
        return _follow(str(location), finished=not background, timeout=mode.timeout)
    if not background:
        return build_cache(output=location, **build_kwargs)
    return build_in_background(location, **build_kwargs)
