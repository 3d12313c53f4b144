"""Masked, GQA and packed-sequence attention: fatune vs FlexAttention vs torch SDPA, one run (issue 12).

    python benchmarks/masked_cases.py OUT.json [--lengths 8192] [--head-dim 128] [--quick] [--profile] [--only TEXT]
        [--causal-config] [--mask-configs "fwd F, dkdv K, dq Q; ..."]

bf16, D = 128 (--head-dim), H = 2048 / D. Cases: causal sliding windows (256, 1024, 4096 keys), GQA
causal (H / 8 K/V heads), key padding (seqlens_k = L/2 and L/4), boolean attn_mask tensors (a
causal mask, beside the same mask by formula; a prefix-LM mask: causal, plus a prefix of L/4 and L/8 keys
every query sees; 90% of entries kept at random, where no tile is empty or full), packed documents (2, 5
and 64 documents of random lengths, causal, cu_seqlens). Every implementation runs the same inputs;
FlexAttention gets the same mask as a block mask (so it skips the same blocks; the tensor mask
through a mask_mod that reads it), SDPA runs where it can express the case (is_causal + enable_gqa;
a boolean mask tensor). Forward and forward+backward medians
(triton.testing.do_bench), compile time excluded, outputs compared with fatune's.
"""

from __future__ import annotations

import argparse
import functools
import json
import math
import random
import sys

import torch
import torch.nn.functional as F

import fatune
from fatune.measure import bench, kernel_times

DTYPE = torch.bfloat16
MODEL_DIM = 2048  # H * D
DISAGREE = 0.05  # a max |out - fatune's out| past this (bf16 outputs of unit-variance values): not the same attention


def flex_runner(keep, q_len: int, k_len: int, gqa: bool, batch: int):
    """Flex with `keep` as a block mask per batch element (B=None would take batch element 0's blocks for all:
    a mask that differs per batch element, such as key padding or a prefix, then runs wrong)."""
    from torch.nn.attention.flex_attention import create_block_mask, flex_attention

    torch._dynamo.reset()  # a fresh compile per case: past dynamo's recompile limit Flex runs unfused
    compiled = torch.compile(flex_attention, dynamic=False)
    block_mask = create_block_mask(keep, batch, None, q_len, k_len, device="cuda")
    return lambda q, k, v: compiled(q, k, v, block_mask=block_mask, enable_gqa=gqa)


def sdpa_runner(backend, **kwargs):
    from torch.nn.attention import sdpa_kernel

    def run(q, k, v):
        with sdpa_kernel(backend):
            return F.scaled_dot_product_attention(q, k, v, **kwargs)

    return run


