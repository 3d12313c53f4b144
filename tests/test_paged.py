"""A paged K/V cache (`block_table`): the forward reads each key from the page the table names.

Every case scatters a contiguous cache into pages in random order, with spare pages full of NaN that
no sequence names (a read of one shows), and holds the paged forward to the accuracy rule against the
float64 golden of the contiguous call. Inference only: gradients are refused.
"""

from __future__ import annotations

import random
from dataclasses import dataclass, field

import pytest
import torch

import fatune
from fatune import settings
from fatune.call import check_inputs
from fatune.kernel import reference
from fatune.kernel.spec import AttentionConfig, LaunchConfig
from tests.conftest import DEVICE, HAS_GPU
from tests.reference import check_close, same_dtype_baselines, stable_seed

SPARE_PAGES = 3


@dataclass
class Paged:
    q: torch.Tensor
    k: torch.Tensor  # contiguous (B, H_kv, pages per sequence x page size, D)
    v: torch.Tensor
    k_cache: torch.Tensor  # (pages, H_kv, page size, D)
    v_cache: torch.Tensor
    block_table: torch.Tensor  # (B, pages per sequence) int32
    kwargs: dict = field(default_factory=dict)


def scatter_pages(k: torch.Tensor, v: torch.Tensor, page_size: int, rng: random.Random,
                  layout: str = "bhld") -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(B, H_kv, L_k, D) keys and values (L_k a multiple of `page_size`) scattered over the pages of a cache in
    random order, with SPARE_PAGES NaN pages no sequence names: (k pages, v pages, block table). layout 'bshd':
    the pages as flash-attn/vLLM store them, (pages, page size, H_kv, D), viewed as (pages, H_kv, page size, D)."""
    batch, kv_heads, length, _ = k.shape
    per_sequence = length // page_size
    pages = batch * per_sequence + SPARE_PAGES
    order = list(range(pages))
    rng.shuffle(order)
    table = torch.tensor(order[:batch * per_sequence], dtype=torch.int32).view(batch, per_sequence)

    def cache(t: torch.Tensor) -> torch.Tensor:
        size = (pages, page_size, kv_heads, t.shape[-1]) if layout == "bshd" else (pages, kv_heads, page_size, t.shape[-1])
        out = torch.full(size, float("nan"), dtype=t.dtype)
        out = out.transpose(1, 2) if layout == "bshd" else out
        for b in range(batch):
            for j in range(per_sequence):
                out[table[b, j]] = t[b, :, j * page_size:(j + 1) * page_size].detach().cpu()
        return out.to(t.device)

    return cache(k), cache(v), table.to(k.device)


def make_paged(batch, heads, kv_heads, seqlen_q, pages_per_sequence, page_size, head_dim, *, dtype=torch.float16,
               seed=0, layout="bhld") -> Paged:
    """Random q and a contiguous cache, and the same cache scattered over pages (scatter_pages)."""
    generator = torch.Generator().manual_seed(seed)

    def randn(*size):
        return torch.randn(*size, generator=generator, dtype=torch.float32).to(dtype).to(DEVICE)

    length = pages_per_sequence * page_size
    q = randn(batch, heads, seqlen_q, head_dim)
    k, v = randn(batch, kv_heads, length, head_dim), randn(batch, kv_heads, length, head_dim)
    return Paged(q, k, v, *scatter_pages(k, v, page_size, random.Random(seed), layout))


def compare_paged(case: Paged, **kwargs) -> None:
    """The paged forward (with kwargs) against the golden and PyTorch's error on the contiguous call."""
    with torch.no_grad():
        out = fatune.attention(case.q, case.k_cache, case.v_cache, block_table=case.block_table, **kwargs)
    plain = {key: value for key, value in kwargs.items() if key not in ("config", "strict")}
    problem = check_inputs(case.q, case.k, case.v, **plain)
    golden = reference.attention(case.q.double(), case.k.double(), case.v.double(), problem, "float64")
    for baseline, implementation in same_dtype_baselines(problem, case.q).items():
        check_close("out", out, golden, implementation(case.q, case.k, case.v), baseline)


def lengths(*values) -> torch.Tensor:
    return torch.tensor(values, dtype=torch.int32, device=DEVICE)


