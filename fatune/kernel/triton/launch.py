"""The one way a call reaches the generated kernels: allocation, arguments, grids, launches.

A `Plan` holds everything about a call that does not change from one call to the next
with the same shapes, strides, dtypes and options: the kernel spec and launch configs,
output layouts, grids and each kernel's scalar and stride arguments. Calls with the same
plan then only allocate outputs and launch. After its first launch (through Triton's own
launcher, which compiles and specialises the kernel) a `KernelLaunch` keeps the compiled
binary and launches it directly: Triton's per-call argument binding and specialisation
checks are skipped, which is safe because everything they depend on (every integer
argument, the dtypes, the pointers' 16-byte alignment) is part of the plan's key.

The eager autograd Function, the torch custom ops and the search's timing runner all
launch through here.
"""

from __future__ import annotations

import dataclasses
import operator
import threading
from types import ModuleType
from typing import Any, Callable, Sequence

import torch
import triton
from triton.compiler import CompiledKernel

from fatune.hardware import device_arch
from fatune.kernel.direct_launch import RUNTIME, direct_launcher, hooks_active
from fatune.kernel.layout import (
    MAX_SLICE_OFFSET,
    bhld_strides,
    contiguous_strides,
    layout_like,
    slice_offset,
)
from fatune.kernel.mask_spans import layout as spans_layout
from fatune.kernel.mask_spans import mask_spans
from fatune.kernel.problem import NO_EXTRAS, OPTIONAL_TENSORS, AttentionProblem
from fatune.kernel.spec import AttentionConfig, KernelSpec, LaunchConfig, lse_dtype
from fatune.kernel.triton import codegen, signature
from fatune.kernel.triton.heuristics import default_config, unpipelined
from fatune.kernel.triton.resolve import resolve, source_hash, tma_readable
from fatune.kernel.triton.structure import atomic_dq_pass_config
from fatune.logs import warn_once
from fatune.settings import interpreting

# Tensors of one call, in the order KernelLaunch picks its pointer arguments from.
SLOTS = ("Q", "K", "V", "O", "LSE", *signature.CALL_POINTERS, "SEED", "KEY_SPANS", "QUERY_SPANS", "O_PART", "LSE_PART",
         "SPLIT_COUNT", "DO", "DELTA", "DQ", "DK", "DV", "DQ_ACC")
_KEY_SPANS_SLOT = SLOTS.index("KEY_SPANS")


