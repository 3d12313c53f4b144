"""Launching the Gluon kernels, and the plan of a call that runs them (the Triton family's for the rest).

The kernels read and write through four-dim TMA descriptors made per call from the tensors' own shapes and
strides ((B, H, L, D), any dim order whose strides TMA can address), so no input is copied, a ragged last tile
reads zeros and writes nothing past the sequence, and GQA reads K/V head h // GROUP. The forward's O and LSE are in
the Triton family's layouts, so that family's backward runs after it unchanged; the Gluon backward takes the
place of the Triton family's atomic-dQ dK/dV kernel, between its passes (Delta and a zeroed float32 dQ
accumulator before, dQ's store after).
"""

from __future__ import annotations

import dataclasses

import torch
import triton
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.nvidia.hopper import TensorDescriptor

from fatune.hardware import device_arch, sm_count
from fatune.kernel.gluon import codegen
from fatune.kernel.problem import NO_EXTRAS, OPTIONAL_TENSORS, AttentionProblem
from fatune.kernel.spec import (DTYPES, GLUON_SPLIT_M, AttentionConfig, GluonBackwardConfig, GluonConfig,
                                KernelSpec, LaunchConfig)
from fatune.kernel.triton import launch
from fatune.kernel.triton.heuristics import default_config
from fatune.kernel.triton.launch import SLOTS, KernelBuildError, Plan, StaleKernels
from fatune.kernel.triton.signature import POINTER_OF
from fatune.kernel.triton.resolve import source_hash, tma_readable
from fatune.logs import warn_once

_GL_DTYPES = {torch.float16: gl.float16, torch.bfloat16: gl.bfloat16}
MAX_GRID_Y = 65535  # CUDA's limit on a grid's second dimension (the forward's batch x heads)
_EXTRA = {name: index for index, name in enumerate(OPTIONAL_TENSORS)}  # where a call's tensors are among its extras
_FIRST_EXTRA_SLOT = SLOTS.index(POINTER_OF[OPTIONAL_TENSORS[0]])  # and where its extras start among a plan's slots


def unserved(spec: KernelSpec, device: torch.device) -> str | None:
    """None if the Gluon forward can run calls of `spec` on `device`; else why not (one line)."""
    if device.type != "cuda" or device_arch(device) != (9, 0):
        return "the Gluon forward runs on Hopper (sm_90) GPUs"
    return untemplated(spec)


def untemplated(spec: KernelSpec) -> str | None:
    """None if the Gluon template renders a forward for `spec` (on any machine); else why not (one line)."""
    if spec.dtype not in ("float16", "bfloat16"):
        return f"the Gluon forward takes float16 and bfloat16, not {spec.dtype}"
    if spec.head_dim != spec.head_dim_v or spec.head_dim > codegen.HEAD_DIMS[-1] or spec.head_dim % 8:
        return (f"the Gluon forward takes head dims that are multiples of 8 up to {codegen.HEAD_DIMS[-1]} (equal for "
                f"q and v; TMA reads rows of 16-byte multiples), not {spec.head_dim}/{spec.head_dim_v}")
    if spec.attn_mask != "none" or spec.dropout or spec.paged:
        return f"the Gluon forward does not take the {spec.mask_variant} variant yet"
    return None


def passes_config(spec: KernelSpec) -> LaunchConfig:
    """The Triton dK/dV config whose passes run around the Gluon backward (Delta and the zeroed dQ accumulator
    before, dQ's store after): the Hopper heuristic's with atomic dQ, fixed per spec so a tuned entry's hashes name
    it. Its own kernel runs only where the Gluon backward does not (a dO TMA cannot read)."""
    return dataclasses.replace(default_config(spec, (9, 0)).dkdv, atomic_dq=1)


def described(tensor: torch.Tensor) -> bool:
    """Whether a four-dim TMA descriptor over `tensor` (B, H, L, D) can be made: a unit head-dim stride and a
    16-byte aligned base and strides, every dim's (tma_readable leaves out those of size 1)."""
    size = tensor.element_size()
    return (tensor.stride(-1) == 1 and tensor.data_ptr() % 16 == 0
            and all(stride > 0 and stride * size % 16 == 0 for stride in tensor.stride()[:-1]))


