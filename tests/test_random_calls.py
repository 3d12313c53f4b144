"""Random calls across the whole input space, against the float64 golden (accuracy rule in reference.py).

The other test modules check each feature alone or in the pairs that share code; users combine them
freely. Each run draws fresh cases that mix them: dtype, batch, heads and GQA groups, lengths from 0,
head dims 1..256 with a different value head dim, memory layouts, packed varlen inputs, causal bands of
either alignment, sliding windows, bool and additive masks of every broadcast shape, ALiBi, seqlens_k,
dropout, the softmax scale, dO's layout, and forced launch configs with every code-structure switch
(split-KV, GQA packing, TMA, atomic dQ, head-dim split, dQ beside dK/dV) or the dispatcher's own pick.

    FATUNE_RANDOM_CALLS=200 pytest tests/test_random_calls.py   # more cases (default 6)
    FATUNE_RANDOM_SEED=1234 pytest tests/test_random_calls.py   # repeat a run (the seed is in each failure)
    FATUNE_RANDOM_DTYPES=float16,float32 pytest ...             # also float32

Drawn in float16 and bfloat16. float32's errors on these
tiny problems are a few ulps, where the rule's 2x is a coin flip: fatune's error is at median 0.8-1.0x
PyTorch's, but over 10% of drawn calls have one gradient past 2x, and PyTorch's own float32 implementations
(plain ops and SDPA) break the rule against each other on 3% of such calls (TESTING.md). float32 keeps its
fixed cases in the other modules.
"""

from __future__ import annotations

import os
import random
from dataclasses import dataclass, field

import pytest
import torch

import fatune
from fatune import LaunchConfig
from fatune.call import check_inputs
from fatune.kernel.spec import KERNELS
from fatune.kernel.triton import dropout
from fatune.kernel.triton.heuristics import INTERPRETER_CONFIG
from fatune.tuning.space import infeasible
from tests.conftest import DEVICE, HAS_GPU
from tests.reference import random_qkv, run_and_compare

CASES = int(os.environ.get("FATUNE_RANDOM_CALLS", "6"))
SEED = int(os.environ.get("FATUNE_RANDOM_SEED", str(random.SystemRandom().randrange(2**31))))
DTYPES = [getattr(torch, name) for name in
          os.environ.get("FATUNE_RANDOM_DTYPES", "float16,bfloat16").split(",")]


@dataclass
class RandomCall:
    """One drawn call: fatune.attention(q, k, v, **kwargs), and what the reference needs beside it."""

    seed: int
    q: torch.Tensor
    k: torch.Tensor
    v: torch.Tensor
    kwargs: dict = field(default_factory=dict)
    grad_layout: str = "dense"
    dropout_keep: torch.Tensor | None = None
    dropout_seed: int | None = None
    about: list[str] = field(default_factory=list)

    def __str__(self) -> str:
        return f"FATUNE_RANDOM_SEED={self.seed}: " + ", ".join(self.about)


def _head_dims(rng: random.Random) -> tuple[int, int]:
    if rng.random() < 0.15:  # the large head dims, on short sequences
        d = rng.choice([rng.randint(129, 256), 256, 192])
    else:
        d = rng.choice([rng.randint(1, 80), 16, 32, 64, rng.randint(1, 24)])
    dv = d if rng.random() < 0.7 else rng.randint(1, min(256, max(2 * d, 8)))
    return d, dv


def _lengths(rng: random.Random, large_head_dim: bool) -> tuple[int, int]:
    top = 40 if large_head_dim else 90
    lq = rng.choice([1, rng.randint(1, 16), rng.randint(1, top)])
    lk = rng.choice([lq, rng.randint(0, top), rng.randint(1, top)])
    return lq, lk


