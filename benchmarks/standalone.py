"""What the standalone kernel probes share (`dkdv_split_probe.py`, `persistent_probe.py`): their arguments,
and the shapes they run on the GPU (B·L = 16384 tokens, H·D = 2048) or, with --interpret, in Triton's
interpreter (float16, whose products it computes reliably; one 2-head 128-token shape; no timing)."""

from __future__ import annotations

import argparse
import json
from collections.abc import Iterator

import torch

from fatune.launch import ensure_triton_allocator


def arguments(doc: str, lengths: str, head_dim: int) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=doc, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("out")
    parser.add_argument("--lengths", default=lengths)
    parser.add_argument("--head-dim", type=int, default=head_dim)
    parser.add_argument("--interpret", action="store_true", help="Triton's interpreter on the CPU: float16, a "
                        "2-head 128-token shape, errors only, no timing")
    args = parser.parse_args()
    ensure_triton_allocator()
    return args


def shapes(args: argparse.Namespace, interpreter_head_dim: int) -> Iterator[tuple[int, int, int, int, torch.device,
                                                                                  torch.dtype]]:
    """(batch, heads, length, head dim, device, dtype) of each shape to probe, torch's generator seeded for each
    (the same inputs in every run)."""
    if args.interpret:
        torch.manual_seed(0)
        yield 1, 2, 128, interpreter_head_dim, torch.device("cpu"), torch.float16
        return
    for length in (int(n) for n in args.lengths.split(",")):
        torch.manual_seed(0)
        yield max(1, 16384 // length), 2048 // args.head_dim, length, args.head_dim, torch.device("cuda"), torch.bfloat16


def save(path: str, rows: list[dict], row: dict) -> None:
    """Add `row`, print it and rewrite the JSON at `path` (a run cut short keeps what it measured)."""
    rows.append(row)
    print(row, flush=True)
    with open(path, "w") as handle:
        json.dump(rows, handle, indent=1)
