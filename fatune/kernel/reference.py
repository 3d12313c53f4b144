"""Dense torch implementation of every attention variant fatune supports.

It materialises the (L_q, L_k) score matrix, so it is for small problems only: the CPU
fallback of `fatune.attention` and the reference of the tests. Same semantics as the
kernels, including rows that see no key (output 0, no NaN).

precision:
  "float64"  everything in float64 (the tests' golden)
  "float32"  computed in float32, result cast back to the input dtype (the CPU fallback)
  "plain"    matmuls in the input dtype, softmax in float32, P cast to the input dtype:
             what PyTorch code in that dtype computes (the tests' same-dtype baseline)
"""

from __future__ import annotations

import torch

from fatune.kernel.problem import AttentionProblem


def visible(problem: AttentionProblem, seqlen_q: int, seqlen_k: int, key_limit: torch.Tensor | int,
            device: torch.device) -> torch.Tensor:
    """Bool (..., L_q, L_k): which keys each query row may see (band and key length; no mask tensor)."""
    spec = problem.spec
    rows = torch.arange(seqlen_q, device=device)[:, None]
    cols = torch.arange(seqlen_k, device=device)[None, :]
    limit = torch.as_tensor(key_limit, device=device).reshape(-1, 1, 1, 1)  # per batch
    offset = (limit - seqlen_q) if spec.bottom_right else torch.zeros_like(limit)
    keep = cols < limit
    if spec.causal or spec.window_right:
        keep = keep & (cols <= rows + offset + problem.window_right)
    if spec.window_left:
        keep = keep & (cols >= rows + offset - problem.window_left)
    return keep


def alibi_bias(problem: AttentionProblem, slopes: torch.Tensor, seqlen_q: int, seqlen_k: int,
               key_limit: torch.Tensor | int) -> torch.Tensor:
    """(B, H, L_q, L_k) bias -slope * |i + offset - j|."""
    device = slopes.device
    rows = torch.arange(seqlen_q, device=device)[:, None]
    cols = torch.arange(seqlen_k, device=device)[None, :]
    limit = torch.as_tensor(key_limit, device=device).reshape(-1, 1, 1, 1)
    offset = (limit - seqlen_q) if problem.spec.bottom_right else torch.zeros_like(limit)
    return -slopes[:, :, None, None].double() * (rows + offset - cols).abs()


def _attend(q, k, v, problem: AttentionProblem, keep, bias, dropout_keep, precision: str) -> torch.Tensor:
    dtype = q.dtype
    compute = {"float64": torch.float64, "float32": torch.float32, "plain": dtype}[precision]
    q, k, v = q.to(compute), k.to(compute), v.to(compute)
    group = q.shape[1] // k.shape[1]
    if group > 1:
        k, v = k.repeat_interleave(group, dim=1), v.repeat_interleave(group, dim=1)
    scores = torch.matmul(q * problem.scale, k.transpose(-2, -1))
    scores = scores.double() if precision == "float64" else scores.float()
    if bias is not None:
        scores = scores + bias.to(scores.dtype)
    scores = scores.masked_fill(~keep, float("-inf"))
    # rows with no visible key give 0: softmax a row of zeros instead, so no NaN reaches autograd
    empty = (scores == float("-inf")).all(dim=-1, keepdim=True)
    probs = torch.softmax(scores.masked_fill(empty, 0.0), dim=-1).masked_fill(empty, 0.0)
    if dropout_keep is not None:
        probs = probs * dropout_keep / (1.0 - problem.dropout_p)
    out = torch.matmul(probs.to(compute), v)
    return out if precision == "float64" else out.to(dtype)


def _attend_fixed(q, k, v, problem: AttentionProblem, dropout_keep, precision: str) -> torch.Tensor:
    key_limit = problem.seqlens_k if problem.seqlens_k is not None else q.new_tensor([problem.seqlen_k]).long()
    keep = visible(problem, q.shape[2], k.shape[2], key_limit, q.device)
    if problem.seqlens_k is not None:  # keys past them are never read (a cache's unwritten slots may hold NaN)
        unread = (torch.arange(k.shape[2], device=q.device) >= key_limit.reshape(-1, 1, 1, 1).to(q.device))
        k, v = k.masked_fill(unread.transpose(-2, -1), 0), v.masked_fill(unread.transpose(-2, -1), 0)
    bias = None
    if problem.attn_mask is not None:
        if problem.spec.attn_mask == "bool":
            keep = keep & (problem.attn_mask != 0)
        else:
            bias = problem.attn_mask.double()
    if problem.alibi_slopes is not None:
        alibi = alibi_bias(problem, problem.alibi_slopes, q.shape[2], k.shape[2], key_limit)
        bias = alibi if bias is None else bias + alibi
    return _attend(q, k, v, problem, keep, bias, dropout_keep, precision)


def unpage(cache: torch.Tensor, block_table: torch.Tensor) -> torch.Tensor:
    """A paged cache (pages, H_kv, page size, D) as the (B, H_kv, pages per sequence x page size, D) keys or
    values its block table describes (a copy; table entries clamped to the cache's pages, as the kernels do)."""
    pages = block_table.long().clamp(0, max(cache.shape[0] - 1, 0))
    gathered = cache[pages]  # (B, pages per sequence, H_kv, page size, D)
    batch, per_sequence, heads, size, dim = gathered.shape
    return gathered.permute(0, 2, 1, 3, 4).reshape(batch, heads, per_sequence * size, dim)


def attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, problem: AttentionProblem,
              precision: str = "float64", dropout_keep: torch.Tensor | None = None) -> torch.Tensor:
    """Attention of `problem` on q, k, v ((B, H, L, D), packed (total, H, D), or a paged cache's
    pages with the problem's block table), differentiable.

    dropout_keep: bool (B, H, max L_q, max L_k) mask of kept probabilities (from
    fatune.kernel.triton.dropout.keep_mask), or None for no dropout.
    """
    if problem.block_table is not None:
        k, v = unpage(k, problem.block_table), unpage(v, problem.block_table)
    if not problem.packed:
        return _attend_fixed(q, k, v, problem, dropout_keep, precision)
    outs = []
    cu_q, cu_k = problem.cu_seqlens_q.tolist(), problem.cu_seqlens_k.tolist()
    for b in range(problem.batch):
        qs, ks = slice(cu_q[b], cu_q[b + 1]), slice(cu_k[b], cu_k[b + 1])
        q_b, k_b, v_b = (t[rows].transpose(0, 1).unsqueeze(0) for t, rows in ((q, qs), (k, ks), (v, ks)))
        keep = visible(problem, q_b.shape[2], k_b.shape[2], k_b.shape[2], q.device)
        bias = None
        if problem.alibi_slopes is not None:
            bias = alibi_bias(problem, problem.alibi_slopes[b:b + 1], q_b.shape[2], k_b.shape[2], k_b.shape[2])
        drop = None
        if dropout_keep is not None:
            drop = dropout_keep[b:b + 1, :, : q_b.shape[2], : k_b.shape[2]]
        outs.append(_attend(q_b, k_b, v_b, problem, keep, bias, drop, precision)[0].transpose(0, 1))
    return torch.cat(outs, dim=0)
