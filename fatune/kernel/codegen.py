"""Render a kernel family's Jinja2 templates into source, cache it on disk and import it.

A family's templates live in a folder of their own (templates/<family>/ in a checkout, fatune/templates/<family>/
when installed). A rendered source goes into the kernel cache ($FATUNE_CACHE_DIR) under a name hashed from
the family's template text, its options and the Triton version, so a changed template or a Triton upgrade
never reuses stale code; each module is imported once per process. Every loaded module carries the hash of
its code (`code_hash`: the source without comments and docstrings), which a tuned entry stores for the kernels
it was measured with; a comment edit changes no entry's kernels.
"""

from __future__ import annotations

import functools
import hashlib
import importlib.util
import io
import json
import os
import sys
import tempfile
import threading
import tokenize
from pathlib import Path
from types import ModuleType
from typing import Any, Callable

import jinja2
import triton

from fatune.logs import log
from fatune.settings import CACHE_ENV, user_path

CODE_HASH = "__fatune_code_hash__"  # the attribute of a loaded module that holds its code hash


class TritonExpr(str):
    """A template option rendered verbatim into the generated source (e.g. tl.float32), not quoted."""


class Templates:
    """One kernel family's template folder: its Jinja environment and the hash of its text."""

    def __init__(self, folder: str, path: Path | None = None):
        """`path`: where the folder is (default: found in the package or the checkout)."""
        self.folder = folder
        if path is not None:
            self.path = path

    @functools.cached_property
    def path(self) -> Path:
        """The folder: packaged under fatune/templates in a wheel, under ./templates in a checkout."""
        package = Path(__file__).resolve().parent.parent
        for base in (package / "templates", package.parent / "templates"):
            if (base / self.folder).is_dir():
                return base / self.folder
        raise FileNotFoundError(f"fatune templates: no folder {self.folder!r} in {package / 'templates'} or "
                                f"{package.parent / 'templates'}")

    @functools.cached_property
    def environment(self) -> jinja2.Environment:
        env = jinja2.Environment(loader=jinja2.FileSystemLoader(str(self.path)), undefined=jinja2.StrictUndefined,
                                 trim_blocks=True, lstrip_blocks=True, keep_trailing_newline=True)
        env.filters["pyrepr"] = lambda value: str(value) if isinstance(value, TritonExpr) else repr(value)
        return env

    @functools.cached_property
    def text_hash(self) -> str:
        """Hash of every template's text: changes whenever any generated code could change."""
        digest = hashlib.sha256()
        for path in sorted(self.path.glob("*.jinja")):
            digest.update(path.name.encode())
            digest.update(path.read_bytes())
        return digest.hexdigest()[:16]

    def render(self, name: str, options: dict[str, Any]) -> str:
        return self.environment.get_template(name).render(options)

    def source_key(self, kind: str, options: dict[str, Any]) -> str:
        """A rendered source's cache key: the templates' text, the options and the Triton version."""
        payload = json.dumps({"templates": self.text_hash, "kind": kind, "options": options,
                              "triton": triton.__version__}, sort_keys=True, default=str)
        return hashlib.sha256(payload.encode()).hexdigest()[:20]


def code_hash(source: str) -> str:
    """Hash of a Python source's code: its tokens without comments, docstrings and blank lines. Tokens are
    hashed by name and an f-string as one string token, as every Python version tokenizes them (token
    numbers and f-string tokens changed in 3.12): a tuned DB measured under one Python is current under
    another."""
    digest = hashlib.sha256()
    for kind, text in _code_tokens(source):
        digest.update(f"{kind}:{text}\n".encode())
    return digest.hexdigest()[:16]


_FSTRING_STARTS = {"FSTRING_START", "TSTRING_START"}
_FSTRING_ENDS = {"FSTRING_END", "TSTRING_END"}


