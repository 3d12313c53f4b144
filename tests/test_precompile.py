"""Compiling ahead: a pool process runs a trial's launches on stand-in inputs, and they must
specialise exactly like the timing process's real launches (else the cache never hits)."""

from __future__ import annotations

import pytest
import torch
from triton._C.libtriton import native_specialize_impl
from triton.backends.compiler import GPUTarget
from triton.compiler import make_backend

from fatune.kernel import codegen as loader
from fatune.kernel.spec import KERNELS
from fatune.kernel.triton import codegen, launch
from fatune.kernel.triton.heuristics import default_config
from fatune.tuning import precompile
from fatune.tuning.shape import Shape, make_inputs
from fatune.tuning.timing import KernelRunner

cpu_only = pytest.mark.skipif(torch.cuda.is_available(), reason="interpreter: CPU only")
CUDA = make_backend(GPUTarget("cuda", 90, 32))
BASE = Shape(batch=2, heads=4, seqlen_q=48, seqlen_k=40, head_dim=16, dtype="float16")
SHAPES = {
    "none": BASE,
    "causal": BASE.with_(causal=True),
    "window": BASE.with_(causal=True, window=8),
    "padding": BASE.with_(valid_keys=0.5),
    "gqa": BASE.with_(kv_heads=2),
    "head-dim-v": BASE.with_(head_dim_v=32, seqlen_q=33),
}


def launched(shape: Shape, kernel: str, inputs: dict[str, torch.Tensor], monkeypatch) -> list[tuple]:
    """What a trial of `kernel` launches on `inputs`: each launch's function, grid, options and the
    specialisation Triton's CUDA backend gives its arguments (the compile cache key's part that
    depends on them)."""
    calls = []

    def record(self, slots, stream):
        args = self.pick(slots) + self.tail
        calls.append((self.fn, self.grid, sorted(self.options.items()),
                      [native_specialize_impl(CUDA, arg, False, True, True) for arg in args]))

    monkeypatch.setattr(launch.KernelLaunch, "__call__", record)
    runner = KernelRunner(shape, default_config(shape.spec, None), inputs)
    runner.prepare()
    runner.run(kernel)()
    return calls


@cpu_only
@pytest.mark.parametrize("kernel", KERNELS)
@pytest.mark.parametrize("name", SHAPES)
def test_stand_ins_specialise_like_the_real_inputs(name, kernel, monkeypatch):
    shape = SHAPES[name]
    real = launched(shape, kernel, make_inputs(shape, "cpu"), monkeypatch)
    assert len(real) == (2 if kernel == "fwd" else 3)  # prepare(): the forward; then it or the backward's two
    assert launched(shape, kernel, precompile.stand_in_inputs(shape, "cpu"), monkeypatch) == real


@cpu_only
def test_a_compile_error_is_reported_not_raised(monkeypatch):
    monkeypatch.setattr(codegen, "render", lambda kind, spec, config: "def broken(:\n")
    monkeypatch.setattr(loader, "_modules", {})
    monkeypatch.setattr(codegen, "source_key", lambda kind, spec, config: f"broken-{kind}")
    error = precompile.compile_trial(BASE, default_config(BASE.spec, None), "fwd", "cpu")
    assert error is not None and error.startswith("SyntaxError")


@pytest.mark.gpu
def test_gpu_a_candidate_compiled_in_the_pool_is_a_cache_hit(tmp_path, monkeypatch):
    """On a GPU: after a pool process compiled a trial, its first real launch compiles nothing."""
    import triton

    monkeypatch.setenv("TRITON_CACHE_DIR", str(tmp_path / "triton-cache"))  # empty: only the pool can fill it
    monkeypatch.setattr(loader, "_modules", {})
    shape = Shape(batch=4, heads=8, seqlen_q=1024, seqlen_k=1024, head_dim=64, dtype="bfloat16", causal=True)
    config = default_config(shape.spec, torch.cuda.get_device_capability())
    with precompile.CompilePool(1, "cuda") as pool:
        assert precompile.compile_error(pool.submit(shape, config, "dkdv")) is None
    hits = []
    monkeypatch.setattr(triton.knobs.compilation, "listener", lambda **info: hits.append(info["cache_hit"]))
    runner = KernelRunner(shape, config, make_inputs(shape, "cuda"))
    runner.prepare()
    runner.run("dkdv")()
    torch.cuda.synchronize()
    # the forward and each backward kernel (dQ and dK/dV; with atomic dQ: Delta, dK/dV and dQ's store), each a hit
    assert hits == [True] * (1 + len(runner.plan.bwd_launches(runner.args.grad_out, atomic=True))), hits
