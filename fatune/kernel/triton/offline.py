"""Compile generated kernels for a GPU target without a GPU, and read their resource use.

Triton ships ptxas and cuobjdump, so a kernel can be lowered all the way to a cubin on
any machine. That checks that the generated source really compiles (CI has no GPU) and
tells, before any launch, how much shared memory a config takes and whether it spills
registers.
"""

from __future__ import annotations

import dataclasses
import os
import re
import subprocess
import tempfile
from dataclasses import dataclass

import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource

from fatune.kernel.spec import KERNELS, AttentionConfig, KernelSpec
from fatune.kernel.triton import codegen, signature
from fatune.kernel.triton.structure import atomic_dq_pass_config, runnable_backward
from fatune.settings import interpreting

_KERNEL_FUNCTIONS = {"fwd": ("fwd", "attn_fwd"), "dkdv": ("bwd", "attn_bwd_dkdv"), "dq": ("bwd", "attn_bwd_dq"),
                     "prep": ("bwd", "attn_bwd_prep"), "dq_store": ("bwd", "attn_bwd_dq_store")}


@dataclass(frozen=True)
class CompiledKernel:
    """Resource use of one kernel compiled for one target."""

    shared_bytes: int
    registers: int
    spill_bytes: int  # local-memory stack frame; > 0 means registers spilled
    uses_wgmma: bool
    uses_tma: bool = False  # bulk tensor copies or reductions (cp.async.bulk.tensor, cp.reduce.async.bulk.tensor)
    num_warps: int = 0  # warps launched
    # the most wgmma groups any `wgmma.wait_group N` leaves running (0: none stays in flight past a wait)
    wgmma_in_flight: int = 0
    # exp2 instructions (the softmax) issued, in PTX order, while a committed wgmma group is not yet waited for:
    # 0 = no softmax runs under a tensor-core product (FlashAttention-3 runs one tile's softmax under the next
    # tile's product)
    exp2_under_wgmma: int = 0

    @property
    def spills(self) -> bool:
        return self.spill_bytes > 0


def _signature(kernel: str, spec: KernelSpec, absent: frozenset[str] = frozenset(),
               mask_dtype: str | None = None) -> tuple[dict, dict, dict]:
    """Argument types as a launch on contiguous, 16-aligned tensors specialises them: pointers and
    strides divisible by 16 (a block table's rows: any length), unit head-dim strides (and block-table page
    and mask key strides) and unused (None) pointers constant."""
    types = signature.triton_types(kernel, spec, absent, mask_dtype)
    attrs: dict[tuple[int], list] = {}
    constexprs: dict[str, int | None] = {name: None for name, kind in types.items() if kind == "constexpr"}
    for index, (name, kind) in enumerate(types.items()):
        # a contiguous block table's pages and a contiguous mask's keys too
        unit = name in ("stride_btp", "stride_mk") if spec.attn_mask != "none" else name == "stride_btp"
        if (name.startswith("stride") and name.endswith("d")) or unit:
            types[name] = "constexpr"
            constexprs[name] = 1
        elif name == "stride_btb" or name in _SPAN_STRIDES:  # pages per sequence: any count; spans: SPAN per index
            continue
        elif kind.startswith("*") or name.startswith("stride") or name in ("L_Q", "L_K"):
            attrs[(index,)] = [["tt.divisibility", 16]]
    return types, attrs, constexprs


_SPAN_STRIDES = frozenset(name for names in signature.SPAN_STRIDES.values() for name in names)


def _cuobjdump() -> str:
    return os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", "cuobjdump")


def _compile(kernel: str, spec: KernelSpec, config: AttentionConfig, arch: tuple[int, int],
             maxnreg: int | None, mask_dtype: str | None, lengths_of_one: tuple[str, ...], group: int | None):
    """Triton's compiled `kernel` (its PTX and cubin) for `arch`: compile_kernel's arguments."""
    if kernel not in _KERNEL_FUNCTIONS:
        raise ValueError(f"kernel: expected one of {sorted(_KERNEL_FUNCTIONS)}, got {kernel!r}")
    for name in lengths_of_one:
        if name not in ("L_Q", "L_K"):
            raise ValueError(f"lengths_of_one: expected names among ('L_Q', 'L_K'), got {name!r}")
    if group not in (None, 1):
        raise ValueError(f"group: expected None (any group) or 1, got {group!r}")
    if interpreting():
        raise RuntimeError("compile_kernel needs compiled (not interpreted) kernels: unset TRITON_INTERPRET")
    # as fatune.kernel.triton.resolve.resolve does
    config = runnable_backward(config, spec, tma=arch >= (9, 0))
    module_kind, function_name = _KERNEL_FUNCTIONS[kernel]
    fn = getattr(codegen.load(module_kind, spec, config), function_name)
    launch = getattr(config, kernel) if kernel in KERNELS else atomic_dq_pass_config(config, kernel)
    absent = frozenset() if config.dkdv.atomic_dq else frozenset({"DQ_ACC"})
    if config.fwd.num_splits == 1:  # no split-KV: its buffers are not passed
        absent |= {"O_PART", "LSE_PART", "SPLIT_COUNT"}
    types, attrs, constexprs = _signature(function_name, spec, absent, mask_dtype)
    for name in [*lengths_of_one, *(["GROUP"] if group == 1 and "GROUP" in types else [])]:
        attrs.pop((list(types).index(name),), None)
        types[name], constexprs[name] = "constexpr", 1
    source = ASTSource(fn=fn, signature=types, constexprs=constexprs, attrs=attrs)
    target = GPUTarget("cuda", arch[0] * 10 + arch[1], 32)
    options = (launch if maxnreg is None else dataclasses.replace(launch, maxnreg=maxnreg)).compile_options
    return triton.compile(source, target=target, options=options)


