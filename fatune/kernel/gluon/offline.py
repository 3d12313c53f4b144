"""Compile the Gluon kernels for sm_90 without a GPU, and read what their SASS does.

ptxas and cuobjdump ship in Triton's wheel, so CI (no GPU) compiles every structural variant, checks that it
spills nothing, and reads the order of its main loop's instructions: the softmax's exponentials (MUFU.EX2) must
issue before the wait for the last tensor-core product (WARPGROUP.DEPBAR), or the softmax does not overlap
P V at all (ptxas hoists such waits unless the kernel pins the exponentials; see the template).
"""

from __future__ import annotations

import re
import subprocess
import tempfile
from dataclasses import dataclass
from pathlib import Path

import triton
from triton.backends.compiler import GPUTarget
from triton.experimental.gluon import language as gl
from triton.experimental.gluon._runtime import GluonASTSource

from fatune.kernel.gluon.codegen import backward_dq_slice, backward_stores_by_pointers, load, load_backward, width
from fatune.kernel.spec import GLUON_SPLIT_M as SPLIT_M
from fatune.kernel.spec import GluonBackwardConfig, GluonConfig, KernelSpec
from fatune.kernel.triton.offline import _cuobjdump

_DTYPES = {"float16": (gl.float16, "fp16"), "bfloat16": (gl.bfloat16, "bf16")}


@dataclass(frozen=True)
class CompiledForward:
    shared_bytes: int
    registers: int
    spill_bytes: int
    sass: str  # the main loop's order: HGMMA, DEPBAR and MUFU.EX2 lines, runs collapsed

    @property
    def softmax_under_products(self) -> int:
        """How many times the main loop's exponentials (MUFU.EX2) issue between a wait that leaves one product in
        flight (DEPBAR ... 0x1: S_j retired, P_{j-1} V_{j-1} running) and the wait that retires it (0x0): the
        softmax overlapping the tensor cores, once per consumer warpgroup's loop. 0: it does not overlap."""
        lines = self.sass.splitlines()
        return sum(1 for before, line, after in zip(lines, lines[1:], lines[2:])
                   if line == "MUFU.EX2" and "DEPBAR" in before and before.endswith("0x1")
                   and "DEPBAR" in after and after.endswith("0x0"))


def signature(spec: KernelSpec, config: GluonConfig) -> tuple[dict, dict]:
    """Argument types and constexprs as a launch passes them (four-dim TMA descriptors, the LSE, scalars)."""
    dtype, name = _DTYPES[spec.dtype]
    head_dim = width(spec.head_dim)
    q_block, kv_block = [1, 1, SPLIT_M, head_dim], [1, 1, config.block_n, head_dim]
    q_layout = gl.NVMMASharedLayout.get_default_for(q_block, dtype)
    kv_layout = gl.NVMMASharedLayout.get_default_for(kv_block, dtype)
    desc = lambda block, layout: f"tensordesc<{name}[{','.join(map(str, block))}],{layout!r}>"  # noqa: E731
    types = {"desc_q": desc(q_block, q_layout), "desc_k": desc(kv_block, kv_layout), "desc_v": desc(kv_block, kv_layout),
             "desc_o": desc(q_block, q_layout), "LSE": "*fp32", "sm_scale": "fp32", "H": "i32", "GROUP": "i32",
             "L_Q": "i32", "L_K": "i32", "stride_lb": "i32", "stride_lh": "i32", "window_left": "i32",
             "window_right": "i32", "num_warps": "constexpr"}
    if spec.seqlens != "fixed":  # the kernel makes its sequence's descriptors (strides typed as a launch passes them)
        types |= {"K": f"*{name}", "V": f"*{name}", **{f"stride_{t}{d}": "i32" for t in "kv" for d in "bhl"}}
        types |= {"SEQLENS_K": "*i32"} if spec.seqlens == "seqlens_k" else \
            {"CU_Q": "*i32", "CU_K": "*i32", "Q": f"*{name}", "O": f"*{name}", "stride_qh": "i32", "stride_ql": "i32",
             "stride_oh": "i32", "stride_ol": "i32"}
    if spec.alibi:
        types |= {"ALIBI": "*fp32", "stride_ab": "i32", "stride_ah": "i32"}
    if config.persistent:
        types |= {"M_TILES": "i32", "BH": "i32"}
    return types, {"num_warps": 4}


def compile_forward(spec: KernelSpec, config: GluonConfig) -> CompiledForward:
    """Compile the forward of `spec` with `config` for sm_90a; raises on failure."""
    compiled = _compile(load(spec, config).attn_fwd, *signature(spec, config), config.maxnreg)
    registers, spills, sass = _cubin_facts(compiled, sass=True)
    return CompiledForward(int(compiled.metadata.shared), registers, spills, _order(sass))


@dataclass(frozen=True)
class CompiledBackward:
    shared_bytes: int
    registers: int
    spill_bytes: int
    ptxas_warnings: tuple[str, ...]  # e.g. C7510-C7515: wgmma products serialized