def backward_unserved(spec: KernelSpec, device: torch.device) -> str | None:
    """None if the Gluon backward can run calls of `spec` on `device`; else why not (one line)."""
    if device.type != "cuda" or device_arch(device) != (9, 0):
        return "the Gluon backward runs on Hopper (sm_90) GPUs"
    return backward_untemplated(spec)


def backward_untemplated(spec: KernelSpec) -> str | None:
    """None if the Gluon backward template renders a kernel for `spec` (on any machine); else why not."""
    if spec.dtype not in ("float16", "bfloat16"):
        return f"the Gluon backward takes float16 and bfloat16, not {spec.dtype}"
    if spec.head_dim != spec.head_dim_v or not 32 < spec.head_dim <= codegen.HEAD_DIMS[-1] or spec.head_dim % 8:
        return (f"the Gluon backward takes head dims that are multiples of 8 in 40..{codegen.HEAD_DIMS[-1]} (equal "
                f"for q and v), not {spec.head_dim}/{spec.head_dim_v}")
    if spec.attn_mask != "none" or spec.dropout or spec.paged:
        return f"the Gluon backward does not take the {spec.mask_variant} variant yet"
    return None


class GluonBackward:
    """The Gluon backward's kernel of one call signature: grid, scalars, and its launch from a plan's slots
    (dQ's float32 accumulator, zeroed and Delta written by the Triton passes before it)."""

    def __init__(self, problem: AttentionProblem, config: GluonBackwardConfig, lse_strides: tuple[int, ...]):
        self.config = config
        self.kernel = codegen.load_backward(problem.spec, config).attn_bwd_dkdv
        self.sequences = problem.spec.seqlens
        self.packed = self.sequences == "varlen"
        # with the group split, each (batch, K/V head)'s key tile has group_split programs, each summing a part of
        # the group's query heads into float32 sums of dK and dV
        self.parts = config.group_split
        self.grid = (triton.cdiv(problem.max_seqlen_k if self.packed else problem.seqlen_k,
                                 codegen.backward_block_n(problem.spec, config)),
                     problem.batch * problem.kv_heads * self.parts)
        self.stores = codegen.backward_stores_by_pointers(problem.spec, config)
        self.scalars = (problem.scale, problem.kv_heads, problem.group_size, problem.seqlen_q, problem.seqlen_k,
                        0 if self.packed else lse_strides[0], lse_strides[1], problem.window_left,
                        problem.window_right)
        head_dim = codegen.width(problem.spec.head_dim)
        dtype = _GL_DTYPES[DTYPES[problem.spec.dtype]]
        dq_slice = codegen.backward_dq_slice(problem.spec, config)
        self.rows, self.keys = [1, 1, config.block_m, head_dim], [1, 1, GLUON_SPLIT_M, head_dim]
        self.dq_rows = [1, 1, config.block_m, dq_slice]
        self.row_layout = gl.NVMMASharedLayout.get_default_for(self.rows, dtype)
        self.key_layout = gl.NVMMASharedLayout.get_default_for(self.keys, dtype)
        self.dq_layout = gl.NVMMASharedLayout.get_default_for(self.dq_rows, gl.float32)
        self.slots = tuple(SLOTS.index(name) for name in ("Q", "K", "V", "DO", "DK", "DV", "DQ_ACC", "LSE", "DELTA"))
        # how the kernel makes its sequence's descriptors: the slots of the lengths' tensors
        self.lengths = {"fixed": (), "seqlens_k": (SLOTS.index("SEQLENS_K"),),
                        "varlen": (SLOTS.index("CU_Q"), SLOTS.index("CU_K"))}[self.sequences]
        # ALiBi: the slopes' slot and (B, H) strides
        self.alibi = (SLOTS.index(POINTER_OF["alibi_slopes"]), *problem.alibi_slopes.stride()) \
            if problem.spec.alibi else None

    def __call__(self, slots: tuple, stream: int | None = None) -> None:
        q, k, v, grad_out, dk, dv, dq_acc, lse, delta = (slots[index] for index in self.slots)
        rows, keys = self.rows, self.keys
        # packed (tokens, H, D) tensors: their (1, H, tokens, D) views, for the descriptors' types and layouts
        view = (lambda t: t.unsqueeze(0).transpose(1, 2)) if self.packed else (lambda t: t)
        args = (TensorDescriptor.from_tensor(view(q), rows, self.row_layout),
                TensorDescriptor.from_tensor(view(k), keys, self.key_layout),
                TensorDescriptor.from_tensor(view(v), keys, self.key_layout),
                TensorDescriptor.from_tensor(view(grad_out), rows, self.row_layout),
                TensorDescriptor.from_tensor(view(dk), keys, self.key_layout),
                TensorDescriptor.from_tensor(view(dv), keys, self.key_layout),
                TensorDescriptor.from_tensor(dq_acc, self.dq_rows, self.dq_layout), lse, delta, *self.scalars)
        if self.sequences != "fixed":  # the kernel makes its sequence's descriptors (in global scratch)
            args += tuple(slots[index] for index in self.lengths)
            if self.packed:  # rows (tokens) and heads, no batch
                args += (k, v, 0, k.stride(1), k.stride(0), 0, v.stride(1), v.stride(0), q, q.stride(1), q.stride(0),
                         grad_out, grad_out.stride(1), grad_out.stride(0))
            else:
                args += (k, v, *k.stride()[:3], *v.stride()[:3])
            launch.ensure_triton_allocator()
        if self.packed:  # the consumers' sequence rows of dQ's accumulator (1, H, tokens, D)
            args += (dq_acc, dq_acc.stride(1), dq_acc.stride(2))
        sums = ()
        if self.parts > 1:  # the group's parts add dK and dV up in float32 (one allocation and fill for both)
            sums = tuple(torch.zeros((2, *dk.shape), dtype=torch.float32, device=dk.device).unbind(0))
        if self.stores:  # dK and dV (or their sums): (batch, head, row) strides; packed (tokens, H, D), no batch
            for grad in sums or (dk, dv):
                args += (grad, 0, grad.stride(1), grad.stride(0)) if self.packed else (grad, *grad.stride()[:3])
        if self.alibi is not None:
            args += (slots[self.alibi[0]], *self.alibi[1:])
        if launch.compiling_only():
            self.kernel.warmup(*args, grid=self.grid, num_warps=4, maxnreg=self.config.maxnreg)
            return
        self.kernel[self.grid](*args, num_warps=4, maxnreg=self.config.maxnreg)
        for grad, total in zip((dk, dv), sums):
            grad.copy_(total)