def forced(block_m=16, block_n=32, splits=1, pack=0, tma=0) -> AttentionConfig:
    tile = LaunchConfig(16, 16, num_warps=4, num_stages=1)
    fwd = LaunchConfig(block_m, block_n, num_warps=4, num_stages=1, num_splits=splits, pack_gqa=pack, tma=tma)
    return AttentionConfig(fwd=fwd, dkdv=tile, dq=tile)


def geometry(batch, heads, kv_heads, seqlen_q, pages_per_sequence, page_size, head_dim, layout="bhld") -> dict:
    """make_paged's arguments, in its order."""
    return {"batch": batch, "heads": heads, "kv_heads": kv_heads, "seqlen_q": seqlen_q,
            "pages_per_sequence": pages_per_sequence, "page_size": page_size, "head_dim": head_dim, "layout": layout}


# (id, geometry: B, H, H_kv, L_q, pages per sequence, page size, D; call kwargs): decode and chunked prefill
# against caches filled to different levels, pages smaller and larger than a key tile and of sizes that are no
# power of two, GQA packed and not, split-KV, masks; without `config` the dispatcher picks
CASES = [
    ("decode-gqa", geometry(3, 8, 2, 1, 8, 16, 32), {"enable_gqa": True, "seqlens_k": lengths(117, 5, 64)}),
    ("decode-page-24-d40", geometry(2, 4, 4, 1, 4, 24, 40), {"seqlens_k": lengths(70, 1)}),
    ("chunk-causal-pages-of-4", geometry(2, 4, 2, 7, 20, 4, 16),
     {"enable_gqa": True, "is_causal": True, "causal_alignment": "bottom_right", "seqlens_k": lengths(61, 80),
      "config": forced(block_n=32)}),
    ("page-larger-than-tile", geometry(2, 2, 1, 5, 2, 64, 16),
     {"enable_gqa": True, "seqlens_k": lengths(100, 64), "config": forced(block_n=16)}),
    ("split-kv-packed-gqa", geometry(2, 8, 2, 2, 6, 16, 16),
     {"enable_gqa": True, "seqlens_k": lengths(96, 33), "config": forced(splits=3, pack=1)}),
    ("tma-asked-dropped", geometry(1, 2, 2, 3, 3, 16, 16), {"config": forced(tma=1)}),
    ("full-pages-no-seqlens", geometry(2, 2, 2, 4, 5, 8, 16), {"is_causal": True}),
    ("pages-of-1", geometry(1, 2, 1, 1, 37, 1, 16), {"enable_gqa": True}),
    ("prefill-window-alibi", geometry(2, 4, 2, 30, 3, 16, 24),
     {"enable_gqa": True, "window_size": (9, 0), "is_causal": True, "seqlens_k": lengths(48, 35),
      "alibi_slopes": torch.linspace(0.05, 0.4, 4, device=DEVICE)}),
    ("bool-mask", geometry(2, 2, 2, 6, 4, 16, 16),
     {"attn_mask": torch.rand(2, 1, 6, 64, generator=torch.Generator().manual_seed(3)).to(DEVICE) < 0.7,
      "seqlens_k": lengths(64, 50)}),
    ("flash-attn-layout", geometry(2, 4, 2, 1, 4, 16, 32, layout="bshd"),
     {"enable_gqa": True, "seqlens_k": lengths(50, 64)}),
]


@pytest.mark.parametrize("dtype", [torch.float16, torch.float32], ids=str)
@pytest.mark.parametrize("make, kwargs", [case[1:] for case in CASES], ids=[case[0] for case in CASES])
def test_paged_forward_matches_the_contiguous_cache(make, kwargs, dtype):
    compare_paged(make_paged(**make, dtype=dtype, seed=stable_seed("paged", tuple(make.items()), dtype)), **kwargs)