def backward_signature(spec: KernelSpec, config: GluonBackwardConfig) -> tuple[dict, dict]:
    """Argument types and constexprs of the backward's kernel as a launch passes them."""
    dtype, name = _DTYPES[spec.dtype]
    head_dim = width(spec.head_dim)
    dq_slice = backward_dq_slice(spec, config)
    q_block, kv_block, dq_block = [1, 1, config.block_m, head_dim], [1, 1, SPLIT_M, head_dim], [1, 1, config.block_m,
                                                                                               dq_slice]
    q_layout = gl.NVMMASharedLayout.get_default_for(q_block, dtype)
    kv_layout = gl.NVMMASharedLayout.get_default_for(kv_block, dtype)
    dq_layout = gl.NVMMASharedLayout.get_default_for(dq_block, gl.float32)
    desc = lambda kind, block, layout: f"tensordesc<{kind}[{','.join(map(str, block))}],{layout!r}>"  # noqa: E731
    types = {"desc_q": desc(name, q_block, q_layout), "desc_k": desc(name, kv_block, kv_layout),
             "desc_v": desc(name, kv_block, kv_layout), "desc_do": desc(name, q_block, q_layout),
             "desc_dk": desc(name, kv_block, kv_layout), "desc_dv": desc(name, kv_block, kv_layout),
             "desc_dqa": desc("fp32", dq_block, dq_layout), "LSE": "*fp32", "DELTA": "*fp32", "sm_scale": "fp32",
             "HKV": "i32", "GROUP": "i32", "L_Q": "i32", "L_K": "i32", "stride_lb": "i32", "stride_lh": "i32",
             "window_left": "i32", "window_right": "i32", "num_warps": "constexpr"}
    if spec.seqlens != "fixed":  # the producer makes its sequence's K and V descriptors
        types |= {"K": f"*{name}", "V": f"*{name}", **{f"stride_{t}{d}": "i32" for t in "kv" for d in "bhl"}}
        types |= {"SEQLENS_K": "*i32"} if spec.seqlens == "seqlens_k" else {
            "CU_Q": "*i32", "CU_K": "*i32", "Q": f"*{name}", "DO": f"*{name}", "DQA": "*fp32",
            **{f"stride_{t}{d}": "i32" for t in ("q", "do", "dqa") for d in "hl"}}
    if backward_stores_by_pointers(spec, config):  # the group split's float32 sums, else dK and dV
        grads = "fp32" if config.group_split > 1 else name
        types |= {"DK": f"*{grads}", "DV": f"*{grads}",
                  **{f"stride_{t}{d}": "i32" for t in ("dk", "dv") for d in "bhl"}}
    if spec.alibi:
        types |= {"ALIBI": "*fp32", "stride_ab": "i32", "stride_ah": "i32"}
    return types, {"num_warps": 4}


def compile_backward(spec: KernelSpec, config: GluonBackwardConfig) -> CompiledBackward:
    """Compile the backward of `spec` with `config` for sm_90a; raises on failure."""
    compiled = _compile(load_backward(spec, config).attn_bwd_dkdv, *backward_signature(spec, config), config.maxnreg)
    with tempfile.NamedTemporaryFile(suffix=".ptx", mode="w") as ptx:
        ptx.write(compiled.asm["ptx"])
        ptx.flush()
        checked = subprocess.run([_ptxas(), "-v", "-arch=sm_90a", f"--maxrregcount={config.maxnreg}", ptx.name,
                                  "-o", "/dev/null"], capture_output=True, text=True)
    warnings = tuple(line.strip() for line in (checked.stdout + checked.stderr).splitlines()
                     if "warning" in line.lower())
    registers, spills, _ = _cubin_facts(compiled)
    return CompiledBackward(int(compiled.metadata.shared), registers, spills, warnings)


def _compile(fn, types: dict, constants: dict, maxnreg: int):
    """`fn` compiled for sm_90a with the argument `types` and `constants` (constexprs) a launch passes."""
    constexprs = {(fn.arg_names.index(key),): value for key, value in constants.items()}
    return triton.compile(GluonASTSource(fn, types, constexprs), target=GPUTarget("cuda", 90, 32),
                          options={"num_warps": 4, "maxnreg": maxnreg})


def _cubin_facts(compiled, sass: bool = False) -> tuple[int, int, str]:
    """(registers, spilled bytes, its SASS if `sass`) of a compiled kernel, read by cuobjdump."""
    with tempfile.NamedTemporaryFile(suffix=".cubin") as cubin:
        cubin.write(compiled.asm["cubin"])
        cubin.flush()
        usage = subprocess.run([_cuobjdump(), "--dump-resource-usage", cubin.name], capture_output=True, text=True,
                               check=True).stdout
        listing = subprocess.run([_cuobjdump(), "-sass", cubin.name], capture_output=True, text=True,
                                 check=True).stdout if sass else ""
    registers, stack = re.search(r"REG:(\d+)", usage), re.search(r"STACK:(\d+)", usage)
    return int(registers.group(1)) if registers else 0, int(stack.group(1)) if stack else 0, listing


def _ptxas() -> str:
    return str(Path(_cuobjdump()).with_name("ptxas"))


def _order(sass: str) -> str:
    """The SASS lines that tell the overlap (HGMMA, WARPGROUP.DEPBAR, MUFU.EX2), runs of one kind collapsed."""
    kept, previous = [], None
    for line in sass.splitlines():
        match = re.search(r"(HGMMA\S*|WARPGROUP\.DEPBAR\S*[^;]*|MUFU\.EX2)", line)
        if match is None:
            continue
        kind = match.group(1).split()[0] if not match.group(1).startswith("WARPGROUP") else match.group(1).strip()
        if kind == previous and kind in ("MUFU.EX2",) or (previous or "").startswith("HGMMA") and kind.startswith("HGMMA"):
            continue
        kept.append(kind)
        previous = kind
    return "\n".join(kept)