class GluonForward:
    """The Gluon forward of one call signature: its compiled kernel, grid and scalar arguments."""

    def __init__(self, problem: AttentionProblem, config: GluonConfig, lse_strides: tuple[int, ...], sms: int):
        self.config = config
        self.kernel = codegen.load(problem.spec, config).attn_fwd
        self.sequences = problem.spec.seqlens  # "fixed", or how the kernel makes its sequence's descriptors
        # ALiBi: the slopes' (B, H) strides (a call's (H,) slopes broadcast over the batch at stride 0)
        self.alibi = tuple(problem.alibi_slopes.stride()) if problem.spec.alibi else None
        self.packed = self.sequences == "varlen"
        self.grid = (triton.cdiv(problem.max_seqlen_q if self.packed else problem.seqlen_q, config.block_m),
                     problem.batch * problem.heads)
        self.scalars = (problem.scale, problem.heads, problem.group_size, problem.seqlen_q, problem.seqlen_k,
                        0 if self.packed else lse_strides[0], lse_strides[1], problem.window_left,
                        problem.window_right)
        self.tiles = ()  # persistent: the query tiles per (batch, head) and the (batch, head)s, after the rest
        if config.persistent:  # one program per multiprocessor (or per tile, where there are fewer)
            self.tiles = self.grid
            self.grid = (min(self.grid[0] * self.grid[1], sms), 1)
        head_dim = codegen.width(problem.spec.head_dim)  # the tiles' width: lanes past the call's read 0
        dtype = _GL_DTYPES[DTYPES[problem.spec.dtype]]
        self.rows, self.keys = [1, 1, GLUON_SPLIT_M, head_dim], [1, 1, config.block_n, head_dim]
        self.row_layout = gl.NVMMASharedLayout.get_default_for(self.rows, dtype)  # once: ~15 us each
        self.key_layout = gl.NVMMASharedLayout.get_default_for(self.keys, dtype)

    def __call__(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, out: torch.Tensor, lse: torch.Tensor,
                 extras: tuple = NO_EXTRAS) -> None:
        rows, keys, row_layout, key_layout = self.rows, self.keys, self.row_layout, self.key_layout
        # packed (tokens, H, D) tensors: their (1, H, tokens, D) views, for the descriptors' types and layouts
        view = (lambda t: t.unsqueeze(0).transpose(1, 2)) if self.packed else (lambda t: t)
        descriptors = (TensorDescriptor.from_tensor(view(q), rows, row_layout),
                       TensorDescriptor.from_tensor(view(k), keys, key_layout),
                       TensorDescriptor.from_tensor(view(v), keys, key_layout),
                       TensorDescriptor.from_tensor(view(out), rows, row_layout))
        args = (*descriptors, lse, *self.scalars)
        if self.sequences == "seqlens_k":  # the kernel makes its sequence's K and V descriptors (in global scratch)
            args += (extras[_EXTRA["seqlens_k"]], k, v, *k.stride()[:3], *v.stride()[:3])
            launch.ensure_triton_allocator()
        elif self.packed:  # and, packed, its Q and O descriptors: rows (tokens) and heads, no batch
            args += (extras[_EXTRA["cu_seqlens_q"]], extras[_EXTRA["cu_seqlens_k"]], k, v, 0, k.stride(1), k.stride(0),
                     0, v.stride(1), v.stride(0), q, q.stride(1), q.stride(0), out, out.stride(1), out.stride(0))
            launch.ensure_triton_allocator()
        if self.alibi is not None:
            args += (extras[_EXTRA["alibi_slopes"]], *self.alibi)
        args += self.tiles
        if launch.compiling_only():
            self.kernel.warmup(*args, grid=self.grid, num_warps=4, maxnreg=self.config.maxnreg)
            return
        self.kernel[self.grid](*args, num_warps=4, maxnreg=self.config.maxnreg)


