"""fatune's environment variables and user folders, read in one place.

Each is untrusted input: a value fatune cannot use costs a log line or an error naming the variable,
never a crash or a hang.
"""

from __future__ import annotations

import os
from pathlib import Path

CACHE_ENV = "FATUNE_CACHE_DIR"  # rendered kernel sources (default ~/.cache/fatune/kernels)
DB_ENV = "FATUNE_DB"  # the user's tuned DB (default ~/.cache/fatune/tuned.sqlite)
LOG_ENV = "FATUNE_LOG_DIR"  # search logs (default ~/.cache/fatune/logs)
STRICT_ENV = "FATUNE_STRICT"  # 1/true/yes/on: raise instead of falling back
AUTOTUNE_ENV = "FATUNE_AUTOTUNE"  # 1/true/yes/on: tune a key with no tuned entry on its first call (fatune.autotune)
INTERPRET_ENV = "TRITON_INTERPRET"  # Triton's own: 1 runs kernels in its CPU interpreter


def user_path(env: str, name: str) -> Path:
    """$env if set, else `name` in fatune's folder of the user's cache dir ($XDG_CACHE_HOME if absolute, as the
    XDG spec asks, else ~/.cache). RuntimeError naming $env where its '~user' has no home directory."""
    configured = os.environ.get(env)
    if configured:
        try:
            return Path(configured).expanduser()
        except RuntimeError as error:
            raise RuntimeError(f"${env}={configured!r}: {error}") from None
    base = os.environ.get("XDG_CACHE_HOME", "")
    if not os.path.isabs(base):
        base = os.path.join(os.path.expanduser("~"), ".cache")
    return Path(base) / "fatune" / name


def interpreting() -> bool:
    """True when Triton runs kernels in its CPU interpreter (TRITON_INTERPRET=1)."""
    return os.environ.get(INTERPRET_ENV, "0") == "1"


def strict_from_env() -> bool:
    """$FATUNE_STRICT as a switch (1/true/yes/on; anything else is off)."""
    return switch(STRICT_ENV)


def switch(env: str) -> bool:
    """$env as a switch: 1/true/yes/on (any case, spaces around) is on; anything else, or unset, is off."""
    return os.environ.get(env, "").strip().lower() in ("1", "true", "yes", "on")