def cases(length: int, quick: bool, heads: int) -> list[dict]:
    """Each case: name, B, H_kv, fatune kwargs, a Flex mask_mod, SDPA kwargs (None: not expressible), packing."""
    from torch.nn.attention import SDPBackend

    out = []
    windows = (1024,) if quick else (256, 1024, 4096)
    for window in windows:
        def keep(b, h, q_idx, kv_idx, window=window):
            return (kv_idx <= q_idx) & (kv_idx >= q_idx - window)
        out.append(dict(name=f"causal window {window}", batch=2, kv_heads=heads, fatune={"window_size": (window, 0)},
                        flex=keep, sdpa=None))
    kv_heads = max(1, heads // 8)
    out.append(dict(name=f"GQA {heads // kv_heads}:1 causal", batch=2, kv_heads=kv_heads, fatune={"is_causal": True, "enable_gqa": True},
                    flex=lambda b, h, q_idx, kv_idx: kv_idx <= q_idx,
                    sdpa={"is_causal": True, "enable_gqa": True}))
    lengths = torch.tensor([length // 2, length // 4], dtype=torch.int32, device="cuda")
    padding = torch.arange(length, device="cuda")[None, None, None, :] < lengths[:, None, None, None]
    out.append(dict(name="key padding L/2, L/4", batch=2, kv_heads=heads, fatune={"seqlens_k": lengths},
                    flex=lambda b, h, q_idx, kv_idx: kv_idx < lengths[b], sdpa={"attn_mask": padding},
                    sdpa_backends=(SDPBackend.EFFICIENT_ATTENTION, SDPBackend.CUDNN_ATTENTION)))
    # the same causal mask by formula and as a tensor: what the tensor path costs on a mask the kernels know
    out.append(dict(name="causal formula (is_causal)", batch=2, kv_heads=heads, fatune={"is_causal": True},
                    flex=lambda b, h, q_idx, kv_idx: kv_idx <= q_idx, sdpa={"is_causal": True}))
    positions = torch.arange(length, device="cuda")
    causal = (positions[None, :] <= positions[:, None]).expand(2, 1, length, length)
    out.append(dict(name="bool mask tensor: causal", batch=2, kv_heads=heads, fatune={"attn_mask": causal},
                    flex=lambda b, h, q_idx, kv_idx: kv_idx <= q_idx, sdpa={"attn_mask": causal},
                    sdpa_backends=(SDPBackend.EFFICIENT_ATTENTION, SDPBackend.CUDNN_ATTENTION)))
    prefix = torch.tensor([length // 4, length // 8], device="cuda")
    prefix_lm = ((positions[None, :] <= positions[:, None])[None] | (positions[None, None, :] < prefix[:, None, None]))
    prefix_lm = prefix_lm[:, None]  # (B, 1, L, L): the tensor a user hands over
    out.append(dict(name="bool mask tensor: prefix LM", batch=2, kv_heads=heads, fatune={"attn_mask": prefix_lm},
                    flex=lambda b, h, q_idx, kv_idx: prefix_lm[b, 0, q_idx, kv_idx], sdpa={"attn_mask": prefix_lm},
                    sdpa_backends=(SDPBackend.EFFICIENT_ATTENTION, SDPBackend.CUDNN_ATTENTION)))
    # no tile empty, none full: the spans skip nothing, so this times what they cost
    generator = torch.Generator(device="cuda").manual_seed(length)
    scattered = torch.rand(2, 1, length, length, device="cuda", generator=generator) < 0.9
    out.append(dict(name="bool mask tensor: random 90%", batch=2, kv_heads=heads, fatune={"attn_mask": scattered},
                    flex=lambda b, h, q_idx, kv_idx: scattered[b, 0, q_idx, kv_idx], sdpa={"attn_mask": scattered},
                    sdpa_backends=(SDPBackend.EFFICIENT_ATTENTION, SDPBackend.CUDNN_ATTENTION)))
    for documents in ((5,) if quick else (2, 5, 64)):
        rng = random.Random(documents)
        cuts = sorted(rng.sample(range(1, length), documents - 1))
        sizes = [b - a for a, b in zip([0, *cuts], [*cuts, length])]
        doc_id = torch.repeat_interleave(torch.arange(documents, device="cuda"),
                                         torch.tensor(sizes, device="cuda"))
        cu = torch.tensor([0, *torch.tensor(sizes).cumsum(0).tolist()], dtype=torch.int32, device="cuda")

        def keep(b, h, q_idx, kv_idx, doc_id=doc_id):
            return (doc_id[q_idx] == doc_id[kv_idx]) & (kv_idx <= q_idx)
        out.append(dict(name=f"{documents} packed documents, causal", batch=1, kv_heads=heads, packed=True,
                        fatune={"is_causal": True, "cu_seqlens_q": cu, "cu_seqlens_k": cu,
                                "max_seqlen_q": max(sizes), "max_seqlen_k": max(sizes)},
                        flex=keep, sdpa=None,
                        sizes=sizes))
    return out


def time_impl(run, q, k, v, grad_out) -> dict:
    def forward():
        with torch.no_grad():
            run(q, k, v)

    def step():
        run(q, k, v).backward(grad_out)

    step()
    torch.cuda.synchronize()
    return {"fwd_ms": bench(forward), "fwd_bwd_ms": bench(step, grad_to_none=[q, k, v])}


def step_once(run, leaves, grad_out) -> None:
    for t in leaves:
        t.grad = None
    run(*leaves).backward(grad_out)


def mask_configs(text: str) -> list[fatune.AttentionConfig]:
    """'fwd 64x64/w4/s2/t, dkdv 64x64/w8/s2/t, dq 128x64/w8/s3; ...' -> the AttentionConfigs."""
    configs = []
    for item in filter(None, (part.strip() for part in text.split(";"))):
        kernels = dict(field.split() for field in item.split(","))
        configs.append(fatune.AttentionConfig(**{name: fatune.LaunchConfig.parse(value) for name, value in kernels.items()}))
    return configs


def main() -> None:
    from torch.nn.attention import SDPBackend

    parser = argparse.ArgumentParser()
    parser.add_argument("out")
    parser.add_argument("--lengths", default="8192")
    parser.add_argument("--head-dim", type=int, default=128, help="D; H = 2048 / D")
    parser.add_argument("--quick", action="store_true", help="one window and one document count")
    parser.add_argument("--profile", action="store_true", help="also GPU time per kernel of fatune's and Flex's steps")
    parser.add_argument("--causal-config", action="store_true",
                        help="mask-tensor cases also at the launch config that is_causal gets (fatune-causal-config)")
    parser.add_argument("--mask-configs", default="", type=mask_configs,
                        help="mask-tensor cases also at these launch configs (fatune@fwd/dkdv/dq): '; '-separated, "
                             "each 'fwd F, dkdv K, dq Q' in LaunchConfig's text form")
    parser.add_argument("--only", default="", help="the cases whose name contains one of these (comma-separated) texts")
    args = parser.parse_args()
    D = args.head_dim
    H = max(1, MODEL_DIM // D)
    results = []
    for length in (int(x) for x in args.lengths.split(",")):
        chosen = [c for c in cases(length, args.quick, H) if any(part in c["name"] for part in args.only.split(","))]
        for case in chosen:
            torch.manual_seed(0)
            b, hkv = case["batch"], case["kv_heads"]
            q = torch.randn(b, H, length, D, device="cuda", dtype=DTYPE)
            k = torch.randn(b, hkv, length, D, device="cuda", dtype=DTYPE)
            v = torch.randn(b, hkv, length, D, device="cuda", dtype=DTYPE)
            grad_out = torch.randn_like(q)
            leaves = [t.requires_grad_() for t in (q, k, v)]
            row = {"case": case["name"], "L": length, "B": b, "H": H, "H_kv": hkv, "D": D, "impls": {}}
            if case.get("packed"):  # fatune gets packed (total, H, D) tensors of its own, as a varlen user has
                packed_leaves = [t[0].transpose(0, 1).detach().contiguous().requires_grad_() for t in (q, k, v)]
                packed_grad = grad_out[0].transpose(0, 1).contiguous()

                def fatune_run(q_, k_, v_, kw=case["fatune"], leaves=packed_leaves):
                    if q_.dim() == 3:
                        return fatune.attention(q_, k_, v_, **kw)
                    return fatune.attention(*leaves, **kw).detach().transpose(0, 1)[None]
                row["documents"] = case["sizes"]
            else:
                def fatune_run(q_, k_, v_, kw=case["fatune"]):
                    return fatune.attention(q_, k_, v_, **kw)
            runners = {"fatune": fatune_run}
            if "attn_mask" in case["fatune"]:
                # the mask summarised once (fatune.prepare_mask), as Flex's block mask is made once, outside the step
                prepared = fatune.prepare_mask(case["fatune"]["attn_mask"], (b, H, length, length))
                runners["fatune-prepared"] = functools.partial(fatune.attention,
                                                               **{**case["fatune"], "attn_mask": prepared})
            if args.causal_config and "attn_mask" in case["fatune"]:
                # the mask tensor's kernels at the launch config is_causal gets for this shape (its tuned entry):
                # what the tensor's own config (the heuristic's: mask tensors have no entries) costs
                borrowed = fatune.explain(q, k, v, is_causal=True).decision.config
                row["causal_config"] = str(borrowed)
                runners["fatune-causal-config"] = functools.partial(fatune.attention, config=borrowed,
                                                                    **case["fatune"])
            for config in args.mask_configs if "attn_mask" in case["fatune"] else ():
                runners[f"fatune@{config.fwd}|{config.dkdv}|{config.dq}"] = functools.partial(
                    fatune.attention, config=config, **case["fatune"])
            runners["flex"] = flex_runner(case["flex"], length, length, hkv != H, b)
            if case["sdpa"] is not None:
                backends = case.get("sdpa_backends", (SDPBackend.CUDNN_ATTENTION, SDPBackend.FLASH_ATTENTION))
                for backend in backends:
                    runners[f"sdpa-{backend.name.lower()}"] = sdpa_runner(backend, **case["sdpa"])
            with torch.no_grad():
                ours = fatune_run(q, k, v).float()
            for name, run in runners.items():
                own = (packed_leaves, packed_grad) if case.get("packed") and name == "fatune" else (leaves, grad_out)
                try:
                    timing = time_impl(run, *own[0], own[1])
                    with torch.no_grad():
                        timing["max_abs_diff_vs_fatune"] = float((run(q, k, v).float() - ours).abs().max())
                except Exception as error:  # noqa: BLE001 - a backend that cannot run a case is reported
                    timing = {"error": f"{type(error).__name__}: {str(error).splitlines()[0][:160]}"}
                if args.profile and name.startswith(("fatune", "flex")) and "error" not in timing:
                    timing["step_kernels_us"] = kernel_times(functools.partial(step_once, run, *own))
                    print(f"    {name} step kernels (us): " + ", ".join(
                        f"{kernel[:40]} {us:.1f}" for kernel, us in timing["step_kernels_us"].items()), flush=True)
                row["impls"][name] = timing
                for t in own[0]:
                    t.grad = None
            results.append(row)
            line = f"{case['name']:>28} L={length:<6}"
            best_other = min((t["fwd_bwd_ms"] for n, t in row["impls"].items()
                              if not n.startswith("fatune") and "fwd_bwd_ms" in t), default=math.nan)
            for name, t in row["impls"].items():
                line += f" | {name} " + (f"{t['fwd_ms']:.3f}/{t['fwd_bwd_ms']:.3f}" if "fwd_ms" in t else t["error"][:40])
                if t.get("max_abs_diff_vs_fatune", 0.0) > DISAGREE:  # one of the two is wrong: say so
                    line += f" (output differs from fatune's by {t['max_abs_diff_vs_fatune']:.3f})"
            ratio = best_other / row["impls"]["fatune"].get("fwd_bwd_ms", math.nan)
            line += f" | fatune vs best other (f+b) {ratio:.2f}x"
            if "fatune-prepared" in row["impls"]:
                line += f", prepared {best_other / row['impls']['fatune-prepared'].get('fwd_bwd_ms', math.nan):.2f}x"
            print(line, flush=True)
            with open(args.out, "w") as file:
                json.dump(results, file, indent=1)
    sys.stdout.flush()


if __name__ == "__main__":
    main()
