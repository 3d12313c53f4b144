"""GPU time of a mask tensor's span scans (fatune.mask_spans) per direction, grain and tile, beside torch's own
reductions over the same bytes (the bandwidth a scan could reach).

    python benchmarks/spans_probe.py OUT.json [--lengths 2048,8192]

Masks: (2, 1, L, L) bool, prefix LM and random 90%, and the prefix LM as an additive bf16 mask. Each tile
(BLOCK_R, BLOCK_C, num_warps) of a direction's mode runs; the spans must equal the default tile's.
Medians of triton.testing.do_bench, compile excluded.
"""

from __future__ import annotations

import argparse
import json

import torch
from triton.testing import do_bench

import fatune.mask_spans as mask_spans

# (BLOCK_R, BLOCK_C, num_warps): key spans reduce a tile along its columns; query spans (COLUMNWISE) fold
# grains of GRAIN columns (BLOCK_C is GRAIN)
ROW_TILES = [(8, 512, 4), (16, 256, 4), (32, 128, 4), (8, 1024, 8), (4, 1024, 4), (16, 512, 8)]
COLUMN_TILES = [(256, 16, 1), (256, 16, 2), (512, 16, 2), (512, 16, 4), (1024, 16, 4), (1024, 16, 8),
                (2048, 16, 4), (2048, 16, 8)]


def masks(length: int) -> dict[str, torch.Tensor]:
    cols = torch.arange(length, device="cuda")
    prefix = torch.tensor([length // 4, length // 8], device="cuda")[:, None, None, None]
    prefix_lm = (cols[None, :] <= cols[:, None]) | (cols[None, :] < prefix)
    return {"prefix LM": prefix_lm, "random 90%": torch.rand(2, 1, length, length, device="cuda") < 0.9,
            "prefix LM additive bf16": torch.zeros(prefix_lm.shape, dtype=torch.bfloat16,
                                                   device="cuda").masked_fill(~prefix_lm, float("-inf"))}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("out")
    parser.add_argument("--lengths", default="2048,8192")
    args = parser.parse_args()
    results = []
    default_tiles = dict(mask_spans.TILES)
    for length in map(int, args.lengths.split(",")):
        for name, mask in masks(length).items():
            distinct = mask_spans.compact(mask)
            gigabytes = distinct.numel() * distinct.element_size() / 1e9
            as_bytes = distinct.view(torch.uint8) if distinct.dtype == torch.bool else distinct
            for row_dim, dim in ((2, -1), (3, -2)):
                ms = do_bench(lambda: as_bytes.amax(dim), return_mode="median")
                results.append(dict(length=length, mask=name, row_dim=row_dim, impl="torch amax", ms=ms,
                                    tb_per_s=gigabytes / ms))
                print(f"L={length} {name:24} row_dim={row_dim} torch amax {ms * 1e3:8.1f} us "
                      f"{gigabytes / ms:5.2f} TB/s", flush=True)
                mode = "rows" if row_dim == 2 else "columns"
                mask_spans.TILES = dict(default_tiles)
                expected = mask_spans.spans(distinct, row_dim, length)
                for tile in ROW_TILES if mode == "rows" else COLUMN_TILES:
                    mask_spans.TILES[mode] = tile
                    try:
                        got = mask_spans.spans(distinct, row_dim, length)
                        same = bool(torch.equal(got, expected))
                        ms = do_bench(lambda: mask_spans.spans(distinct, row_dim, length), return_mode="median")
                    except Exception as error:  # a tile past the machine's resources: recorded, not fatal
                        results.append(dict(length=length, mask=name, row_dim=row_dim, tile=tile,
                                            error=repr(error)[:200]))
                        continue
                    results.append(dict(length=length, mask=name, row_dim=row_dim, tile=tile, ms=ms,
                                        tb_per_s=gigabytes / ms, same=same))
                    print(f"L={length} {name:24} row_dim={row_dim} tile={tile} {ms * 1e3:8.1f} us "
                          f"{gigabytes / ms:5.2f} TB/s{'' if same else ' DIFFERENT'}", flush=True)
            mask_spans.TILES = dict(default_tiles)
            ms = do_bench(lambda: mask_spans.mask_spans(mask, (2, 16, length, length)), return_mode="median")
            results.append(dict(length=length, mask=name, impl="mask_spans (both)", ms=ms))
            print(f"L={length} {name:24} mask_spans, both directions: {ms * 1e3:8.1f} us", flush=True)
    with open(args.out, "w") as file:
        json.dump(dict(gpu=torch.cuda.get_device_name(), torch=torch.__version__, results=results), file, indent=1)


if __name__ == "__main__":
    main()
