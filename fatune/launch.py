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
import functools
import hashlib
import operator
import threading
from typing import Any, Callable, Sequence

import torch
import triton
from triton.compiler import CompiledKernel

from fatune import codegen, signature
from fatune.direct_launch import RUNTIME, direct_launcher, hooks_active
from fatune.dispatch import _warn, device_arch, sm_count
from fatune.heuristics import default_config, unpipelined
from fatune.inputs import MAX_SLICE_OFFSET, AttentionProblem, slice_offset
from fatune.mask_spans import layout as spans_layout
from fatune.mask_spans import mask_spans
from fatune.spec import (
    MAX_SPLITS,
    AttentionConfig,
    KernelSpec,
    LaunchConfig,
    atomic_dq_pass_config,
    runnable_backward,
    split_d_searched,
)

# Tensors of one call, in the order KernelLaunch picks its pointer arguments from.
SLOTS = ("Q", "K", "V", "O", "LSE", "MASK", "ALIBI", "CU_Q", "CU_K", "SEQLENS_K", "BLOCK_TABLE", "SEED", "KEY_SPANS",
         "QUERY_SPANS", "O_PART", "LSE_PART", "SPLIT_COUNT", "DO", "DELTA", "DQ", "DK", "DV", "DQ_ACC")
# order of a call's extras (the slots from MASK to BLOCK_TABLE)
EXTRAS = ("attn_mask", "alibi_slopes", "cu_seqlens_q", "cu_seqlens_k", "seqlens_k", "block_table")
NO_EXTRAS = (None,) * len(EXTRAS)
_KEY_SPANS_SLOT = SLOTS.index("KEY_SPANS")