def test_block_table_entries_out_of_range_read_a_clamped_page():
    """A block table is not read on the host: entries past the cache (or negative) read its last (first) page,
    as reference.unpage does, and nothing outside the cache. Here those two pages are NaN and no sequence
    names them, so a sequence with such an entry comes out NaN, the others as they were."""
    case = make_paged(3, 2, 2, 1, 4, 16, 16, seed=7)
    nan_page = torch.full_like(case.k_cache[:1], float("nan"))
    k_cache, v_cache = (torch.cat([nan_page, cache, nan_page]) for cache in (case.k_cache, case.v_cache))
    table = case.block_table + 1  # the cache's pages moved one up: page 0 and the last page are new NaN pages
    table[0, 1], table[1, 3] = 10**6, -5
    problem = check_inputs(case.q, k_cache, v_cache, block_table=table)
    with torch.no_grad():
        out = fatune.attention(case.q, k_cache, v_cache, block_table=table)
    golden = reference.attention(case.q.double(), k_cache.double(), v_cache.double(), problem, "float64")
    assert torch.isnan(out[:2]).all() and torch.isfinite(out[2]).all()
    torch.testing.assert_close(out.double(), golden, atol=2e-3, rtol=0, equal_nan=True)


def test_a_block_table_of_no_pages_gives_rows_that_see_no_key():
    """Zero pages per sequence: every row sees no key (0), whatever the pool holds (here NaN)."""
    q = torch.randn(2, 2, 3, 16, dtype=torch.float16, device=DEVICE)
    pool = torch.full((3, 2, 16, 16), float("nan"), dtype=torch.float16, device=DEVICE)
    with torch.no_grad():
        out = fatune.attention(q, pool, pool, block_table=torch.zeros(2, 0, dtype=torch.int32, device=DEVICE))
    assert torch.equal(out, torch.zeros_like(out))


def test_unpage_rebuilds_the_contiguous_cache():
    case = make_paged(3, 2, 2, 1, 5, 8, 16, seed=2)
    for cache, contiguous in ((case.k_cache, case.k), (case.v_cache, case.v)):
        assert torch.equal(reference.unpage(cache, case.block_table), contiguous)


def test_the_paged_spec_is_its_own_kernel_under_the_contiguous_calls_db_key():
    """Its kernel reads key rows through the table; its tuned-DB key is the contiguous call's (no search makes
    paged entries; the same tiles fit both), so strict mode and tuned entries serve it as they serve that call."""
    from fatune.db import mask_variants, problem_key
    from fatune.kernel.triton import codegen

    case = make_paged(1, 2, 2, 1, 2, 16, 16)
    problem = check_inputs(case.q, case.k_cache, case.v_cache, block_table=case.block_table, seqlens_k=lengths(20))
    spec = problem.spec
    assert spec.paged and spec.mask_variant == "seqlens-k+paged" and spec.mask_variant not in mask_variants()
    contiguous = check_inputs(case.q, case.k, case.v, seqlens_k=lengths(20))
    assert problem_key(problem) == problem_key(contiguous) and problem_key(problem).mask_variant == "seqlens-k"
    source = codegen.render("fwd", spec, forced(tma=1))
    assert "BLOCK_TABLE + off_b * stride_btb" in source and "make_tensor_descriptor" not in source
    plain = codegen.render("fwd", spec.__class__(**{**spec.to_dict(), "paged": False}), forced())
    assert "cols // PAGE_SIZE" not in plain