def compile_kernel(kernel: str, spec: KernelSpec, config: AttentionConfig, arch: tuple[int, int] = (9, 0),
                   maxnreg: int | None = None, mask_dtype: str | None = None,
                   lengths_of_one: tuple[str, ...] = (), group: int | None = None) -> CompiledKernel:
    """Compile `kernel` ('fwd', 'dkdv', 'dq', or atomic dQ's 'prep' and 'dq_store') for CUDA compute
    capability `arch`, its registers capped at `maxnreg` per thread if given, an additive mask of Triton type
    `mask_dtype` ("fp32"; default: the inputs'), the lengths named in `lengths_of_one` ("L_Q", "L_K") equal to
    1 (Triton then specialises them as constants), and with `group=1` the query heads per K/V head a constant
    1, as every launch without GQA has it (None: any group); raises on failure."""
    compiled = _compile(kernel, spec, config, arch, maxnreg, mask_dtype, lengths_of_one, group)
    with tempfile.NamedTemporaryFile(suffix=".cubin") as cubin:
        cubin.write(compiled.asm["cubin"])
        cubin.flush()
        usage = subprocess.run([_cuobjdump(), "--dump-resource-usage", cubin.name],
                               capture_output=True, text=True, check=True).stdout
    registers = re.search(r"REG:(\d+)", usage)
    stack = re.search(r"STACK:(\d+)", usage)
    return CompiledKernel(
        shared_bytes=int(compiled.metadata.shared),
        registers=int(registers.group(1)) if registers else 0,
        spill_bytes=int(stack.group(1)) if stack else 0,
        uses_wgmma="wgmma.mma_async" in compiled.asm["ptx"],
        uses_tma=any(op in compiled.asm["ptx"] for op in ("cp.async.bulk.tensor", "cp.reduce.async.bulk.tensor")),
        num_warps=int(compiled.metadata.num_warps),
        wgmma_in_flight=wgmma_in_flight(compiled.asm["ptx"]),
        exp2_under_wgmma=exp2_under_wgmma(compiled.asm["ptx"]),
    )


def wgmma_serialization(kernel: str, spec: KernelSpec, config: AttentionConfig, group: int | None = 1) -> str:
    """ptxas's note when it waits for each of `kernel`'s wgmma instructions on its own ("wgmma.mma_async
    instructions are serialized due to ..."), compiled for sm_90a as a launch with `group` query heads per K/V head
    specialises it; "" when the products stay pipelined. A serialized kernel loses its tensor cores' overlap
    with everything else: fatune's causal dK/dV kernel was so, 12-16% slower on an H200 (Nsight Compute, 2026-12-03)."""
    compiled = _compile(kernel, spec, config, (9, 0), None, None, (), group)
    with tempfile.TemporaryDirectory() as folder:
        ptx = os.path.join(folder, "kernel.ptx")
        with open(ptx, "w") as file:
            file.write(compiled.asm["ptx"])
        ptxas = os.path.join(os.path.dirname(_cuobjdump()), "ptxas")
        log = subprocess.run([ptxas, "-v", "--gpu-name=sm_90a", ptx, "-o", os.path.join(folder, "kernel.cubin")],
                             capture_output=True, text=True, check=True).stderr
    return "\n".join(line.split(":", 1)[-1].strip() for line in log.splitlines() if "are serialized" in line)


def wgmma_in_flight(ptx: str) -> int:
    """The largest N of the PTX's `wgmma.wait_group.sync.aligned N` (0 without any)."""
    return max((int(n) for n in re.findall(r"wgmma\.wait_group\.sync\.aligned\s+(\d+)", ptx)), default=0)


def exp2_under_wgmma(ptx: str) -> int:
    """exp2 instructions issued while a committed wgmma group may still be pending: the PTX read top to bottom
    twice, the second time entering each label with the most groups any branch to it left pending (so a group
    committed at the end of a loop body is pending again at the loop's head). An upper bound: 0 means no path
    reaches a softmax instruction under a product."""
    lines = ptx.splitlines()

    def scan(entering: dict[str, int]) -> tuple[int, dict[str, int]]:
        pending = count = 0
        leaving: dict[str, int] = {}
        for line in lines:
            if (label := re.match(r"\s*(\$L__\w+):", line)) is not None:
                pending = max(pending, entering.get(label.group(1), 0))
            elif "wgmma.commit_group" in line:
                pending += 1
            elif (wait := re.search(r"wgmma\.wait_group\.sync\.aligned\s+(\d+)", line)) is not None:
                pending = min(pending, int(wait.group(1)))
            elif "ex2.approx" in line and pending:
                count += 1
            if (branch := re.search(r"\bbra(?:\.uni)?\s+(\$L__\w+)", line)) is not None:
                leaving[branch.group(1)] = max(leaving.get(branch.group(1), 0), pending)
        return count, leaving

    return scan(scan({})[1])[0]