def _code_tokens(source: str):
    """(token name, text) of `source`'s code tokens, in order (see code_hash)."""
    lines = io.StringIO(source).readlines()  # rows as the tokenizer counts them (str.splitlines breaks at more)
    previous, depth, start = "NEWLINE", 0, (0, 0)
    for token in tokenize.generate_tokens(io.StringIO(source).readline):
        kind, text = tokenize.tok_name[token.type], token.string
        if kind in _FSTRING_STARTS:
            depth += 1
            start = token.start if depth == 1 else start
            continue
        if depth:  # inside an f-string (Python 3.12+): its whole text is one string token, as before 3.12
            depth -= kind in _FSTRING_ENDS
            if depth:
                continue
            kind, text = "STRING", _span(lines, start, token.end)
        if kind in ("COMMENT", "NL"):
            continue
        if not (kind == "STRING" and previous in ("NEWLINE", "INDENT", "DEDENT")):  # a docstring is skipped
            yield kind, text
        previous = kind


def _span(lines: list[str], start: tuple[int, int], end: tuple[int, int]) -> str:
    """The text between two tokenize positions ((row from 1, column))."""
    if start[0] == end[0]:
        return lines[start[0] - 1][start[1]:end[1]]
    return lines[start[0] - 1][start[1]:] + "".join(lines[start[0]:end[0] - 1]) + lines[end[0] - 1][:end[1]]


_fallback_dir: Path | None = None  # this process's folder for sources where the cache cannot take them


def cache_dir() -> Path:
    """Where rendered sources go: $FATUNE_CACHE_DIR, else ~/.cache/fatune/kernels (a value naming no folder, such
    as '~user' of no user, costs one warning: a private temporary folder is used instead)."""
    try:
        return user_path(CACHE_ENV, "kernels")
    except RuntimeError as error:
        return _fallback(str(error))


def _fallback(why: str) -> Path:
    """This process's private folder for sources, made (and warned about, naming $FATUNE_CACHE_DIR) once."""
    global _fallback_dir
    if _fallback_dir is None:
        _fallback_dir = Path(tempfile.mkdtemp(prefix="fatune-kernels-"))
        log.warning("fatune: cannot write generated kernels (%s); set $%s to a writable folder. Using %s in this "
                    "process.", why, CACHE_ENV, _fallback_dir)
    return _fallback_dir


def _write_atomically(path: Path, text: str) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=path.name, suffix=".tmp")
    with os.fdopen(fd, "w", encoding="utf-8") as handle:
        handle.write(text)
    os.replace(tmp, path)


_modules: dict[tuple, ModuleType] = {}
_lock = threading.Lock()


def _write_source(path: Path, source: str) -> Path:
    """Put `source` at `path` (unless it is there already) and return where it is.

    A cache folder that cannot be written (read-only home, a file in the way) costs one
    warning naming $FATUNE_CACHE_DIR; the sources then go to a private temporary folder.
    """
    try:
        if not path.is_file() or path.read_bytes() != source.encode():  # a damaged file is rewritten
            _write_atomically(path, source)
        return path
    except OSError as error:
        fallback = _fallback(f"{path.parent}: {error}") / path.name
        _write_atomically(fallback, source)
        return fallback


def load(memo_key: tuple, path: Callable[[], Path], render: Callable[[], str], interpreted: bool) -> ModuleType:
    """The module rendered by `render()` into the cache file `path()`, imported once per `memo_key` (and per
    interpreted or compiled run: their kernels are different objects); it carries its code hash (CODE_HASH).

    After the first call for a key this is one dictionary lookup (it sits on every call's path).
    """
    key = (*memo_key, interpreted)
    module = _modules.get(key)
    if module is not None:
        return module
    with _lock:
        module = _modules.get(key)
        if module is None:
            source = render()
            written = _write_source(path(), source)
            name = f"fatune_generated.{written.stem}{'_interp' if interpreted else ''}"
            module_spec = importlib.util.spec_from_file_location(name, written)
            assert module_spec is not None and module_spec.loader is not None
            module = importlib.util.module_from_spec(module_spec)
            sys.modules[name] = module
            module_spec.loader.exec_module(module)
            setattr(module, CODE_HASH, code_hash(source))
            _modules[key] = module
    return module
