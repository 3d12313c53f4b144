"""A search's or a benchmark's problem size (Shape): its sizes, mask variant and how to make its inputs.

A Shape is a workload: it says how to make a call (sizes, the fatune.attention arguments of its mask variant,
random inputs); the call's validated form, the one problem type everything keys on, is its `problem`
(fatune.kernel.problem.AttentionProblem). FLOPs count the (query, key) pairs the call keeps.
"""

from __future__ import annotations

import functools
import itertools
import random
from dataclasses import dataclass, replace

import torch

from fatune.call import check_inputs
from fatune.db.keys import CallKey, problem_key
from fatune.kernel.problem import AttentionProblem
from fatune.kernel.spec import DTYPES, KernelSpec


def window_pairs(seqlen_q: int, seqlen_k: int, window: int) -> int:
    """(query, key) pairs a sliding window keeps: query i sees keys i + offset - window .. i + offset, offset =
    Lk - Lq (bottom-right, as fatune.attention aligns a window), cut to 0 .. Lk - 1."""
    def capped_sum(a: int, b: int) -> int:  # sum of min(t, window) + 1 for t in a .. b
        if b < a:
            return 0
        below = min(b, window)
        total = (a + below) * (below - a + 1) // 2 if below >= a else 0
        return total + window * max(0, b - max(a, window + 1) + 1) + (b - a + 1)

    offset = seqlen_k - seqlen_q
    return capped_sum(max(offset, 0), seqlen_k - 1)


def bottom_right_causal_pairs(seqlen_q: int, seqlen_k: int) -> int:
    """(query, key) pairs of a causal mask aligned bottom-right: query i sees keys 0 .. i + Lk - Lq (none when
    that is negative), cut to Lk - 1: a chunk of new queries at the end of a longer cache."""
    if seqlen_q <= seqlen_k:
        return seqlen_q * (seqlen_k - seqlen_q) + seqlen_q * (seqlen_q + 1) // 2
    return seqlen_k * (seqlen_k + 1) // 2


def top_left_causal_pairs(seqlen_q: int, seqlen_k: int) -> int:
    """(query, key) pairs of a causal mask aligned top-left: query i sees keys 0 .. min(i, Lk - 1)."""
    if seqlen_q <= seqlen_k:
        return seqlen_q * (seqlen_q + 1) // 2
    return seqlen_k * (seqlen_k + 1) // 2 + (seqlen_q - seqlen_k) * seqlen_k


