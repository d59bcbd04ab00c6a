"""Stopping on signals (``ponente.trainer.trainer.stop_on_signals``): the one place SIGINT and SIGTERM are handled."""

from __future__ import annotations

import signal
import subprocess
import sys
import textwrap
import threading
from typing import Any

import pytest

from ponente.trainer.trainer import stop_on_signals


def test_first_sigterm_requests_a_stop_and_the_previous_handler_comes_back():
    seen: list[int] = []
    previous = signal.signal(signal.SIGTERM, lambda signum, frame: seen.append(signum))
    try:
        stops: list[str] = []
        with stop_on_signals(stops.append):
            signal.raise_signal(signal.SIGTERM)
            assert stops == ["SIGTERM"]
            assert signal.getsignal(signal.SIGTERM) == signal.SIG_DFL  # a second one would end the process
        assert seen == []  # the outer handler did not see the first signal
        signal.raise_signal(signal.SIGTERM)
        assert seen == [signal.SIGTERM]  # and is back afterwards
    finally:
        signal.signal(signal.SIGTERM, previous)


def test_sigterm_handling_is_left_alone_off_the_main_thread():
    before = signal.getsignal(signal.SIGTERM)
    inside: list[Any] = []

    def body() -> None:
        with stop_on_signals(lambda reason: None):
            inside.append(signal.getsignal(signal.SIGTERM))

    thread = threading.Thread(target=body)
    thread.start()
    thread.join()
    assert inside == [before]


def test_a_second_sigterm_ends_the_process_at_once():
    code = textwrap.dedent(
        """
        import os, signal, sys, time
        from ponente.trainer.trainer import stop_on_signals

        with stop_on_signals(lambda reason: print("stop requested:", reason, flush=True)):
            os.kill(os.getpid(), signal.SIGTERM)
            time.sleep(0.2)
            os.kill(os.getpid(), signal.SIGTERM)
            time.sleep(30)
            print("still alive", flush=True)
        """
    )
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert proc.returncode == -signal.SIGTERM, proc.stderr[-2000:]
    assert proc.stdout == "stop requested: SIGTERM\n"


def test_first_sigint_requests_a_stop_and_a_second_one_aborts():
    stops: list[str] = []
    before = signal.getsignal(signal.SIGINT)
    with stop_on_signals(stops.append):
        signal.raise_signal(signal.SIGINT)
        assert stops == ["SIGINT"]
        with pytest.raises(KeyboardInterrupt):
            signal.raise_signal(signal.SIGINT)
    assert stops == ["SIGINT"]
    assert signal.getsignal(signal.SIGINT) == before


def test_sigint_aborts_at_once_when_a_stop_was_already_requested_otherwise():
    with stop_on_signals(lambda reason: None, lambda: "a hook asked"), pytest.raises(KeyboardInterrupt):
        signal.raise_signal(signal.SIGINT)