def _config(rng: random.Random, group: int, spec):
    """None (the dispatcher's pick) or a forced config with random tiles and structure switches (on a GPU,
    one whose kernels fit its shared memory: a config that cannot launch is the user's error, not a result)."""
    if rng.random() < 0.4:
        return None

    def tiles():
        return {"block_m": rng.choice([16, 32, 64]), "block_n": rng.choice([16, 32, 64]), "num_warps": 4,
                "num_stages": rng.choice([1, 2])}

    fwd = LaunchConfig(**tiles(), num_splits=rng.choice([0, 1, 1, 2, 3, 5]),
                       pack_gqa=int(group > 1 and rng.random() < 0.5), tma=rng.choice([0, 1]))
    dkdv = LaunchConfig(**tiles(), atomic_dq=rng.choice([0, 0, 1, 2]), tma=rng.choice([0, 1]),
                        split_d=rng.choice([1, 1, 2]))
    dq = LaunchConfig(**tiles(), concurrent=rng.choice([0, 0, 1, 2]))
    config = INTERPRETER_CONFIG.replace(fwd=fwd, dkdv=dkdv, dq=dq)
    if HAS_GPU:
        limit = torch.cuda.get_device_properties(0).shared_memory_per_block_optin
        arch = torch.cuda.get_device_capability()
        if any(infeasible(kernel, spec, getattr(config, kernel), limit, arch) for kernel in KERNELS):
            return None
    return config