@pytest.mark.parametrize("change, error, match", [
    (lambda c: {"block_table": c.block_table.long()}, TypeError, "block_table: expected dtype torch.int32"),
    (lambda c: {"block_table": c.block_table[0]}, TypeError, "block_table: expected a 2-d"),
    (lambda c: {"block_table": c.block_table[:1]}, ValueError, "block_table: expected 2 rows"),
    (lambda c: {"v_cache": c.v_cache[:-1]}, ValueError, "value: expected 11 pages like key"),
    (lambda c: {"k_cache": c.k_cache[:0], "v_cache": c.v_cache[:0]}, ValueError, "key: a paged cache with no pages"),
    (lambda c: {"block_table": c.block_table[:, :1].expand(2, (2**31 - 1024) // c.k_cache.shape[2] + 1)}, ValueError,
     "block_table: .* exceed the 2147482624 key positions"),
    (lambda c: {"q": c.q.requires_grad_()}, ValueError, "block_table: a paged K/V cache is read for inference"),
])
def test_paged_calls_that_cannot_run_name_the_argument(change, error, match):
    case = make_paged(2, 2, 2, 1, 4, 16, 16)
    args = {"q": case.q, "k_cache": case.k_cache, "v_cache": case.v_cache, "block_table": case.block_table}
    args.update(change(case))
    with pytest.raises(error, match=match):
        fatune.attention(args["q"], args["k_cache"], args["v_cache"], block_table=args["block_table"])


def test_a_packed_call_takes_no_block_table():
    q = torch.randn(10, 2, 16, dtype=torch.float16, device=DEVICE)
    cu = lengths(0, 4, 10)
    with pytest.raises(ValueError, match="block_table: not used with packed inputs"):
        fatune.attention(q, q, q, cu_seqlens_q=cu, cu_seqlens_k=cu, block_table=torch.zeros(2, 1, dtype=torch.int32,
                                                                                              device=DEVICE))


def test_gradients_are_refused_through_the_custom_op_too():
    """torch.compile's path: the op refuses a block table with inputs that need gradients when autograd records
    it (the eager call refuses before any kernel)."""
    case = make_paged(1, 2, 2, 1, 2, 16, 16)
    q = case.q.clone().requires_grad_()
    with pytest.raises(ValueError, match="block_table: a paged K/V cache is read for inference"):
        torch.ops.fatune.attention_forward(q, case.k_cache, case.v_cache, None, 0.0, False, None, False, [-1, -1],
                                           None, None, None, None, None, None, None, case.block_table, None, [], None)
    compiled = torch.compile(lambda q: fatune.attention(q, case.k_cache, case.v_cache, block_table=case.block_table),
                             fullgraph=True, backend="aot_eager")
    with pytest.raises(Exception, match="block_table: a paged K/V cache is read for inference"):
        compiled(q)


def test_paged_decode_under_torch_compile_matches_eager():
    case = make_paged(2, 4, 2, 1, 4, 16, 16, seed=5)
    fill = lengths(50, 17)

    def decode(q, k_cache, v_cache, table, fill):
        return fatune.attention(q, k_cache, v_cache, enable_gqa=True, block_table=table, seqlens_k=fill)

    compiled = torch.compile(decode, fullgraph=True, backend="aot_eager")
    with torch.no_grad():
        eager = decode(case.q, case.k_cache, case.v_cache, case.block_table, fill)
        traced = compiled(case.q, case.k_cache, case.v_cache, case.block_table, fill)
    assert torch.equal(eager, traced)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=str)
@pytest.mark.parametrize("make, kwargs", [
    (geometry(8, 32, 8, 1, 64, 128, 128), {"enable_gqa": True}),
    (geometry(4, 16, 4, 128, 40, 256, 128), {"enable_gqa": True, "is_causal": True, "causal_alignment": "bottom_right"}),
    (geometry(3, 8, 8, 1, 100, 16, 64), {}),
], ids=["decode-pages-128", "chunk-pages-256", "decode-pages-16"])
def test_gpu_paged(make, kwargs, dtype):
    assert HAS_GPU
    case = make_paged(**make, dtype=dtype, seed=stable_seed("gpu-paged", tuple(make.items()), dtype))
    fill = torch.randint(1, make["pages_per_sequence"] * make["page_size"] + 1, (make["batch"],),
                         generator=torch.Generator().manual_seed(1), dtype=torch.int32).to(DEVICE)
    compare_paged(case, seqlens_k=fill, **kwargs)


def test_the_benchmarks_paged_cache_is_the_same_cache():
    """`fatune bench --inference` times the paged read on the cache it times contiguously (shuffled pages)."""
    from fatune.bench.inference import paged_cache

    k, v = torch.randn(2, 3, 64, 8), torch.randn(2, 3, 64, 8)
    k_pages, v_pages, table = paged_cache(k, v)
    assert table.dtype == torch.int32 and table.shape == (2, 4) and not torch.equal(table.flatten(), torch.arange(8))
    assert torch.equal(reference.unpage(k_pages, table), k) and torch.equal(reference.unpage(v_pages, table), v)
    with pytest.raises(ValueError, match="page_size: expected a divisor"):
        paged_cache(k, v, page_size=24)


@pytest.mark.skipif(HAS_GPU, reason="the dense fallback of CPU tensors")
def test_the_dense_fallback_reads_the_pages_too(monkeypatch):
    """CPU tensors without Triton's interpreter run the dense torch implementation: on the same cache."""
    from fatune.runtime import plans

    monkeypatch.setattr(plans, "interpreting", lambda: False)
    monkeypatch.setattr(plans, "_plans", {})
    monkeypatch.delenv(settings.STRICT_ENV, raising=False)
    case = make_paged(2, 4, 2, 3, 4, 16, 32, dtype=torch.float32, seed=11)
    fill = lengths(40, 64)
    with torch.no_grad():
        out = fatune.attention(case.q, case.k_cache, case.v_cache, block_table=case.block_table, seqlens_k=fill,
                               enable_gqa=True, is_causal=True, causal_alignment="bottom_right")
    problem = check_inputs(case.q, case.k, case.v, seqlens_k=fill, enable_gqa=True, is_causal=True,
                           causal_alignment="bottom_right")
    expected = reference.attention(case.q.double(), case.k.double(), case.v.double(), problem, "float64")
    torch.testing.assert_close(out.double(), expected, atol=1e-5, rtol=1e-5)


def test_the_dense_fallback_never_reads_keys_past_seqlens_k(monkeypatch):
    """A cache's unwritten slots may hold NaN: past seqlens_k they are never read (the kernels do not load them).
    The dense fallback multiplied their values by zero weights: NaN in every row, paged or contiguous."""
    from fatune.runtime import plans

    monkeypatch.setattr(plans, "interpreting", lambda: False)
    monkeypatch.setattr(plans, "_plans", {})
    monkeypatch.delenv(settings.STRICT_ENV, raising=False)
    case = make_paged(2, 4, 2, 3, 4, 16, 32, dtype=torch.float32, seed=5)
    fill = lengths(40, 17)
    past = torch.arange(case.k.shape[2], device=case.k.device)[None, None, :, None] >= fill[:, None, None, None]
    k, v = case.k.masked_fill(past, float("nan")), case.v.masked_fill(past, float("nan"))
    k_cache, v_cache = (cache.clone() for cache in (case.k_cache, case.v_cache))
    for cache, dense in ((k_cache, k), (v_cache, v)):  # the same NaN through the block table
        for b, pages in enumerate(case.block_table.tolist()):
            for slot, page in enumerate(pages):
                cache[page] = dense[b, :, slot * cache.shape[2]:(slot + 1) * cache.shape[2]]
    problem = check_inputs(case.q, case.k, case.v, seqlens_k=fill, enable_gqa=True)
    expected = reference.attention(case.q.double(), case.k.double(), case.v.double(), problem, "float64")
    with torch.no_grad():
        paged = fatune.attention(case.q, k_cache, v_cache, block_table=case.block_table, seqlens_k=fill,
                                 enable_gqa=True)
    q, k, v = (t.clone().requires_grad_() for t in (case.q, k, v))
    out = fatune.attention(q, k, v, seqlens_k=fill, enable_gqa=True)
    out.sum().backward()
    for got in (paged, out):
        torch.testing.assert_close(got.double(), expected, atol=1e-5, rtol=1e-5)
    assert all(bool(t.grad.isfinite().all()) for t in (q, k, v))


def test_the_paged_decode_forward_keeps_as_many_key_tiles_in_flight(tmp_path):
    """Compiled for sm_90, the paged decode forward's software pipeline holds as many K/V tiles in shared memory
    as the contiguous one's (3 at 4 stages): its page lookups run a tile ahead, so no key load waits on a
    lookup of its own iteration (one that did left one tile in flight: 38 KB of shared memory against 102)."""
    from tests.test_codegen import _compile_in_subprocess

    script = (
        "import dataclasses\n"
        "from fatune.kernel.triton import offline\n"
        "from fatune.kernel.triton.heuristics import default_config\n"
        "from fatune.kernel.spec import KernelSpec\n"
        "for paged in (False, True):\n"
        "    spec = KernelSpec('bfloat16', 128, seqlens='seqlens_k', paged=paged)\n"
        "    config = default_config(spec, (9, 0), decode=True)\n"
        "    config = config.replace(fwd=dataclasses.replace(config.fwd, num_splits=2))\n"
        "    print(offline.compile_kernel('fwd', spec, config).shared_bytes)\n"
    )
    contiguous, paged = map(int, _compile_in_subprocess(script, tmp_path).splitlines())
    assert paged == contiguous > 64 * 1024, (paged, contiguous)