def new_buffer(shape: Sequence[int], strides: Sequence[int], dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """An uninitialised buffer for a kernel to fill (the tests replace this to poison outputs)."""
    return torch.empty_strided(shape, strides, dtype=dtype, device=device)


def layout_like(shape: Sequence[int], strides: Sequence[int], last_dim: int | None = None
                ) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """(shape, strides) of a dense buffer shaped like a tensor (last dim replaced by `last_dim`)
    whose dims lie in memory in the tensor's order, the last dim innermost.

    Outputs and gradients take their input's layout, so a (B, L, H, D) tensor viewed as
    (B, H, L, D) gets a gradient that is a free view of (B, L, H, D) memory too. Where that
    layout would put rows too far apart for the kernels' int32 slice offsets (a stride-0 or
    (B, L, H, D) input of very many rows), the rows go next to each other instead.
    """
    shape = list(shape)
    if last_dim is not None:
        shape[-1] = last_dim
    row_dim = 0 if len(shape) == 3 else len(shape) - 2  # packed (total, H, D) or (..., L, D)
    outer = sorted(range(len(shape) - 1), key=lambda i: -strides[i])
    out_strides = _dense_strides(shape, outer + [len(shape) - 1])
    if slice_offset(shape, out_strides, row_dim) > MAX_SLICE_OFFSET:
        rows_inner = [i for i in outer if i != row_dim] + [row_dim, len(shape) - 1]
        out_strides = _dense_strides(shape, rows_inner)
    return tuple(shape), out_strides


def _dense_strides(shape: Sequence[int], order: Sequence[int]) -> tuple[int, ...]:
    """Strides of a dense buffer whose dims lie in memory in `order`, outermost first."""
    out_strides = [0] * len(shape)
    step = 1
    for dim in reversed(order):
        out_strides[dim] = step
        step *= max(shape[dim], 1)
    return tuple(out_strides)


def contiguous_strides(shape: Sequence[int]) -> tuple[int, ...]:
    strides, step = [], 1
    for size in reversed(shape):
        strides.append(step)
        step *= max(size, 1)
    return tuple(reversed(strides))


def bhld_strides(strides: Sequence[int], packed: bool) -> tuple[int, ...]:
    """The kernels' (b, h, l, d) strides: a packed (total, H, D) tensor is one (1, H, total, D) sequence."""
    return (0, strides[1], strides[0], strides[2]) if packed else tuple(strides)


def lse_dtype(dtype: torch.dtype, additive: bool = False) -> torch.dtype:
    """The dtype of the per-row LSE (log2 units) the forward stores for inputs of `dtype` (`additive`: under an
    additive mask): float64 for float32 inputs and additive masks, float32 otherwise (fatune.spec.lse_dtype_name)."""
    return torch.float64 if dtype == torch.float32 or additive else torch.float32


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


class KernelBuildError(RuntimeError):
    """A kernel's first launch failed before it ran: Triton could not compile or load it for this GPU
    (a compiler error, more shared memory than the GPU has, ...)."""


class KernelLaunch:
    """One kernel of a plan: its function, grid, launch options and non-pointer arguments."""

    __slots__ = ("fn", "grid", "options", "pick", "tail", "binary", "direct", "middle", "scratch", "tma")

    def __init__(self, fn: Any, kernel: str, grid: tuple[int, int, int], config: LaunchConfig,
                 values: dict[str, Any], spec: KernelSpec | None = None):
        """`spec`: the spec the kernel was rendered for (its parameters: fatune.signature.params)."""
        self.fn = fn
        self.grid = grid
        self.options = config.compile_options
        self.pick = operator.itemgetter(*(SLOTS.index(name) for name in signature.pointers(kernel, spec)))
        self.tail = tuple(values[name] for name in signature.values(kernel, spec))
        self.binary: CompiledKernel | None = None
        self.direct: Callable | None = None
        self.middle: tuple = ()
        self.scratch = 0  # global scratch bytes of one launch (TMA descriptors), known once compiled
        self.tma = bool(config.tma or config.atomic_dq == 2) and not codegen.interpreting()

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
        if binary is None and not codegen.interpreting():
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
        if not codegen.interpreting():
            self.fn.warmup(*args, grid=self.grid, **self.options)


def choose_splits(programs: int, key_tiles: int, sms: int) -> int:
    """Split-KV runs when the grid leaves multiprocessors idle: as many splits as fill one wave
    without starting a second (a partial second wave costs a whole split's time: decode B=8 on
    an H200 ran 80.6 us with 2 splits = 128 programs, 97.7 with 5, benchmarks/decode_sweep.py),
    each split with at least two key tiles."""
    if programs >= sms:
        return 1
    return max(1, min(MAX_SPLITS, sms // programs, key_tiles // 2))


def tma_readable(tensor: torch.Tensor, seq_dim: int, every_head: bool = False) -> bool:
    """Whether TMA can read `tensor`'s rows tile by tile: unit head-dim stride, a 16-byte aligned
    base, a positive 16-byte multiple as the row (`seq_dim`) stride, and as the other strides where
    their dim has more than one index (the kernel offsets its base by them). `every_head`: one
    descriptor spans all heads (dim 1), so the head stride is one of its strides, however many heads."""
    size = tensor.element_size()
    if tensor.data_ptr() % 16 or (tensor.stride(-1) != 1 and tensor.shape[-1] > 1):
        return False
    return all(stride > 0 and (stride * size) % 16 == 0 for dim, stride in enumerate(tensor.stride()[:-1])
               if dim == seq_dim or tensor.shape[dim] > 1 or (every_head and dim == 1))


def tma_available(device: torch.device) -> bool:
    """Whether kernels on `device` can use TMA: Hopper (sm_90) and newer, or Triton's interpreter."""
    arch = device_arch(device)
    return arch >= (9, 0) if arch is not None else codegen.interpreting()


def resolve(config: AttentionConfig, problem: AttentionProblem, device: torch.device,
            tensors: Sequence[torch.Tensor]) -> AttentionConfig:
    """`config` with its launch-time choices made for the call's `tensors` (q, k, v): GQA packing
    only where groups exist, the number of key splits when it is 0 (auto; any number lowered to what the
    partial results' int32 offsets can address: 1 past 2^30 output elements), TMA only on GPUs that
    have it and for tensors it can read (dK/dV's: the query's, and with the head-dim split K's and V's), and
    the backward's structure as it runs (fatune.spec.runnable_backward: atomic dQ of a kind that runs, TMA
    reductions only on GPUs with TMA; the head-dim split only where its halves are 64 lanes or more), and
    one stage for a kernel whose streamed loop runs once."""
    config = runnable_backward(config, problem.spec, tma_available(device))
    fwd = config.fwd
    pack = fwd.pack_gqa if problem.group_size > 1 else 0
    splits = fwd.num_splits
    if splits == 0:
        rows = problem.max_seqlen_q * (problem.group_size if pack else 1)
        programs = triton.cdiv(rows, fwd.block_m) * (problem.kv_heads if pack else problem.heads) * problem.batch
        splits = choose_splits(programs, triton.cdiv(problem.max_seqlen_k, fwd.block_n), sm_count(device))
    # the partial results (split, batch, head, row, D_v) are offset by split x split stride in int32
    part_rows = (1 if problem.packed else problem.batch) * problem.heads * problem.seqlen_q
    splits = max(1, min(splits, (MAX_SLICE_OFFSET + 1) // max(1, part_rows * problem.spec.head_dim_v)))
    seq_dim = 0 if problem.packed else 2
    # a paged cache's tiles gather rows from several pages: no descriptor spans them
    tma = bool(fwd.tma) and tma_available(device) and all(tma_readable(t, seq_dim) for t in tensors) and \
        not problem.spec.paged
    resolved = dataclasses.replace(fwd, pack_gqa=pack, num_splits=splits, tma=int(tma))
    # dK/dV reads the query rows (and dO's, checked per backward) of every head through one descriptor
    dkdv_tma = bool(config.dkdv.tma) and tma_available(device) and tma_readable(tensors[0], seq_dim, every_head=True)
    if config.dkdv.split_d == 2:  # the split also reads its resident K and V tiles through TMA
        dkdv_tma = dkdv_tma and all(tma_readable(t, seq_dim) for t in tensors[1:3])
    dkdv = dataclasses.replace(config.dkdv, tma=int(dkdv_tma))
    dq = config.dq
    # a loop that runs once has nothing to pipeline (and ptxas 13 crashed compiling dQ's pipelined key loop
    # once Triton had specialised L_K = 1): the forward and dQ stream key tiles, dK/dV query tiles. Packed
    # sequences: max_seqlen_* is the caller's bound, the kernels' L_Q / L_K the total, each sequence within both
    keys = min(problem.max_seqlen_k, problem.seqlen_k)
    queries = min(problem.max_seqlen_q, problem.seqlen_q)
    if keys <= resolved.block_n:
        resolved = dataclasses.replace(resolved, num_stages=1)
    if keys <= dq.block_n:
        dq = dataclasses.replace(dq, num_stages=1)
    if queries <= dkdv.block_m:
        dkdv = dataclasses.replace(dkdv, num_stages=1)
    if (resolved, dkdv, dq) == (fwd, config.dkdv, config.dq):
        return config
    return config.replace(fwd=resolved, dkdv=dkdv, dq=dq)


def resolutions(config: AttentionConfig, spec: KernelSpec, grouped: bool) -> list[AttentionConfig]:
    """Every config `resolve` (and the backward, for its dO) can turn `config` into for calls of `spec` (with
    GQA groups or not), whatever their tensors and GPU: key splits chosen (one, or several) when 0, TMA kept
    or dropped, atomic dQ as asked or lowered; in a fixed order. Not the one-stage kernels of calls whose loops
    run once: they render the same source but for the config named in its header. (torch's deterministic mode, which swaps
    atomic dQ for the dQ kernel, is the caller's choice, not part of what a tuned config was measured as.)"""
    fwd = config.fwd
    fwds = {dataclasses.replace(fwd, pack_gqa=fwd.pack_gqa if grouped else 0, num_splits=splits, tma=tma)
            for splits in ((1, 2) if fwd.num_splits == 0 else (fwd.num_splits,)) for tma in {fwd.tma, 0}}
    backwards = {(dataclasses.replace(runnable.dkdv, tma=tma), runnable.dq)
                 for runnable in (runnable_backward(config, spec, tma_dq) for tma_dq in (True, False))
                 for tma in {config.dkdv.tma, 0}}
    return [config.replace(fwd=f, dkdv=d, dq=q) for f in sorted(fwds, key=str)
            for d, q in sorted(backwards, key=lambda pair: (str(pair[0]), str(pair[1])))]


@functools.lru_cache(maxsize=4096)
def kernel_hash(spec: KernelSpec, config: AttentionConfig, grouped: bool) -> str:
    """Hash of every forward and backward source `config` can launch for `spec` (its `resolutions`,
    rendered): what a tuned entry was measured with. A template edit in code none of them contains
    leaves it unchanged."""
    resolved = resolutions(config, spec, grouped)
    forwards = {c.fwd: c for c in resolved}  # each forward and each backward rendered once
    backwards = {(c.dkdv, c.dq): c for c in resolved}
    digest = hashlib.sha256()
    for kind, configs in (("fwd", forwards), ("bwd", backwards)):
        for variant in sorted(configs, key=str):
            digest.update(codegen.render(kind, spec, configs[variant]).encode())
    return digest.hexdigest()[:16]


SEARCH_HASH_TILE = LaunchConfig(64, 64, num_warps=4, num_stages=2)  # tiles enter the source as constants only


@functools.lru_cache(maxsize=1024)
def search_hash(spec: KernelSpec, grouped: bool) -> str:
    """Hash of every kernel source a search of `spec` can render, at one fixed tile with each structure value
    (forward TMA, key splits, GQA packing; dK/dV TMA, each atomic-dQ kind, the head-dim split where searched;
    with GQA the dQ kernel beside dK/dV):
    the templates' part of a study's
    name (fatune.search.study_name). A template edit in code none of them contains (another mask variant's,
    say) leaves it unchanged, so an interrupted search's studies still resume after it."""
    tile = SEARCH_HASH_TILE
    hashes = [kernel_hash(spec, AttentionConfig(fwd=dataclasses.replace(tile, num_splits=0, pack_gqa=pack, tma=1),
                                                dkdv=dataclasses.replace(tile, tma=1, atomic_dq=atomic, split_d=split),
                                                dq=dataclasses.replace(tile, concurrent=concurrent)),
                          grouped)
              for pack in ((0, 1) if grouped else (0,)) for atomic in (0, 2)
              for split in ((1, 2) if split_d_searched(spec) else (1,))
              for concurrent in ((0, 1) if grouped and not atomic else (0,))]
    return hashlib.sha256("".join(hashes).encode()).hexdigest()[:16]


_compile_only = False


def compile_only() -> None:
    """From now on, launches in this process compile their kernels and launch nothing (the search's
    compile-pool processes run a trial's real launch path this way)."""
    global _compile_only
    _compile_only = True


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


PROBLEM_TENSORS = ("attn_mask", "alibi_slopes", "seqlens_k", "cu_seqlens_q", "cu_seqlens_k", "block_table")
_FALL_BACK_LOCK = threading.Lock()


def metadata_only(problem: AttentionProblem) -> AttentionProblem:
    """`problem` with its optional tensors replaced by meta tensors of their shapes, strides and dtypes: what a
    cached plan keeps to rebuild itself, never holding a call's data alive."""
    def meta(tensor: torch.Tensor | None) -> torch.Tensor | None:
        return None if tensor is None else torch.empty_strided(tensor.shape, tensor.stride(), dtype=tensor.dtype,
                                                               device="meta")

    return dataclasses.replace(problem, **{name: meta(getattr(problem, name)) for name in PROBLEM_TENSORS})


class Plan:
    """Everything constant across calls of one problem shape: layouts, grids, kernel launches.

    forward(q, k, v, extras, seed) -> (out, lse); backward(...) -> (dq, dk, dv). `extras`
    holds the call's optional tensors in EXTRAS order (None where absent); `seed` is the
    dropout seed tensor (int64, on the device) or None.
    """

    def __init__(self, problem: AttentionProblem, config: AttentionConfig, device: torch.device,
                 q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, fallback: AttentionConfig | None = None):
        """`fallback`: the config to switch to if `config`'s kernels cannot be built on this GPU (a tuned
        entry's: the heuristic's), or None to raise KernelBuildError."""
        self.problem, self.asked, self.fallback = metadata_only(problem), config, fallback
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
        # a mask tensor's spans (fatune.mask_spans, made per call): indexed like the mask, broadcast dims at stride 0
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
            module = codegen.load("fwd", self.spec, self.config)
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
        except KernelBuildError as error:
            self.fall_back(error, config, q, k, v)
            return self._forward(q, k, v, extras, seed, fresh_workspace)
        return out, lse, slots[_KEY_SPANS_SLOT]

    def fall_back(self, error: KernelBuildError, failed: AttentionConfig, q: torch.Tensor, k: torch.Tensor,
                  v: torch.Tensor) -> None:
        """After `error` (the kernels of `failed`, this plan's config when they were launched, cannot be built
        here): switch this plan to its fallback config, said once per process, unless another thread has
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
            rebuilt.build_failure = f"the config {failed} cannot be built on this GPU ({error}): {fallback} runs"
            _warn(f"fatune: the config {failed} cannot be built on this GPU ({error}); running {fallback} for "
                  f"{self.spec.mask_variant} {self.spec.dtype} d{self.spec.head_dim}")
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

    def backward(self, grad_out: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                 out: torch.Tensor, lse: torch.Tensor, extras: tuple = NO_EXTRAS,
                 seed: torch.Tensor | None = None, key_spans: torch.Tensor | None = None
                 ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """dQ, dK, dV. `key_spans`: the forward's of the same call (forward_with_spans), or None: made again."""
        if not self.on_device():
            with torch.cuda.device(self.device):
                return self.backward(grad_out, q, k, v, out, lse, extras, seed, key_spans)
        if slice_offset(grad_out.shape, grad_out.stride(), 0 if self.packed else 2) > MAX_SLICE_OFFSET:
            # its rows lie too far apart for the kernels' int32 offsets: a copy in the output's layout, which fits
            grad_out = new_buffer(*self.out_layout, self.dtype, self.device).copy_(grad_out)
        atomic = self.adds_dq_atomically()
        launches = self.bwd_launches(grad_out, atomic)
        buffers = self.allocate_backward(atomic)
        slots = self.slots(q, k, v, out, lse, extras, seed, backward=True, key_spans=key_spans) + (grad_out, *buffers)
        config = self.config
        try:
            self.run_backward(slots, launches, self.beside())
        except KernelBuildError as error:  # O and LSE stand: any backward config takes them
            self.fall_back(error, config, q, k, v)
            return self.backward(grad_out, q, k, v, out, lse, extras, seed, key_spans)
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
        else:  # a mask tensor: the tiles its kernels skip (fatune.mask_spans), made per call
            key_spans, query_spans = mask_spans(extras[0], self.problem.attn_mask.shape, backward, key_spans)
        return (q, k, v, out, lse, *extras, seed, key_spans, query_spans, None, None, None)