class GluonPlan:
    """A call's plan with a Gluon forward, a Gluon backward or both. The Triton family's plan of the same call (the
    heuristic's config where a Gluon kernel runs; with the Gluon backward, its atomic-dQ flavour, whose passes run
    around it) lays out the outputs and runs the rest; a Gluon kernel that cannot be built here, or is not the one
    a tuned entry measured, hands its part of the call to it, said once (`strict`: raises KernelBuildError
    instead)."""

    def __init__(self, problem: AttentionProblem, config: AttentionConfig, device: torch.device, q: torch.Tensor,
                 k: torch.Tensor, v: torch.Tensor, fallback: AttentionConfig, sources: frozenset[str] | None,
                 strict: bool = False):
        forward = config.fwd if isinstance(config.fwd, GluonConfig) else None
        backward = config.dkdv if isinstance(config.dkdv, GluonBackwardConfig) else None
        triton_config = config.replace(fwd=fallback.fwd if forward else config.fwd,
                                       dkdv=passes_config(problem.spec) if backward else config.dkdv)
        self.triton = Plan(problem, triton_config, device, q, k, v, fallback=None if strict else fallback,
                           sources=sources)
        self.gluon_config, self.backward_config, self.sources, self.strict = forward, backward, sources, strict
        self._forward: GluonForward | None = None
        self._backward: GluonBackward | None = None
        self._launched = self._backward_launched = False
        self._failure: str | None = None
        rows_dim = 0 if problem.packed else 2  # packed (tokens, H, D) tensors: rows are tokens
        readable = all(tma_readable(t, rows_dim, every_head=True) for t in (q, k, v))
        unreadable = None if readable else ("TMA cannot read these tensors (unit head-dim stride, 16-byte aligned "
                                            "strides)")
        failures = []
        if forward is not None:
            reason = unserved(problem.spec, device) or unreadable
            if reason is None and not problem.scale > 0:  # its row maximum is taken before the scale
                reason = f"the Gluon forward takes a positive scale, not {problem.scale}"
            if reason is None and not forward.persistent and problem.batch * problem.heads > MAX_GRID_Y:
                reason = f"{problem.batch} x {problem.heads} (batch x heads) programs exceed a grid's {MAX_GRID_Y} rows"
            if reason is None:
                try:
                    self._forward = GluonForward(problem, forward, self.triton.lse_layout[1], sm_count(device))
                    if sources is not None and source_hash("fwd", codegen.load(problem.spec, forward)) not in sources:
                        raise StaleKernels("the Gluon forward has changed since its tuned entry was measured")
                except (StaleKernels, Exception) as error:  # noqa: BLE001 - any failure here costs speed, not the call
                    reason = f"{type(error).__name__}: {error}"
                    self._forward = None
            if reason is not None:
                failures.append(f"the Gluon forward {forward} does not run here ({reason}): the Triton forward runs")
        if backward is not None:
            reason = backward_unserved(problem.spec, device) or unreadable
            if reason is None and problem.batch * problem.kv_heads * backward.group_split > MAX_GRID_Y:
                reason = (f"{problem.batch} x {problem.kv_heads} x {backward.group_split} (batch x K/V heads x "
                          f"group parts) programs exceed a grid's {MAX_GRID_Y} rows")
            if reason is None and not self.triton.atomic_dq:
                reason = "the Triton passes around it (atomic dQ) cannot be built here"
            if reason is None:
                try:
                    self._backward = GluonBackward(problem, backward, self.triton.lse_layout[1])
                    if sources is not None and source_hash("bwd", codegen.load_backward(problem.spec, backward)) \
                            not in sources:
                        raise StaleKernels("the Gluon backward has changed since its tuned entry was measured")
                except (StaleKernels, Exception) as error:  # noqa: BLE001 - any failure here costs speed, not the call
                    reason = f"{type(error).__name__}: {error}"
                    self._backward = None
            if reason is not None:
                failures.append(f"the Gluon backward {backward} does not run here ({reason}): the Triton backward runs")
        if failures:
            self._failure = "; ".join(failures)
            if strict:  # nothing runs in their place
                reasons = "; ".join(failure.rsplit(": the Triton", 1)[0] for failure in failures)
                raise KernelBuildError(f"{reasons} (strict mode: strict=True or $FATUNE_STRICT)")
            for failure in failures:
                warn_once(f"fatune: {failure}")

    def __getattr__(self, name: str):
        return getattr(self.triton, name)  # the backward and everything about the call's layout

    @property
    def build_failure(self) -> str | None:
        """Why part of the call runs other kernels than its config's (a Gluon kernel's, or the Triton plan's own
        fallback); None if none does."""
        return "; ".join(failure for failure in (self._failure, self.triton.build_failure) if failure) or None

    @property
    def config(self) -> AttentionConfig:
        """What runs: the Gluon kernels that build here, the Triton family's for the rest (in a Gluon backward's
        place, the Triton backward with its dQ kernel)."""
        config = self.triton.config
        if self.backward_config is not None:
            config = (config.replace(dkdv=self.backward_config) if self._backward is not None
                      else self.triton.deterministic_config())
        if self._forward is not None:
            config = config.replace(fwd=self.gluon_config)
        return config

    def deterministic_config(self) -> AttentionConfig:
        """The Triton family's backward with its dQ kernel (deterministic mode: the Gluon backward adds dQ up in
        any order), after this plan's forward."""
        config = self.triton.deterministic_config()
        return config if self._forward is None else config.replace(fwd=self.gluon_config)

    def forward(self, q, k, v, extras=NO_EXTRAS, seed=None):
        return self.forward_with_spans(q, k, v, extras, seed)[:2]

    def forward_with_spans(self, q, k, v, extras=NO_EXTRAS, seed=None, fresh_workspace: bool = False):
        if self._forward is not None:
            out, lse = self.triton.allocate_forward()
            if not self.triton.on_device():
                with torch.cuda.device(self.triton.device):
                    launched = self._launch(q, k, v, out, lse, extras)
            else:
                launched = self._launch(q, k, v, out, lse, extras)
            if launched:
                return out, lse, None
        return self.triton.forward_with_spans(q, k, v, extras, seed, fresh_workspace)

    def run_forward(self, slots: tuple, fresh_workspace: bool = False) -> None:
        """The forward into the buffers of `slots` (the Triton plan's: q, k, v, out, lse first), as the search
        times it; the Triton forward if the Gluon one cannot be built here."""
        extras = slots[_FIRST_EXTRA_SLOT:_FIRST_EXTRA_SLOT + len(OPTIONAL_TENSORS)]
        if self._forward is None or not self._launch(*slots[:5], extras):
            self.triton.run_forward(slots, fresh_workspace)

    def _launch(self, q, k, v, out, lse, extras) -> bool:
        """Launch the Gluon forward; False if its first launch cannot build it here (the Triton forward then runs,
        from this call on)."""
        try:
            self._forward(q, k, v, out, lse, extras)
        except Exception as error:  # noqa: BLE001 - a kernel that cannot be built costs speed, not the call
            if self._launched or self.strict:
                raise
            self._forward = None
            first = str(error).splitlines()[0][:160] if str(error) else ""
            self._failure = (f"the Gluon forward {self.gluon_config} cannot be built here "
                                  f"({type(error).__name__}: {first}): the Triton forward runs")
            warn_once(f"fatune: {self._failure}")
            return False
        self._launched = True
        return True

    # -- backward ------------------------------------------------------------------------------

    def runs_backward(self, grad_out: torch.Tensor, atomic: bool | None = None) -> bool:
        """Whether the Gluon backward runs for gradients like `grad_out` (`atomic`: as for Plan.bwd_launches; in
        torch's deterministic mode the Triton backward's dQ kernel runs)."""
        return (self._backward is not None and self.triton.atomic_dq and self.triton._atomic(atomic)
                and described(grad_out))

    def bwd_launches(self, grad_out: torch.Tensor, atomic: bool | None = None) -> tuple:
        """The Triton plan's backward launches, its atomic-dQ dK/dV kernel replaced by the Gluon backward where
        that runs (Delta and the zeroed accumulator before it, dQ's store after)."""
        launches = self.triton.bwd_launches(grad_out, atomic)
        if not self.runs_backward(grad_out, atomic) or len(launches) != 3:
            return launches
        return launches[0], self._backward, launches[2]

    def backward(self, grad_out, q, k, v, out, lse, extras=NO_EXTRAS, seed=None, key_spans=None):
        if not (self.runs_backward(grad_out) and all(described(t) for t in (q, k, v))):
            return self.triton.backward(grad_out, q, k, v, out, lse, extras, seed, key_spans, atomic=False)
        if not self.triton.on_device():
            with torch.cuda.device(self.triton.device):
                return self.backward(grad_out, q, k, v, out, lse, extras, seed, key_spans)
        grad_out = self.triton.addressable(grad_out)  # the Triton passes around the kernel read it too
        buffers = self.triton.allocate_backward(True)
        slots = self.triton.slots(q, k, v, out, lse, extras, seed, backward=True, key_spans=key_spans)
        slots += (grad_out, *buffers)
        prep, gluon, store = self.bwd_launches(grad_out, True)
        stream = launch.current_stream(self.triton.device)
        try:
            prep(slots, stream)
        except (KernelBuildError, StaleKernels):  # the Triton plan's own passes: it falls back as it does
            return self.triton.backward(grad_out, q, k, v, out, lse, extras, seed, key_spans, atomic=False)
        try:
            gluon(slots, stream)
        except Exception as error:  # noqa: BLE001 - a kernel that cannot be built costs speed, not the call
            if self._backward_launched or self.strict:
                raise
            self._backward = None
            first = str(error).splitlines()[0][:160] if str(error) else ""
            self._failure = (f"the Gluon backward {self.backward_config} cannot be built here "
                             f"({type(error).__name__}: {first}): the Triton backward runs")
            warn_once(f"fatune: {self._failure}")
            return self.triton.backward(grad_out, q, k, v, out, lse, extras, seed, key_spans, atomic=False)
        self._backward_launched = True
        try:
            store(slots, stream)
        except (KernelBuildError, StaleKernels):
            return self.triton.backward(grad_out, q, k, v, out, lse, extras, seed, key_spans, atomic=False)
        return buffers[1:4]