def draw(seed: int) -> RandomCall:
    """A random valid call of fatune.attention on DEVICE."""
    rng = random.Random(seed)
    torch.manual_seed(seed)
    dtype = rng.choice(DTYPES)
    d, dv = _head_dims(rng)
    kv_heads = rng.randint(1, 3)
    group = rng.choice([1, 1, 2, 3, 4])
    heads = kv_heads * group
    call = RandomCall(seed, None, None, None)  # type: ignore[arg-type]
    kwargs = call.kwargs
    about = call.about
    about.append(f"{str(dtype).removeprefix('torch.')} H={heads}/{kv_heads} d={d} dv={dv}")
    if group > 1:
        kwargs["enable_gqa"] = True
    packed = rng.random() < 0.2
    if packed:
        batch = rng.randint(1, 4)
        lengths_q = [rng.choice([0, 1, rng.randint(1, 50)]) for _ in range(batch)]
        lengths_k = [rng.choice([n, rng.randint(0, 60)]) for n in lengths_q]
        if sum(lengths_q) == 0 or sum(lengths_k) == 0:
            lengths_q[0], lengths_k[0] = max(lengths_q[0], 1), max(lengths_k[0], 1)
        call.q = torch.randn(sum(lengths_q), heads, d, dtype=dtype, device=DEVICE).requires_grad_()
        call.k = torch.randn(sum(lengths_k), kv_heads, d, dtype=dtype, device=DEVICE).requires_grad_()
        call.v = torch.randn(sum(lengths_k), kv_heads, dv, dtype=dtype, device=DEVICE).requires_grad_()

        def cu(lengths):
            return torch.tensor([0] + list(torch.tensor(lengths).cumsum(0)), dtype=torch.int32, device=DEVICE)

        kwargs.update(cu_seqlens_q=cu(lengths_q), cu_seqlens_k=cu(lengths_k))
        if rng.random() < 0.5:  # given, or read from cu_seqlens
            kwargs.update(max_seqlen_q=max(lengths_q) + rng.choice([0, 0, 3]), max_seqlen_k=max(lengths_k))
        about.append(f"packed q {lengths_q} k {lengths_k}")
        seqlen_q, seqlen_k = max(lengths_q), max(lengths_k)
    else:
        batch = rng.randint(1, 3)
        seqlen_q, seqlen_k = _lengths(rng, d > 128)
        layout = rng.choice(["bhld", "bhld", "blhd", "strided"])
        call.q, call.k, call.v = random_qkv(batch, heads, kv_heads, seqlen_q, seqlen_k, d, dv, dtype, DEVICE, layout)
        about.append(f"B={batch} Lq={seqlen_q} Lk={seqlen_k} {layout}")

    band = rng.random()
    if band < 0.35:
        kwargs["is_causal"] = True
    if 0.2 < band < 0.55:
        kwargs["window_size"] = (rng.choice([-1, 0, rng.randint(0, 40)]), rng.choice([-1, 0, rng.randint(0, 40)]))
    if band < 0.55 and rng.random() < 0.5:
        kwargs["causal_alignment"] = rng.choice(["top_left", "bottom_right"])
    if not packed and rng.random() < 0.3:
        shape = rng.choice([(batch, heads, seqlen_q, seqlen_k), (batch, 1, 1, seqlen_k), (seqlen_q, seqlen_k),
                            (1, heads, seqlen_q, seqlen_k), (batch, 1, seqlen_q, 1), (seqlen_k,)])
        if rng.random() < 0.5:
            kwargs["attn_mask"] = torch.rand(shape, device=DEVICE) < 0.75
        else:
            mask_dtype = rng.choice([torch.float32, dtype])
            additive = torch.randn(shape, device=DEVICE, dtype=mask_dtype)
            additive = additive.masked_fill(torch.rand(shape, device=DEVICE) < 0.15, float("-inf"))
            if rng.random() < 0.5:  # padding at the dtype's lowest finite value, as Hugging Face's masks hold
                additive = additive.masked_fill(torch.rand(shape, device=DEVICE) < 0.15, torch.finfo(mask_dtype).min)
            kwargs["attn_mask"] = additive
        about.append(f"attn_mask {kwargs['attn_mask'].dtype} {tuple(shape)}")
    if rng.random() < 0.2:
        kwargs["alibi_slopes"] = torch.rand(rng.choice([(heads,), (batch, heads)]), device=DEVICE) * 0.5
    if not packed and rng.random() < 0.25:
        kwargs["seqlens_k"] = torch.tensor([rng.randint(0, seqlen_k) for _ in range(batch)], dtype=torch.int32,
                                           device=DEVICE)
        about.append(f"seqlens_k {kwargs['seqlens_k'].tolist()}")
    if rng.random() < 0.3:
        kwargs["scale"] = rng.uniform(0.05, 1.5)
    if rng.random() < 0.15:
        p = rng.choice([0.1, 0.3])
        kwargs["dropout_p"] = p
        call.dropout_seed = rng.randrange(2**40)
        call.dropout_keep = dropout.keep_mask(call.dropout_seed, p, batch, heads, seqlen_q, seqlen_k, DEVICE)
    call.grad_layout = "dense" if packed else rng.choice(["dense", "dense", "transposed", "every-other-lane"])
    config = _config(rng, group, check_inputs(call.q, call.k, call.v, **kwargs).spec)
    if config is not None:
        kwargs["config"] = config
    about.append(", ".join(f"{key}={value}" for key, value in sorted(kwargs.items())
                           if key in ("is_causal", "window_size", "causal_alignment", "scale", "dropout_p",
                                      "enable_gqa", "config"))
                 + (" alibi" if "alibi_slopes" in kwargs else "") + f" dO {call.grad_layout}")
    return call


def check_random_call(seed: int, monkeypatch: pytest.MonkeyPatch) -> None:
    call = draw(seed)
    if call.dropout_seed is not None:
        monkeypatch.setattr(dropout, "draw_seed", lambda device: torch.tensor([call.dropout_seed], device=device))
    try:
        run_and_compare(call.q, call.k, call.v, grad_layout=call.grad_layout, dropout_keep=call.dropout_keep,
                        **call.kwargs)
    except Exception as error:
        raise AssertionError(f"{call}\n{type(error).__name__}: {error}") from error


@pytest.mark.parametrize("index", range(CASES))
def test_random_call_matches_reference(index, monkeypatch, poison_outputs):
    check_random_call(SEED + index, monkeypatch)


@pytest.mark.gpu
@pytest.mark.parametrize("index", range(48))
def test_gpu_random_call_matches_reference(index, monkeypatch, poison_outputs):
    """48 more drawn calls in float16 and bfloat16, compiled (each compiles kernels of its own)."""
    check_random_call(SEED + CASES + index, monkeypatch)


