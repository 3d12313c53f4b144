"""Which kernel of a drawn random call faults on the GPU, and under which structure choices.

    python3 benchmarks/fault_probe.py SEED VARIANT   # one variant per process: a fault kills the CUDA context
    python3 benchmarks/fault_probe.py B,H,HKV,LQ,LK,D,DV VARIANT   # random float16 inputs of that shape instead

VARIANT: "dispatched" (the dispatcher's config as is) or "name=value,..." overrides of the dispatched config's
kernels, e.g. "dkdv.split_d=1", "fwd.pack_gqa=0", whole kernels ("dkdv=64x64/w4/s1/a2/d2") or call arguments
("kw.dropout_p=0.3", "kw.is_causal=True"). Each launch is synchronised (CUDA_LAUNCH_BLOCKING=1), so the
traceback names the faulting kernel.
"""

from __future__ import annotations

import dataclasses
import os
import sys

os.environ["CUDA_LAUNCH_BLOCKING"] = "1"

import torch  # noqa: E402

import fatune  # noqa: E402
from fatune import LaunchConfig  # noqa: E402
from fatune.dispatch import choose_config  # noqa: E402
from fatune.inputs import check_inputs  # noqa: E402
from tests.test_random_calls import draw  # noqa: E402


def main() -> None:
    variant = sys.argv[2]
    if "," in sys.argv[1]:
        b, h, hkv, lq, lk, d, dv = (int(part) for part in sys.argv[1].split(","))
        call = draw(0)
        device = "cuda" if torch.cuda.is_available() else "cpu"
        call.q, call.k, call.v = (torch.randn(b, heads, length, dim, dtype=torch.float16, device=device,
                                              requires_grad=True)
                                  for heads, length, dim in ((h, lq, d), (hkv, lk, d), (hkv, lk, dv)))
        call.kwargs = {"enable_gqa": h != hkv}
        call.about = [sys.argv[1]]
    else:
        call = draw(int(sys.argv[1]))
    kwargs = {key: value for key, value in call.kwargs.items() if key != "config"}
    problem = check_inputs(call.q, call.k, call.v, **kwargs)
    config = call.kwargs.get("config") or choose_config(problem, call.q.device, None)
    if variant != "dispatched":
        for change in variant.split(","):
            name, value = change.split("=")
            if name.startswith("kw."):
                kwargs[name[3:]] = {"True": True, "False": False}.get(value) if value in ("True", "False") else \
                    float(value) if "." in value else int(value)
            elif "." not in name:
                config = config.replace(**{name: LaunchConfig.parse(value)})
            else:
                kernel, field = name.split(".")
                config = config.replace(**{kernel: dataclasses.replace(getattr(config, kernel), **{field: int(value)})})
    print(call, "\n", variant, config, flush=True)
    out = fatune.attention(call.q, call.k, call.v, config=config, **kwargs)
    if call.q.is_cuda:
        torch.cuda.synchronize()
    print("forward ok", flush=True)
    grads = torch.autograd.grad(out, (call.q, call.k, call.v), torch.randn_like(out))
    if call.q.is_cuda:
        torch.cuda.synchronize()
    print("backward ok", [tuple(g.shape) for g in grads], flush=True)


if __name__ == "__main__":
    main()
