"""Launching the Gluon forward, and the plan of a call whose forward it runs (the Triton backward after it).

The kernel reads Q, K, V and writes O through four-dim TMA descriptors made per call from the tensors' own
shapes and strides ((B, H, L, D), any dim order whose strides TMA can address), so no input is copied, a
ragged last tile reads zeros and writes nothing past the sequence, and GQA reads K/V head h // GROUP. The O and
LSE it writes are in the Triton family's layouts, so that family's backward runs after it unchanged.
"""

from __future__ import annotations

import torch
import triton
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.nvidia.hopper import TensorDescriptor

from fatune.hardware import device_arch
from fatune.kernel.gluon import codegen
from fatune.kernel.problem import NO_EXTRAS, OPTIONAL_TENSORS, AttentionProblem
from fatune.kernel.spec import DTYPES, GLUON_SPLIT_M, AttentionConfig, GluonConfig, KernelSpec
from fatune.kernel.triton import launch
from fatune.kernel.triton.launch import SLOTS, Plan, StaleKernels
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
    if spec.attn_mask != "none" or spec.alibi or spec.dropout or spec.paged:
        return f"the Gluon forward does not take the {spec.mask_variant} variant yet"
    return None


class GluonForward:
    """The Gluon forward of one call signature: its compiled kernel, grid and scalar arguments."""

    def __init__(self, problem: AttentionProblem, config: GluonConfig, lse_strides: tuple[int, ...]):
        self.config = config
        self.kernel = codegen.load(problem.spec, config).attn_fwd
        self.sequences = problem.spec.seqlens  # "fixed", or how the kernel makes its sequence's descriptors
        self.packed = self.sequences == "varlen"
        self.grid = (triton.cdiv(problem.max_seqlen_q if self.packed else problem.seqlen_q, config.block_m),
                     problem.batch * problem.heads)
        self.scalars = (problem.scale, problem.heads, problem.group_size, problem.seqlen_q, problem.seqlen_k,
                        0 if self.packed else lse_strides[0], lse_strides[1], problem.window_left,
                        problem.window_right)
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
        if launch.compiling_only():
            self.kernel.warmup(*args, grid=self.grid, num_warps=4, maxnreg=self.config.maxnreg)
            return
        self.kernel[self.grid](*args, num_warps=4, maxnreg=self.config.maxnreg)


class GluonPlan:
    """A call's plan with the Gluon forward. The Triton family's plan of the same call (its forward config the
    heuristic's) lays out the outputs and runs the backward; a Gluon kernel that cannot be built here, or is not
    the one a tuned entry measured, hands the whole call to it, said once."""

    def __init__(self, problem: AttentionProblem, config: AttentionConfig, device: torch.device, q: torch.Tensor,
                 k: torch.Tensor, v: torch.Tensor, fallback: AttentionConfig, sources: frozenset[str] | None):
        self.triton = Plan(problem, config.replace(fwd=fallback.fwd), device, q, k, v, fallback=fallback,
                           sources=sources)
        self.gluon_config, self.sources, self._forward, self._launched = config.fwd, sources, None, False
        self.build_failure: str | None = None
        rows_dim = 0 if problem.packed else 2  # packed (tokens, H, D) tensors: rows are tokens
        reason = unserved(problem.spec, device) or (None if all(tma_readable(t, rows_dim, every_head=True)
                                                                for t in (q, k, v)) else
                                                   "TMA cannot read these tensors (unit head-dim stride, 16-byte "
                                                   "aligned strides)")
        if reason is None and not problem.scale > 0:  # its row maximum is taken before the scale
            reason = f"the Gluon forward takes a positive scale, not {problem.scale}"
        if reason is None and problem.batch * problem.heads > MAX_GRID_Y:
            reason = f"{problem.batch} x {problem.heads} (batch x heads) programs exceed a grid's {MAX_GRID_Y} rows"
        if reason is None:
            try:
                self._forward = GluonForward(problem, config.fwd, self.triton.lse_layout[1])
                if sources is not None and source_hash("fwd", codegen.load(problem.spec, config.fwd)) not in sources:
                    raise StaleKernels("the Gluon forward has changed since its tuned entry was measured")
            except (StaleKernels, Exception) as error:  # noqa: BLE001 - any failure here costs speed, not the call
                reason = f"{type(error).__name__}: {error}"
                self._forward = None
        if reason is not None:
            self.build_failure = f"the Gluon forward {config.fwd} does not run here ({reason}): the Triton forward runs"
            warn_once(f"fatune: {self.build_failure}")

    def __getattr__(self, name: str):
        return getattr(self.triton, name)  # the backward and everything about the call's layout

    @property
    def config(self) -> AttentionConfig:
        return self.triton.config if self._forward is None else self.triton.config.replace(fwd=self.gluon_config)

    def deterministic_config(self) -> AttentionConfig:
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
            if self._launched:
                raise
            self._forward = None
            first = str(error).splitlines()[0][:160] if str(error) else ""
            self.build_failure = (f"the Gluon forward {self.gluon_config} cannot be built here "
                                  f"({type(error).__name__}: {first}): the Triton forward runs")
            warn_once(f"fatune: {self.build_failure}")
            return False
        self._launched = True
        return True