def paged_draw(seed: int) -> tuple[RandomCall, dict]:
    """The first drawn call from `seed` on that a paged cache can serve (not packed, no dropout: inference), and
    its paging: a random page size dividing L_k, pages in random order among NaN spare pages, either layout."""
    from tests.test_paged import scatter_pages

    while True:
        call = draw(seed)
        if "cu_seqlens_q" not in call.kwargs and "dropout_p" not in call.kwargs:
            break
        seed += 1_000_003
    rng = random.Random(seed)
    length = call.k.shape[2]
    page_size = rng.choice([size for size in range(1, max(length, 1) + 1) if length % size == 0] or [1])
    if length == 0:  # no keys: a cache of one spare page, no page per sequence
        page_size = rng.randint(1, 16)
    layout = rng.choice(["bhld", "bshd"])
    k_pages, v_pages, table = scatter_pages(call.k, call.v, page_size, rng, layout)
    call.about.append(f"paged: {table.shape[1]} pages of {page_size} ({layout})")
    return call, {"k_pages": k_pages, "v_pages": v_pages, "block_table": table}


def check_paged_call(seed: int) -> None:
    from fatune.kernel import reference
    from tests.reference import check_close, same_dtype_baselines

    call, paged = paged_draw(seed)
    q, k, v = (t.detach() for t in (call.q, call.k, call.v))
    try:
        with torch.no_grad():
            out = fatune.attention(q, paged["k_pages"], paged["v_pages"], block_table=paged["block_table"],
                                   **call.kwargs)
        problem = check_inputs(q, k, v, **{key: value for key, value in call.kwargs.items() if key != "config"})
        golden = reference.attention(q.double(), k.double(), v.double(), problem, "float64")
        for baseline, implementation in same_dtype_baselines(problem, q).items():
            check_close("out", out, golden, implementation(q, k, v), baseline)
    except Exception as error:
        raise AssertionError(f"{call}\n{type(error).__name__}: {error}") from error


@pytest.mark.parametrize("index", range(max(1, CASES // 2)))
def test_random_paged_call_matches_reference(index, poison_outputs):
    """Drawn calls read through a paged cache: the forward (inference: no gradients) under the accuracy rule
    against the golden of the contiguous call."""
    check_paged_call(SEED + 7919 * (index + 1))


@pytest.mark.gpu
@pytest.mark.parametrize("index", range(24))
def test_gpu_random_paged_call_matches_reference(index, poison_outputs):
    """24 more, compiled, in float16 and bfloat16."""
    check_paged_call(SEED + 7919 * (CASES + index + 1))


def test_draws_cover_the_space(monkeypatch):
    """Many draws reach each feature (a draw that never produces one would test nothing about it). Only what was
    drawn counts here: a dropout draw's keep-mask (an interpreted kernel each) is a stand-in."""
    monkeypatch.setattr(dropout, "keep_mask", lambda *args: torch.ones(1, dtype=torch.bool))
    calls = [draw(seed) for seed in range(300)]
    seen = {
        "packed": any("cu_seqlens_q" in c.kwargs for c in calls),
        "mask": any("attn_mask" in c.kwargs for c in calls),
        "window": any("window_size" in c.kwargs for c in calls),
        "alibi": any("alibi_slopes" in c.kwargs for c in calls),
        "seqlens_k": any("seqlens_k" in c.kwargs for c in calls),
        "dropout": any(c.dropout_keep is not None for c in calls),
        "gqa": any(c.kwargs.get("enable_gqa") for c in calls),
        "forced config": any("config" in c.kwargs for c in calls),
        "dQ beside dK/dV": any(c.kwargs.get("config") is not None and c.kwargs["config"].dq.concurrent
                               and not c.kwargs["config"].dkdv.atomic_dq for c in calls),
        "empty keys": any(c.k.shape[-2 if c.k.dim() == 4 else 0] == 0 for c in calls),
        "d > 128": any(c.q.shape[-1] > 128 for c in calls),
    }
    assert all(seen.values()), [name for name, hit in seen.items() if not hit]
