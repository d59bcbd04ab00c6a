"""Run ids: the name of a run's folder, tracker run and checkpoints when the configuration gives none."""

from __future__ import annotations

import secrets
import time

__all__ = ["new_run_id"]


def new_run_id() -> str:
    """A fresh run id: the local time and 6 random hex digits, e.g. ``20260101-120000-a1b2c3``.

    Ids sort by start time, and two runs started in the same second still differ.
    """
    return time.strftime("%Y%m%d-%H%M%S") + "-" + secrets.token_hex(3)
