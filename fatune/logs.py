"""fatune's logger, and its once-per-process warnings (a fallback, a skipped DB: said once, not per call)."""

from __future__ import annotations

import logging
import threading

log = logging.getLogger("fatune")
_warned: set[str] = set()
_warned_lock = threading.Lock()


def warn_once(message: str) -> None:
    """Log `message` as a warning, once per process."""
    with _warned_lock:
        if message in _warned:
            return
        _warned.add(message)
    log.warning(message)