@dataclass(frozen=True)
class Shape:
    """One attention problem size."""

    batch: int
    heads: int
    seqlen_q: int
    seqlen_k: int
    head_dim: int
    dtype: str
    causal: bool = False
    kv_heads: int = 0  # 0: same as heads
    head_dim_v: int = 0  # 0: same as head_dim
    window: int = -1  # >= 0: causal sliding window, keys i + o - window .. i + o, o = Lk - Lq (flash-attn's (window, 0))
    valid_keys: float = 1.0  # < 1: key padding, each sequence keeps this fraction of its keys (seqlens_k)
    # > 0: the batch's batch * seqlen_q tokens packed into one (tokens, H, D) tensor as this many documents of
    # unequal lengths (cu_seqlens_q = cu_seqlens_k; self-attention, seqlen_q == seqlen_k)
    documents: int = 0
    # causal aligned to the end of the keys (causal_alignment="bottom_right"): query i sees keys up to
    # i + Lk - Lq, as a chunk of new queries attends to a longer KV cache; False: top-left, torch SDPA's is_causal
    bottom_right: bool = False

    def __post_init__(self) -> None:
        object.__setattr__(self, "kv_heads", self.kv_heads or self.heads)
        object.__setattr__(self, "head_dim_v", self.head_dim_v or self.head_dim)
        if self.documents and (self.seqlen_q != self.seqlen_k or not 0 < self.documents <= self.tokens):
            raise ValueError(f"documents: expected 1..{self.tokens} packed documents of self-attention "
                             f"(seqlen_q == seqlen_k), got {self.documents} for lq{self.seqlen_q} lk{self.seqlen_k}")

    @property
    def kept_keys(self) -> int:
        """Keys each sequence keeps: L_k, or its valid_keys fraction (at least one) when padded."""
        return max(1, int(self.seqlen_k * self.valid_keys)) if self.valid_keys < 1.0 else self.seqlen_k

    @property
    def tokens(self) -> int:
        return self.batch * self.seqlen_q

    def document_lengths(self) -> list[int]:
        """The packed documents' lengths: a fixed pseudo-random cut of the tokens (the same for every run)."""
        cuts = sorted(random.Random(self.documents * 1_000_003 + self.tokens).sample(range(1, self.tokens),
                                                                                     self.documents - 1))
        return [end - start for start, end in zip([0, *cuts], [*cuts, self.tokens])]

    def key_lengths(self) -> tuple[int, int]:
        """The lengths that size the kernels' grid and the tuned-DB key: the longest document when packed."""
        if self.documents:
            longest = max(self.document_lengths())
            return longest, longest
        return self.seqlen_q, self.seqlen_k


    def input_sizes(self) -> dict[str, tuple[int, ...]]:
        """q, k, v and dO sizes: (B, H, L, D), or (tokens, H, D) when packed."""
        def size(heads: int, length: int, dim: int) -> tuple[int, ...]:
            return (self.tokens, heads, dim) if self.documents else (self.batch, heads, length, dim)

        return {"q": size(self.heads, self.seqlen_q, self.head_dim), "k": size(self.kv_heads, self.seqlen_k, self.head_dim),
                "v": size(self.kv_heads, self.seqlen_k, self.head_dim_v),
                "do": size(self.heads, self.seqlen_q, self.head_dim_v)}

    def attention_kwargs(self, device: torch.device | str) -> dict:
        """The fatune.attention keyword arguments that describe this shape's mask variant."""
        kwargs: dict = {"is_causal": self.causal, "enable_gqa": self.kv_heads != self.heads}
        if self.bottom_right and self.causal:
            kwargs["causal_alignment"] = "bottom_right"
        if self.window >= 0:
            kwargs["window_size"] = (self.window, 0)
        if self.valid_keys < 1.0:
            kwargs["seqlens_k"] = torch.full((self.batch,), self.kept_keys,
                                             dtype=torch.int32, device=device)
        if self.documents:
            offsets = torch.tensor([0, *itertools.accumulate(self.document_lengths())], dtype=torch.int32,
                                   device=device)
            longest, _ = self.key_lengths()
            kwargs.update(cu_seqlens_q=offsets, cu_seqlens_k=offsets, max_seqlen_q=longest, max_seqlen_k=longest)
        return kwargs

    @functools.cached_property
    def problem(self) -> AttentionProblem:
        """The problem fatune.attention makes of this shape's call (checked on stand-in tensors of its sizes):
        what its tuned-DB key, kernel spec and heuristic come from."""

        def stand_in(*shape):  # the right sizes and dtype, one element of memory
            return torch.empty((), dtype=DTYPES[self.dtype]).expand(*shape)

        sizes = self.input_sizes()
        return check_inputs(stand_in(*sizes["q"]), stand_in(*sizes["k"]), stand_in(*sizes["v"]),
                            **self.attention_kwargs("cpu"))

    @property
    def spec(self) -> KernelSpec:
        """The kernel spec fatune.attention derives for this shape."""
        return self.problem.spec

    def with_(self, **changes) -> Shape:
        return replace(self, **changes)

    def flops(self, passes: str = "fwd+bwd") -> float:
        """4 B H Lq Lk D forward (halved when causal), counting the (query, key) pairs the call keeps when a
        window, key padding or a bottom-right causal mask cuts them; backward 2.5x forward; fwd+bwd 3.5x."""
        if self.documents:
            lengths = [(n, n) for n in self.document_lengths()]
        else:
            lengths = [(self.seqlen_q, self.kept_keys)] * self.batch
        if self.window >= 0:  # bottom-right to the kept keys: i + (kept - Lq) - window .. i + (kept - Lq)
            pairs = sum(window_pairs(lq, lk, self.window) for lq, lk in lengths)
        elif self.causal and self.bottom_right:  # row i sees keys 0 .. i + kept - Lq
            pairs = sum(bottom_right_causal_pairs(lq, lk) for lq, lk in lengths)
        elif self.causal and self.valid_keys < 1:  # top-left: row i sees keys 0 .. min(i, kept - 1)
            pairs = sum(top_left_causal_pairs(lq, lk) for lq, lk in lengths)
        else:
            pairs = sum(lq * lk for lq, lk in lengths) * (0.5 if self.causal else 1.0)
        forward = 2.0 * pairs * self.heads * (self.head_dim + self.head_dim_v)
        return forward * {"fwd": 1.0, "bwd": 2.5, "fwd+bwd": 3.5}[passes]

    def cache_bytes(self) -> int:
        """Bytes of K and V: what a forward must read from memory at least (a decode step's floor)."""
        keys = self.tokens if self.documents else self.batch * self.seqlen_k
        element = torch.finfo(DTYPES[self.dtype]).bits // 8
        return keys * self.kv_heads * (self.head_dim + self.head_dim_v) * element

    def label(self) -> str:
        gqa = f" hkv{self.kv_heads}" if self.kv_heads != self.heads else ""
        mask = (" causal" if self.causal else "") + (" bottom-right" if self.causal and self.bottom_right else "")
        mask += f" window{self.window}" if self.window >= 0 else ""
        mask += f" keys{self.valid_keys:.0%}" if self.valid_keys < 1 else ""
        mask += f" docs{self.documents}" if self.documents else ""
        return f"{self.dtype} b{self.batch} h{self.heads}{gqa} lq{self.seqlen_q} lk{self.seqlen_k} d{self.head_dim}{mask}"


def make_inputs(shape: Shape, device: str | torch.device, seed: int = 0) -> dict[str, torch.Tensor]:
    """Random q, k, v (requiring grad) and dO for `shape`, drawn from a seeded generator."""
    generator = torch.Generator(device=device).manual_seed(seed)
    dtype = DTYPES[shape.dtype]

    def randn(*size):
        return torch.randn(*size, generator=generator, device=device, dtype=torch.float32).to(dtype)

    sizes = shape.input_sizes()
    inputs = {name: randn(*sizes[name]) for name in ("q", "k", "v", "do")}
    for name in ("q", "k", "v"):
        inputs[name].requires_grad_()
    return inputs


def shape_key(shape: Shape) -> CallKey:
    """The tuned-DB key of `shape`'s call (fatune.db.keys.problem_key of its problem)."""
    return problem_key(shape.problem)
