"""Test setup: the Triton interpreter on machines without a GPU, a private kernel cache and log folder,
poisoning."""

from __future__ import annotations

import os
import tempfile

import pytest
import torch

HAS_GPU = torch.cuda.is_available()
if not HAS_GPU:
    # Must be set before any generated module is imported: @triton.jit reads it at decoration.
    os.environ.setdefault("TRITON_INTERPRET", "1")
os.environ.setdefault("FATUNE_CACHE_DIR", tempfile.mkdtemp(prefix="fatune-test-cache-"))
os.environ.setdefault("FATUNE_LOG_DIR", tempfile.mkdtemp(prefix="fatune-test-logs-"))  # searches' compiler output

DEVICE = "cuda" if HAS_GPU else "cpu"


def patch_the_language_once_per_launch() -> None:
    """Triton's interpreter patches triton.language (inspect.getmembers over its modules) at every launch, and again
    at every call of a @triton.jit helper inside the running kernel: a quarter of a small kernel's interpreted time.
    Inside a launch that patched every language module a helper sees, the helper runs without patching again;
    elsewhere (a helper of a module the kernel does not import) as Triton does it."""
    import functools
    import inspect

    import triton.language as tl
    from triton.runtime import interpreter

    launch, helper = interpreter.GridExecutor.__call__, interpreter.InterpretedFunction.__call__
    patched: list[frozenset[int]] = []  # per running launch: the language modules it patched

    @functools.cache
    def languages(fn) -> frozenset[int]:
        return frozenset(id(value) for value in fn.__globals__.values()
                         if inspect.ismodule(value) and value in (tl, tl.core))

    def counted_launch(self, *args, **kwargs):
        patched.append(languages(self.fn))
        try:
            return launch(self, *args, **kwargs)
        finally:
            patched.pop()

    def helper_call(self, *args, **kwargs):
        if not patched or not languages(self.fn) <= patched[-1]:
            return helper(self, *args, **kwargs)
        try:
            return self.rewrite()(*args, **kwargs)
        except Exception as e:  # as InterpretedFunction.__call__ reports it
            raise interpreter.InterpreterError(repr(e)) from e

    interpreter.GridExecutor.__call__, interpreter.InterpretedFunction.__call__ = counted_launch, helper_call


if not HAS_GPU:
    import triton

    if triton.__version__.startswith("3.6."):  # helper_call mirrors 3.6's InterpretedFunction.__call__
        patch_the_language_once_per_launch()


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    skip_gpu = pytest.mark.skip(reason="needs a CUDA GPU")
    for item in items:
        if "gpu" in item.keywords and not HAS_GPU:
            item.add_marker(skip_gpu)


@pytest.fixture
def poison_outputs(monkeypatch: pytest.MonkeyPatch) -> None:
    """Every buffer fatune allocates for a kernel starts as NaN, so an unwritten element fails."""
    import fatune.kernel.triton.launch as launch

    def poisoned(shape, strides, dtype, device):
        return torch.empty_strided(shape, strides, dtype=dtype, device=device).fill_(float("nan"))

    monkeypatch.setattr(launch, "new_buffer", poisoned)


# Modules whose interpreted kernels keep Triton's int32-overflow check on every add and multiply: the core
# kernels at every mask, and the random calls that roam the input space. Elsewhere the check is off: it costs a
# third of a small kernel's interpreted time, and at the tests' sizes only a kernel bug these modules share could
# trip it.
OVERFLOW_CHECKED = {"tests.test_flash_attention", "tests.test_random_calls"}


# The same for a test's fresh Python process (a benchmark script, a compile from scratch): lines to run first in
# the subprocesses of modules not in OVERFLOW_CHECKED, whose kernels are interpreted there.
UNCHECKED_PRELUDE = """
import dataclasses
from triton.runtime import interpreter
interpreter.interpreter_builder.options = dataclasses.replace(interpreter.interpreter_builder.options,
                                                              sanitize_overflow=False)
"""


@pytest.fixture(autouse=True)
def interpreter_overflow_check(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> None:
    """Triton's interpreter checks int32 overflow only in OVERFLOW_CHECKED's tests."""
    if HAS_GPU or request.module.__name__ in OVERFLOW_CHECKED:
        return
    import dataclasses

    from triton.runtime import interpreter

    builder = interpreter.interpreter_builder
    monkeypatch.setattr(builder, "options", dataclasses.replace(builder.options, sanitize_overflow=False))


@pytest.fixture
def deterministic_algorithms():
    """torch.use_deterministic_algorithms(True) for the test; torch's mode as it was afterwards."""
    before = torch.are_deterministic_algorithms_enabled(), torch.is_deterministic_algorithms_warn_only_enabled()
    torch.use_deterministic_algorithms(True)
    yield
    torch.use_deterministic_algorithms(before[0], warn_only=before[1])


@pytest.fixture
def record_gpu_errors(request):
    """Keep each GPU case's worst error ratio for TESTING.md (written by tests/gpu_report.py)."""
    from tests import gpu_report

    def record(results):
        gpu_report.record(request.node.nodeid, results)

    return record


def pytest_sessionfinish(session: pytest.Session, exitstatus: int) -> None:
    from tests import gpu_report

    gpu_report.write()


def use_dispatcher(monkeypatch: pytest.MonkeyPatch, dispatcher) -> None:
    """Route fatune.attention through `dispatcher`, with no plan cached under an earlier one (plans
    keep their dispatch decision: a test that swaps dispatchers must not see another test's plans)."""
    from fatune.runtime import dispatch, plans

    monkeypatch.setattr(dispatch, "_dispatcher", dispatcher)
    monkeypatch.setattr(plans, "_plans", {})


def run_together(target, count: int, timeout: float) -> None:
    """`target(i)` in `count` threads started together; fails the test if one still runs after `timeout` s."""
    import threading

    threads = [threading.Thread(target=target, args=(i,), daemon=True) for i in range(count)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=timeout)
    assert not any(thread.is_alive() for thread in threads), f"a thread still runs after {timeout} s"