def new_buffer(shape: Sequence[int], strides: Sequence[int], dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """An uninitialised buffer for a kernel to fill (the tests replace this to poison outputs)."""
    return torch.empty_strided(shape, strides, dtype=dtype, device=device)


def scratch_buffer(size: int, alignment: int = 128, stream: int | None = None) -> torch.Tensor:
    """Global scratch memory for a kernel launch on the current CUDA device (Triton's allocator
    interface: TMA kernels write their tensor descriptors there). It comes from torch's caching
    allocator on the current stream, so it may be freed as soon as the launch is queued."""
    return torch.empty(size, dtype=torch.uint8, device="cuda")


def ensure_triton_allocator() -> None:
    """Give Triton an allocator for kernels that need global scratch (TMA descriptors built
    in-kernel), unless this thread's context already has one (Triton keeps it in a ContextVar)."""
    from triton.runtime import _allocation

    if isinstance(_allocation._allocator.get(), _allocation.NullAllocator):
        triton.set_allocator(scratch_buffer)


class StaleKernels(RuntimeError):
    """A tuned entry's kernels, rendered by these templates, are not the ones it was measured with (its
    sources' code hashes: fatune.db.entry.Entry.sources): its timings say nothing of them."""


class KernelBuildError(RuntimeError):
    """A kernel's first launch failed before it ran: Triton could not compile or load it for this GPU
    (a compiler error, more shared memory than the GPU has, ...)."""


class KernelLaunch:
    """One kernel of a plan: its function, grid, launch options and non-pointer arguments."""

    __slots__ = ("fn", "grid", "options", "pick", "tail", "binary", "direct", "middle", "scratch", "tma")

    def __init__(self, fn: Any, kernel: str, grid: tuple[int, int, int], config: LaunchConfig,
                 values: dict[str, Any], spec: KernelSpec | None = None):
        """`spec`: the spec the kernel was rendered for (its parameters: fatune.kernel.triton.signature.params)."""
        self.fn = fn
        self.grid = grid
        self.options = config.compile_options
        self.pick = operator.itemgetter(*(SLOTS.index(name) for name in signature.pointers(kernel, spec)))
        self.tail = tuple(values[name] for name in signature.values(kernel, spec))
        self.binary: CompiledKernel | None = None
        self.direct: Callable | None = None
        self.middle: tuple = ()
        self.scratch = 0  # global scratch bytes of one launch (TMA descriptors), known once compiled
        self.tma = bool(config.tma or config.atomic_dq == 2) and not interpreting()

    def __call__(self, slots: tuple, stream: int | None) -> None:
        direct = self.direct
        if direct is not None and not _compile_only and not (RUNTIME.launch_enter_hook.calls or
                                                            RUNTIME.launch_exit_hook.calls):  # hooks check inlined
            middle = self.middle
            if self.scratch:
                middle = middle[:3] + (scratch_buffer(self.scratch),) + middle[4:]
            # Pointers as integers: Triton's launcher would call data_ptr() and then ask the driver
            # (cuPointerGetAttribute) whether each is device memory; the plan's checks already did.
            direct(*self.grid, stream, *middle, *[None if t is None else t.data_ptr() for t in self.pick(slots)],
                   *self.tail)
            return
        args = self.pick(slots) + self.tail
        if _compile_only:
            self.warmup(args)
            return
        if self.tma:
            ensure_triton_allocator()
        binary = self.binary
        if binary is not None and not hooks_active():
            binary.run(*self.grid, stream, binary.function, binary.packed_metadata, None, None, None, *args)
            return
        if binary is None and not interpreting():
            self.build(args)
        kernel = self.fn.run(*args, grid=self.grid, warmup=False, **self.options)
        if isinstance(kernel, CompiledKernel):  # the interpreter compiles nothing
            self.binary = kernel
            direct = direct_launcher(kernel)
            if direct is not None:
                self.direct, self.middle, per_program = direct
                self.scratch = per_program * self.grid[0] * self.grid[1] * self.grid[2]

    def build(self, args: tuple) -> None:
        """Compile and load this launch's kernel for the current GPU (a Triton cache hit once built), launching
        nothing: KernelBuildError if it cannot (a compiler error; more shared memory or threads than the GPU has)."""
        try:
            kernel = self.fn.run(*args, grid=self.grid, warmup=True, **self.options)
            if hasattr(kernel, "result"):  # an asynchronous compile's future
                kernel = kernel.result()
            kernel.run  # noqa: B018 - loads the binary, checking the GPU's limits
        except Exception as error:
            first = (str(error).strip().splitlines() or [""])[0]
            raise KernelBuildError(f"{getattr(self.fn, '__name__', 'kernel')} with {self.options}: "
                                   f"{type(error).__name__}: {first}") from error

    def warmup(self, args: tuple) -> None:
        """Compile what this launch runs (into Triton's cache), launching nothing."""
        if not interpreting():
            self.fn.warmup(*args, grid=self.grid, **self.options)


_compile_only = False


def compile_only() -> None:
    """From now on, launches in this process compile their kernels and launch nothing (the search's
    compile-pool processes run a trial's real launch path this way)."""
    global _compile_only
    _compile_only = True


def compiling_only() -> bool:
    """Whether launches in this process only compile (compile_only)."""
    return _compile_only


def current_stream(device: torch.device) -> int | None:
    if device.type != "cuda":
        return None
    return torch._C._cuda_getCurrentRawStream(device.index)


_side_streams: dict[tuple[torch.device, int], torch.cuda.Stream] = {}


def side_stream(device: torch.device, stream: int) -> torch.cuda.Stream:
    """The second stream a concurrent dQ kernel runs on beside `stream` (a raw stream of `device`), one per
    stream a backward is launched on (Plan.run_backward): a CUDA-graph capture on one stream never draws in
    work another stream's backward queued on a shared side stream."""
    side = _side_streams.get((device, stream))
    if side is None:
        side = _side_streams[(device, stream)] = torch.cuda.Stream(device)
    return side


_split_counts: dict[tuple[torch.device, int | None], torch.Tensor] = {}
MAX_COUNT_BUFFERS = 64


def split_counts(device: torch.device, stream: int | None, tiles: int, fresh: bool = False) -> torch.Tensor:
    """Zeroed int32 arrival counts for `tiles` split-KV tiles. Each launch leaves them zero again (a
    tile's last split resets its count), so one buffer per (device, stream) serves every launch
    queued on that stream. Each call gets its own (zeroed in its stream) under CUDA-graph capture and with
    `fresh` (the custom ops, whose calls torch.compile's CUDA graphs record, warm-up runs included, in a
    memory pool that no tensor but the op's outputs may outlive)."""
    if fresh or (device.type == "cuda" and torch.cuda.is_current_stream_capturing()):
        return torch.zeros(tiles, dtype=torch.int32, device=device)
    counts = _split_counts.get((device, stream))
    if counts is None or counts.numel() < tiles:
        if len(_split_counts) >= MAX_COUNT_BUFFERS:  # streams come and go; a dropped buffer is freed in stream order
            _split_counts.clear()
        counts = _split_counts[(device, stream)] = torch.zeros(max(tiles, 1024), dtype=torch.int32, device=device)
    return counts


_FALL_BACK_LOCK = threading.Lock()


def metadata_only(problem: AttentionProblem) -> AttentionProblem:
    """`problem` with its optional tensors replaced by meta tensors of their shapes, strides and dtypes: what a
    cached plan keeps to rebuild itself, never holding a call's data alive."""
    def meta(tensor: torch.Tensor | None) -> torch.Tensor | None:
        return None if tensor is None else torch.empty_strided(tensor.shape, tensor.stride(), dtype=tensor.dtype,
                                                               device="meta")

    return dataclasses.replace(problem, **{name: meta(getattr(problem, name)) for name in OPTIONAL_TENSORS})


class Plan:
    """Everything constant across calls of one problem shape: layouts, grids, kernel launches.

    forward(q, k, v, extras, seed) -> (out, lse); backward(...) -> (dq, dk, dv). `extras`
    holds the call's optional tensors in OPTIONAL_TENSORS order (None where absent); `seed` is the
    dropout seed tensor (int64, on the device) or None.
    """

    def __init__(self, problem: AttentionProblem, config: AttentionConfig, device: torch.device,
                 q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, fallback: AttentionConfig | None = None,
                 sources: frozenset[str] | None = None):
        """`fallback`: the config to switch to if `config`'s kernels cannot be built on this GPU, or are not the
        ones a tuned entry measured (a tuned entry's: the heuristic's), or None to raise KernelBuildError or
        StaleKernels. `sources`: a tuned entry's kernel sources ("KIND:CODE_HASH"; None: no entry), which the
        kernels this plan loads must be among."""
        self.problem, self.asked, self.fallback, self.sources = metadata_only(problem), config, fallback, sources
        self.build_failure: str | None = None  # why this plan runs its fallback, once it does
        # set below where split-KV or atomic dQ runs (every attribute set on every path: fall_back copies them)
        self.lse_part_layout = self.o_part_layout = self.dq_acc_layout = self.rows_grid = None
        self.split_tiles = 0
        spec, packed = problem.spec, problem.packed
        config = resolve(config, problem, device, (q, k, v))
        self.spec, self.config, self.device, self.packed = spec, config, device, packed
        self.dtype = q.dtype
        self.out_layout = layout_like(q.shape, q.stride(), spec.head_dim_v)
        self.grad_layouts = tuple(layout_like(t.shape, t.stride()) for t in (q, k, v))
        rows = (1, problem.heads, problem.seqlen_q) if packed else (problem.batch, problem.heads, problem.seqlen_q)
        self.lse_layout = (rows, contiguous_strides(rows))
        self.lse_dtype = lse_dtype(q.dtype, spec.attn_mask == "additive")
        mask, alibi = problem.attn_mask, problem.alibi_slopes
        self.values: dict[str, Any] = {
            "sm_scale": problem.scale, "window_left": problem.window_left, "window_right": problem.window_right,
            "dropout_p": problem.dropout_p, "H": problem.heads, "GROUP": problem.group_size,
            "L_Q": problem.seqlen_q, "L_K": problem.seqlen_k,
            "stride_lb": 0 if packed else self.lse_layout[1][0], "stride_lh": self.lse_layout[1][1],
        }
        self._add_strides("q", q.stride())
        self._add_strides("k", k.stride())
        self._add_strides("v", v.stride())
        self._add_strides("o", self.out_layout[1])
        for name, (_, strides) in zip(("dq", "dk", "dv"), self.grad_layouts):
            self._add_strides(name, strides)
        mask_strides = tuple(mask.stride()) if mask is not None else (0, 0, 0, 0)
        alibi_strides = tuple(alibi.stride()) if alibi is not None else (0, 0)
        self.values.update(zip(("stride_mb", "stride_mh", "stride_mq", "stride_mk", "stride_ab", "stride_ah"),
                               mask_strides + alibi_strides))
        # a mask tensor's spans (fatune.kernel.mask_spans, made per call): indexed like the mask, broadcast dims at stride 0
        for span, row_dim in (("KEY_SPANS", 2), ("QUERY_SPANS", 3)):
            span_strides = spans_layout(mask.shape, mask.stride(), row_dim) if mask is not None else (0, 0, 0)
            self.values.update(zip(signature.SPAN_STRIDES[span], span_strides))
        table = problem.block_table  # a paged cache: K and V hold (pages, H_kv, page size, D)
        self.values.update({"PAGE_SIZE": k.shape[2] if table is not None else 1,
                            "NUM_PAGES": k.shape[0] if table is not None else 0,
                            "stride_btb": table.stride(0) if table is not None else 0,
                            "stride_btp": table.stride(1) if table is not None else 0})
        self.uses_seed = spec.dropout
        self.splits = config.fwd.num_splits
        fwd_rows = problem.max_seqlen_q * (problem.group_size if config.fwd.pack_gqa else 1)
        self.fwd_grid = (triton.cdiv(fwd_rows, config.fwd.block_m),
                         problem.kv_heads if config.fwd.pack_gqa else problem.heads, problem.batch * self.splits)
        self.values["num_splits"] = self.splits
        if self.splits > 1:  # partial results: (split, batch, head, row[, dv]) in float32
            parts = (self.splits, *rows)
            self.lse_part_layout = (parts, contiguous_strides(parts))
            self.o_part_layout = ((*parts, spec.head_dim_v), contiguous_strides((*parts, spec.head_dim_v)))
            self.split_tiles = self.fwd_grid[0] * self.fwd_grid[1] * problem.batch
            shared = (lambda strides: (strides[0], 0, *strides[2:])) if packed else tuple  # one batch of rows
            self.values.update(zip(signature.strides("op", dims="sbhld"), shared(self.o_part_layout[1])))
            self.values.update(zip(signature.strides("lp", dims="sbh"), shared(self.lse_part_layout[1])))
        else:
            self.values.update(dict.fromkeys(signature.strides("op", dims="sbhld") + signature.strides("lp", dims="sbh"),
                                             0))
        self.dq_rows = problem.max_seqlen_q
        self.dq_grid = (triton.cdiv(self.dq_rows, config.dq.block_m), problem.heads, problem.batch)
        self.atomic_dq = bool(config.dkdv.atomic_dq)
        if self.atomic_dq:  # dQ's float32 accumulator: (B, H, L_Q, D), or one batch of L_Q rows when packed
            self.dq_acc_layout = ((*rows, spec.head_dim), contiguous_strides((*rows, spec.head_dim)))
            acc_strides = self.dq_acc_layout[1]
            self.values.update(zip(signature.strides("dqa"), (0, *acc_strides[1:]) if packed else acc_strides))
            self.rows_grid = (triton.cdiv(problem.seqlen_q, config.dq.block_m), problem.heads, rows[0])
        else:
            self.values.update(dict.fromkeys(signature.strides("dqa"), 0))
        self.dkdv_grid = (triton.cdiv(problem.max_seqlen_k, config.dkdv.block_n) * config.dkdv.split_d, problem.kv_heads,
                          problem.batch)
        self._fwd: KernelLaunch | None = None
        self._bwd: dict[tuple, tuple[KernelLaunch, ...]] = {}

    def _add_strides(self, name: str, strides: Sequence[int]) -> None:
        self.values.update(zip(signature.strides(name), bhld_strides(strides, self.packed)))

    # -- forward -----------------------------------------------------------------------------

    def fwd_launches(self) -> tuple[KernelLaunch, ...]:
        """The forward kernel (with split-KV, its last split per tile also merges the partial results)."""
        if self._fwd is None:
            module = self.checked("fwd", codegen.load("fwd", self.spec, self.config))
            self._fwd = (KernelLaunch(module.attn_fwd, "attn_fwd", self.fwd_grid, self.config.fwd, self.values,
                                      self.spec),)
        return self._fwd

    def allocate_forward(self) -> tuple[torch.Tensor, torch.Tensor]:
        out = new_buffer(*self.out_layout, self.dtype, self.device)
        return out, new_buffer(*self.lse_layout, self.lse_dtype, self.device)

    def on_device(self) -> bool:
        """Whether the current CUDA device is the tensors' (a kernel launches on the current one)."""
        return self.device.type != "cuda" or torch._C._cuda_getDevice() == self.device.index

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, extras: tuple = NO_EXTRAS,
                seed: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        return self.forward_with_spans(q, k, v, extras, seed)[:2]

    def forward_with_spans(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, extras: tuple = NO_EXTRAS,
                           seed: torch.Tensor | None = None, fresh_workspace: bool = False
                           ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
        """(out, lse, the mask tensor's key spans or None): the backward of the same call takes the key spans
        back (`backward(..., key_spans=)`) instead of scanning the mask for them again. `fresh_workspace`: no
        buffer kept from one call to the next (split_counts)."""
        launches = self._fwd
        if launches is None or launches[0].binary is None or self.splits > 1 or not self.on_device():
            return self._forward(q, k, v, extras, seed, fresh_workspace)  # the general path (and the first launch)
        # no split-KV, kernels loaded, on the current device: allocate, launch (every call after the first)
        out = new_buffer(*self.out_layout, self.dtype, self.device)
        lse = new_buffer(*self.lse_layout, self.lse_dtype, self.device)
        slots = self.slots(q, k, v, out, lse, extras, seed)
        stream = current_stream(self.device)
        for launch in launches:
            launch(slots, stream)
        return out, lse, slots[_KEY_SPANS_SLOT]

    def _forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, extras: tuple,
                 seed: torch.Tensor | None, fresh_workspace: bool = False
                 ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
        if not self.on_device():
            with torch.cuda.device(self.device):
                return self._forward(q, k, v, extras, seed, fresh_workspace)
        config = self.config
        out, lse = self.allocate_forward()
        slots = self.slots(q, k, v, out, lse, extras, seed)
        try:
            self.run_forward(slots, fresh_workspace)
        except (KernelBuildError, StaleKernels) as error:
            self.fall_back(error, config, q, k, v)
            return self._forward(q, k, v, extras, seed, fresh_workspace)
        return out, lse, slots[_KEY_SPANS_SLOT]

    def checked(self, kind: str, module: ModuleType) -> ModuleType:
        """`module`, if its source is among this plan's tuned entry's (or there is no entry); else StaleKernels."""
        if self.sources is not None and source_hash(kind, module) not in self.sources:
            raise StaleKernels(f"{kind} kernels of {self.config} have changed since its tuned entry was measured")
        return module

    def fall_back(self, error: KernelBuildError | StaleKernels, failed: AttentionConfig, q: torch.Tensor,
                  k: torch.Tensor, v: torch.Tensor) -> None:
        """After `error` (the kernels of `failed`, this plan's config when they were launched, cannot be built
        here, or are not those its tuned entry measured): switch this plan to its fallback config, said once per
        process, unless another thread has
        already; raise `error` if there is none (a config passed by hand, strict mode, the last fallback). A
        tuned entry falls back to the heuristic's config, the heuristic's to the same tiles unpipelined."""
        with _FALL_BACK_LOCK:
            if self.config is not failed:
                return  # switched by another thread meanwhile: the caller retries on the new config
            fallback = self.fallback
            if fallback is None:
                raise error
            if fallback == self.asked:  # the heuristic's config failed (or a tuned entry that is it): its tiles
                fallback = unpipelined(fallback)
                if fallback == self.asked:
                    raise error
            last = unpipelined(fallback)
            rebuilt = Plan(self.problem, fallback, self.device, q, k, v, fallback=None if last == fallback else last)
            why = (f"the tuned config {failed} was measured with kernels that have changed since (`fatune db "
                   f"refresh` re-times it)" if isinstance(error, StaleKernels) else
                   f"the config {failed} cannot be built on this GPU ({error})")
            rebuilt.build_failure = f"{why}: {fallback} runs"
            warn_once(f"fatune: {why}; running {fallback} for {self.spec.mask_variant} {self.spec.dtype} "
                      f"d{self.spec.head_dim}")
            self.__dict__.update(rebuilt.__dict__)  # one step under the GIL: other threads see one plan or the other

    def run_forward(self, slots: tuple, fresh_workspace: bool = False) -> None:
        stream = current_stream(self.device)
        if self.splits > 1:
            o_part = new_buffer(*self.o_part_layout, torch.float32, self.device)
            lse_part = new_buffer(*self.lse_part_layout, self.lse_dtype, self.device)
            counts = split_counts(self.device, stream, self.split_tiles, fresh_workspace)
            first = SLOTS.index("O_PART")
            slots = slots[:first] + (o_part, lse_part, counts) + slots[first + 3:]
        for launch in self.fwd_launches():
            launch(slots, stream)

    # -- backward ----------------------------------------------------------------------------

    def adds_dq_atomically(self) -> bool:
        """Whether this backward adds dQ up atomically: as configured, unless torch's deterministic mode is on
        (`torch.use_deterministic_algorithms`): atomic adds land in any order, so the dQ kernel runs instead."""
        return self.atomic_dq and not torch.are_deterministic_algorithms_enabled()

    def _atomic(self, asked: bool | None) -> bool:
        """Whether a backward adds dQ atomically: `asked` (None: adds_dq_atomically()), if the config has atomic dQ."""
        return self.adds_dq_atomically() if asked is None else asked and self.atomic_dq

    def deterministic_config(self) -> AttentionConfig:
        """The launched config with the dQ kernel in place of atomic dQ (deterministic mode), with the
        heuristic's dQ tile: an atomic config's own dQ tile may never have run as a dQ kernel (entries searched
        before the dQ study timed it beside a separate dK/dV, configs passed by hand)."""
        if not self.atomic_dq:
            return self.config
        return self.config.replace(dkdv=dataclasses.replace(self.config.dkdv, atomic_dq=0),
                                   dq=default_config(self.spec, device_arch(self.device)).dq)

    def bwd_launches(self, grad_out: torch.Tensor, atomic: bool | None = None) -> tuple[KernelLaunch, ...]:
        """The backward's kernels in launch order, for gradients of this stride and alignment (cached):
        dQ and Delta, then dK/dV; with a concurrent dQ kernel: Delta, then dQ and dK/dV (dK/dV first with
        `concurrent=2`; `beside` tells which runs on the second stream); with atomic dQ (`atomic`, default
        adds_dq_atomically()): Delta (and a zeroed dQ accumulator), dK/dV with dQ, then dQ's store."""
        atomic = self._atomic(atomic)
        key = (grad_out.stride(), grad_out.data_ptr() % 16, atomic)
        launches = self._bwd.get(key)
        if launches is None:
            config = self.config if atomic else self.deterministic_config()
            if config.dkdv.tma and not tma_readable(grad_out, 0 if self.packed else 2, every_head=True):
                config = config.replace(dkdv=dataclasses.replace(config.dkdv, tma=0))
            module = codegen.load("bwd", self.spec, config)
            if atomic or not self.atomic_dq:  # as measured: not deterministic mode's dQ kernel in atomic dQ's place
                self.checked("bwd", module)
            values = dict(self.values)
            values.update(zip(signature.strides("do"), bhld_strides(grad_out.stride(), self.packed)))
            dkdv = KernelLaunch(module.attn_bwd_dkdv, "attn_bwd_dkdv", self.dkdv_grid, config.dkdv, values, self.spec)
            if atomic:  # the passes around it take dQ's tile and warps (atomic_dq_pass_config)
                prep, store = (atomic_dq_pass_config(self.config, kernel) for kernel in ("prep", "dq_store"))
                launches = (KernelLaunch(module.attn_bwd_prep, "attn_bwd_prep", self.dq_grid, prep, values, self.spec),
                            dkdv, KernelLaunch(module.attn_bwd_dq_store, "attn_bwd_dq_store", self.rows_grid, store,
                                               values, self.spec))
            else:
                dq_grid = (triton.cdiv(self.dq_rows, config.dq.block_m), *self.dq_grid[1:])
                dq = KernelLaunch(module.attn_bwd_dq, "attn_bwd_dq", dq_grid, config.dq, values, self.spec)
                if config.dq.concurrent:
                    prep = KernelLaunch(module.attn_bwd_prep, "attn_bwd_prep", dq_grid,
                                        atomic_dq_pass_config(config, "prep"), values, self.spec)
                    launches = (prep, dq, dkdv) if config.dq.concurrent == 1 else (prep, dkdv, dq)
                else:
                    launches = (dq, dkdv)
            self._bwd[key] = launches
        return launches

    def beside(self) -> int | None:
        """The index in bwd_launches() of the dQ kernel that runs on a second stream beside dK/dV, or None: a
        dQ config without `concurrent`, or an atomic-dQ config (in deterministic mode too, whose dQ kernel
        takes the heuristic's dQ config)."""
        return None if self.atomic_dq else {0: None, 1: 1, 2: 2}[self.config.dq.concurrent]

    def run_backward(self, slots: tuple, launches: tuple[KernelLaunch, ...], beside: int | None) -> None:
        """Launch `launches` on the current stream in order; `beside` (see beside()): the one that runs on a
        second stream instead, forked after the first launch (Delta) and joined before returning, so the
        gradients are ready on the current stream as after any launch (in the interpreter: all in order)."""
        stream = current_stream(self.device)
        if beside is None or stream is None:
            for launch in launches:
                launch(slots, stream)
            return
        main, side = torch.cuda.current_stream(self.device), side_stream(self.device, stream)
        launches[0](slots, stream)
        forked, joined = torch.cuda.Event(), torch.cuda.Event()
        forked.record(main)
        side.wait_event(forked)
        try:
            for index in range(1, len(launches)):
                launches[index](slots, side.cuda_stream if index == beside else stream)
        finally:  # joined even when a launch fails: no work left unordered on the side stream (or a capture forked)
            joined.record(side)
            main.wait_event(joined)

    def allocate_backward(self, atomic: bool | None = None) -> tuple[torch.Tensor, ...]:
        """(delta, dq, dk, dv, dq_acc) buffers; dq_acc (atomic dQ's float32 accumulator) is None without it
        (`atomic`: as for bwd_launches)."""
        atomic = self._atomic(atomic)
        delta = new_buffer(*self.lse_layout, torch.float32, self.device)
        dq, dk, dv = (new_buffer(shape, strides, self.dtype, self.device) for shape, strides in self.grad_layouts)
        dq_acc = new_buffer(*self.dq_acc_layout, torch.float32, self.device) if atomic else None
        return delta, dq, dk, dv, dq_acc

    def addressable(self, grad_out: torch.Tensor) -> torch.Tensor:
        """`grad_out`, or where its rows lie too far apart for the kernels' int32 offsets a copy in the output's
        layout, which fits."""
        if slice_offset(grad_out.shape, grad_out.stride(), 0 if self.packed else 2) > MAX_SLICE_OFFSET:
            return new_buffer(*self.out_layout, self.dtype, self.device).copy_(grad_out)
        return grad_out

    def backward(self, grad_out: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                 out: torch.Tensor, lse: torch.Tensor, extras: tuple = NO_EXTRAS,
                 seed: torch.Tensor | None = None, key_spans: torch.Tensor | None = None, atomic: bool | None = None
                 ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """dQ, dK, dV. `key_spans`: the forward's of the same call (forward_with_spans), or None: made again;
        `atomic`: False runs an atomic-dQ config with the dQ kernel instead (as bwd_launches)."""
        if not self.on_device():
            with torch.cuda.device(self.device):
                return self.backward(grad_out, q, k, v, out, lse, extras, seed, key_spans, atomic)
        grad_out = self.addressable(grad_out)
        atomic = self._atomic(atomic)
        buffers = self.allocate_backward(atomic)
        slots = self.slots(q, k, v, out, lse, extras, seed, backward=True, key_spans=key_spans) + (grad_out, *buffers)
        config = self.config
        try:
            self.run_backward(slots, self.bwd_launches(grad_out, atomic), self.beside())
        except (KernelBuildError, StaleKernels) as error:  # O and LSE stand: any backward config takes them
            self.fall_back(error, config, q, k, v)
            return self.backward(grad_out, q, k, v, out, lse, extras, seed, key_spans, atomic)
        return buffers[1:4]

    # -- arguments ---------------------------------------------------------------------------

    def slots(self, q, k, v, out, lse, extras: tuple, seed: torch.Tensor | None, backward: bool = False,
              key_spans: torch.Tensor | None = None) -> tuple:
        """The forward slots (SLOTS up to SPLIT_COUNT; run_forward fills split-KV's); tensors the kernels
        do not read are None. A mask's spans: the keys' for the forward, the queries' too for `backward`
        (`key_spans`: the forward's of the same call, else made here)."""
        if extras is NO_EXTRAS:
            return (q, k, v, out, lse, None, None, None, None, None, None, seed, None, None, None, None, None)
        query_spans = None
        if extras[0] is None:
            key_spans = None
        else:  # a mask tensor: the tiles its kernels skip (fatune.kernel.mask_spans), made per call
            key_spans, query_spans = mask_spans(extras[0], self.problem.attn_mask.shape, backward, key_spans)
        return (q, k, v, out, lse, *extras, seed, key_spans, query_spans, None, None, None)
