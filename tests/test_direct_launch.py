"""fatune.kernel.direct_launch.CachedJit: a helper kernel goes through Triton once per specialisation, then directly.

Triton's launch is replaced by a recording fake here (no GPU): what is checked is when the kept binary
is used and when the call must go through Triton again. tests/test_mask_spans.py checks real scans
launched directly on the GPU.
"""

from __future__ import annotations

import pytest
import torch
from triton import knobs

from fatune.kernel import direct_launch
from fatune.kernel.direct_launch import CachedJit


class FakeBinary:
    """What Triton's launch returns: a compiled kernel, with or without global scratch."""

    def __init__(self, scratch: int):
        self.scratch = scratch


class FakeJit:
    """A jitted function: `fn[grid](*args, num_warps=)` records a launch through Triton."""

    def __init__(self, scratch: int = 0):
        self.calls: list[tuple] = []
        self.scratch = scratch

    def __getitem__(self, grid):
        def run(*args, num_warps):
            self.calls.append((grid, args, num_warps))
            return FakeBinary(self.scratch)
        return run


@pytest.fixture
def direct_calls(monkeypatch) -> list[tuple]:
    """Launches that went through the kept binary's C launcher (Triton's replaced by a recorder)."""
    calls: list[tuple] = []

    def launcher(binary):
        return (lambda *args: calls.append(args)), ("middle",), binary.scratch

    monkeypatch.setattr(direct_launch, "CompiledKernel", FakeBinary)
    monkeypatch.setattr(direct_launch, "direct_launcher", launcher)
    monkeypatch.setattr(direct_launch, "current_stream", lambda index: 7)
    return calls


DEVICE = torch.device("cuda", 0)  # only its index is read: nothing is launched


def _args(tensor: torch.Tensor, length: int = 48, flag: bool = True) -> tuple[tuple, tuple]:
    """A kernel's pointers and its tail (an integer and a constexpr)."""
    return (tensor,), (length, flag)


def test_the_second_launch_of_a_specialisation_is_direct(direct_calls):
    fn = FakeJit()
    jit = CachedJit(fn)
    tensor = torch.zeros(64, dtype=torch.uint8)
    jit((2, 3, 1), *_args(tensor), DEVICE, 4)
    jit((5, 1, 1), *_args(tensor), DEVICE, 4)
    assert fn.calls == [((2, 3, 1), (tensor, 48, True), 4)]
    assert direct_calls == [(5, 1, 1, 7, "middle", tensor.data_ptr(), 48, True)]


@pytest.mark.parametrize("change", [
    "a misaligned pointer", "another dtype", "another integer", "another constexpr", "other warps", "another device"])
def test_any_change_triton_could_specialise_on_goes_through_triton(change, direct_calls):
    fn = FakeJit()
    jit = CachedJit(fn)
    tensor = torch.zeros(64, dtype=torch.uint8)
    jit((1, 1, 1), *_args(tensor), DEVICE, 4)
    args, device, warps = _args(tensor), DEVICE, 4
    if change == "a misaligned pointer":
        args = _args(tensor[1:])
    elif change == "another dtype":
        args = _args(tensor.view(torch.int8))
    elif change == "another integer":
        args = _args(tensor, length=49)
    elif change == "another constexpr":
        args = _args(tensor, flag=False)
    elif change == "other warps":
        warps = 8
    else:
        device = torch.device("cuda", 1)
    jit((1, 1, 1), *args, device, warps)
    assert len(fn.calls) == 2 and not direct_calls
    jit((1, 1, 1), *args, device, warps)
    assert len(fn.calls) == 2 and len(direct_calls) == 1


def test_kernels_needing_global_scratch_always_go_through_triton(direct_calls):
    fn = FakeJit(scratch=128)
    jit = CachedJit(fn)
    tensor = torch.zeros(64, dtype=torch.uint8)
    for _ in range(3):
        jit((1, 1, 1), *_args(tensor), DEVICE, 4)
    assert len(fn.calls) == 3 and not direct_calls


def test_launch_hooks_see_every_launch(direct_calls, monkeypatch):
    """A profiler's hooks are called by Triton's launch only: with hooks set, no launch is direct."""
    fn = FakeJit()
    jit = CachedJit(fn)
    tensor = torch.zeros(64, dtype=torch.uint8)
    jit((1, 1, 1), *_args(tensor), DEVICE, 4)
    monkeypatch.setattr(knobs.runtime.launch_enter_hook, "calls", [lambda metadata: None])
    jit((1, 1, 1), *_args(tensor), DEVICE, 4)
    assert len(fn.calls) == 2 and not direct_calls


def test_kept_binaries_are_bounded(direct_calls, monkeypatch):
    monkeypatch.setattr(CachedJit, "MAX_BINARIES", 3)
    jit = CachedJit(FakeJit())
    tensor = torch.zeros(64, dtype=torch.uint8)
    for length in range(10):
        jit((1, 1, 1), *_args(tensor, length=length), DEVICE, 4)
        assert len(jit.binaries) <= 3
