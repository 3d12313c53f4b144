"""fatune.attention forward and gradients against a float64 golden (accuracy rule in reference.py).

CPU cases run the real generated kernels in Triton's interpreter; `gpu` cases run them
compiled on a CUDA GPU, in bf16 and fp16, at larger sizes.
"""

from __future__ import annotations

import math

import pytest
import torch

import fatune
from fatune import AttentionConfig, LaunchConfig
from tests.conftest import DEVICE
from tests.reference import random_qkv, run_and_compare, stable_seed

# (batch, heads, kv_heads, seqlen_q, seqlen_k, head_dim, head_dim_v)
CPU_SHAPES = [
    (1, 2, 2, 1, 1, 16, 16),
    (2, 3, 3, 17, 17, 32, 32),
    (1, 2, 2, 100, 257, 64, 64),
    (1, 1, 1, 257, 100, 16, 16),
    (1, 2, 2, 33, 129, 128, 128),
    (2, 1, 1, 64, 64, 64, 64),
]
# bfloat16 runs in the interpreter through fatune's patch of its tl.dot (codegen.patch_interpreter)
CPU_DTYPES = [torch.float16, torch.bfloat16, torch.float32]


@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize("dtype", CPU_DTYPES, ids=str)
@pytest.mark.parametrize("shape", CPU_SHAPES, ids=lambda s: "x".join(map(str, s)))
def test_matches_reference(shape, dtype, causal, poison_outputs):
    torch.manual_seed(stable_seed(shape, dtype, causal))
    q, k, v = random_qkv(*shape, dtype=dtype, device=DEVICE)
    run_and_compare(q, k, v, is_causal=causal)


# Tile shapes the interpreter default does not use: BLOCK_M < BLOCK_N in the forward,
# BLOCK_M > BLOCK_N in dK/dV, square dQ tiles, so every loop-bound formula is exercised.
OTHER_CONFIGS = [
    AttentionConfig(fwd=LaunchConfig(16, 64), dkdv=LaunchConfig(64, 16), dq=LaunchConfig(32, 32)),
    AttentionConfig(fwd=LaunchConfig(64, 64), dkdv=LaunchConfig(32, 32), dq=LaunchConfig(16, 64)),
]


@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize("config", OTHER_CONFIGS, ids=lambda c: f"{c.fwd}-{c.dkdv}-{c.dq}")
@pytest.mark.parametrize("seqlens", [(77, 77), (45, 130), (130, 45)], ids=str)
def test_tile_shapes(seqlens, config, causal, poison_outputs):
    torch.manual_seed(7)
    q, k, v = random_qkv(2, 2, 2, *seqlens, 32, 32, dtype=torch.float16, device=DEVICE)
    run_and_compare(q, k, v, is_causal=causal, config=config)


# A band's masked tiles split dS into hi + lo only where some row sees at most EXACT_DELTA_KEYS keys (spec's
# SPLIT_DS_COUNTED): here rows see up to 330 keys, so diagonal and left-edge tiles past the first rows keep one product.
@pytest.mark.parametrize("lengths, mask, atomic", [
    ((300, 300), {"is_causal": True}, 0),
    ((300, 300), {"window_size": (150, 0)}, 1),
    ((170, 330), {"window_size": (150, 40)}, 0),
    ((330, 170), {"is_causal": True}, 1),
], ids=["causal", "window-atomic-dq", "window-both-sides", "causal-more-queries-atomic-dq"])
def test_band_rows_that_see_many_keys(lengths, mask, atomic, poison_outputs):
    torch.manual_seed(stable_seed(lengths, atomic))
    q, k, v = random_qkv(1, 2, 2, *lengths, 64, 64, dtype=torch.float16, device=DEVICE)
    tile = LaunchConfig(32, 32, 4, 1)
    config = AttentionConfig(fwd=tile, dkdv=LaunchConfig(32, 32, 4, 1, atomic_dq=atomic), dq=tile)
    run_and_compare(q, k, v, config=config, **mask)


@pytest.mark.parametrize("layout", ["blhd", "strided"])
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
def test_any_strides(layout, causal, poison_outputs):
    torch.manual_seed(11)
    q, k, v = random_qkv(2, 3, 3, 50, 70, 32, 32, dtype=torch.float16, device=DEVICE, layout=layout)
    run_and_compare(q, k, v, is_causal=causal, grad_layout="transposed")


def test_output_and_grads_keep_input_layout():
    q, k, v = random_qkv(2, 3, 3, 20, 20, 16, 16, dtype=torch.float32, device=DEVICE, layout="blhd")
    out = fatune.attention(q, k, v)
    assert out.stride() == q.stride()
    out.sum().backward()
    assert q.grad.stride() == q.stride() and k.grad.stride() == k.stride()


@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
def test_scale_and_value_head_dim(causal, poison_outputs):
    torch.manual_seed(3)
    q, k, v = random_qkv(1, 2, 2, 40, 61, 32, 64, dtype=torch.float16, device=DEVICE)
    run_and_compare(q, k, v, is_causal=causal, scale=0.3)


@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
def test_grouped_query_attention(causal, poison_outputs):
    torch.manual_seed(5)
    q, k, v = random_qkv(2, 4, 2, 37, 53, 32, 32, dtype=torch.float16, device=DEVICE)
    run_and_compare(q, k, v, is_causal=causal, enable_gqa=True)


def test_padded_head_dim(poison_outputs):
    torch.manual_seed(9)
    q, k, v = random_qkv(1, 2, 2, 45, 45, 40, 24, dtype=torch.float16, device=DEVICE)
    run_and_compare(q, k, v, is_causal=True)


@pytest.mark.parametrize("kwargs", [{"is_causal": True}, {"attn_mask": "bool"}, {"dropout_p": 0.3}],
                         ids=["causal", "mask", "dropout"])
def test_torch_func_grad_and_vjp_match_autograd(kwargs, poison_outputs):
    """torch.func.grad and vjp run the same kernels as autograd (bit for bit, dropout's mask drawn alike)."""
    torch.manual_seed(3)
    q, k, v = random_qkv(1, 2, 2, 29, 40, 16, 16, dtype=torch.float32, device=DEVICE)
    if kwargs.get("attn_mask") == "bool":
        kwargs = {"attn_mask": torch.rand(1, 1, 29, 40, device=DEVICE) < 0.7}
    weight = torch.randn(1, 2, 29, 16, device=DEVICE)

    def loss(q_, k_, v_):
        return (fatune.attention(q_, k_, v_, **kwargs) * weight).sum()

    torch.manual_seed(4)
    expected = torch.autograd.grad(loss(q, k, v), (q, k, v))
    torch.manual_seed(4)
    got = torch.func.grad(loss, argnums=(0, 1, 2))(*(t.detach() for t in (q, k, v)))
    torch.manual_seed(4)
    out, vjp = torch.func.vjp(lambda q_, k_, v_: fatune.attention(q_, k_, v_, **kwargs), *(t.detach() for t in (q, k, v)))
    for name, want, by_grad, by_vjp in zip("qkv", expected, got, vjp(weight)):
        assert torch.equal(by_grad, want), name
        assert torch.equal(by_vjp, want), name


@pytest.mark.parametrize("transform, message", [
    (lambda f, q: torch.func.vmap(f)(q.unsqueeze(0).expand(3, -1, -1, -1, -1)), "vmap"),
    (lambda f, q: torch.func.jacrev(f)(q), "vmap"),
    (lambda f, q: torch.func.grad(lambda x: torch.func.grad(lambda y: f(y).square().sum())(x).sum())(q),
     "double backward"),
], ids=["vmap", "jacrev", "grad-of-grad"])
def test_torch_func_transforms_fatune_cannot_serve_say_so(transform, message):
    q, k, v = random_qkv(1, 1, 1, 8, 8, 16, 16, dtype=torch.float32, device=DEVICE)
    with pytest.raises((NotImplementedError, RuntimeError), match=message) as error:
        transform(lambda x: fatune.attention(x, k.detach(), v.detach()), q.detach())
    assert "fatune.attention" in str(error.value)


def test_same_kernel_is_deterministic():
    q, k, v = random_qkv(1, 2, 2, 64, 64, 32, 32, dtype=torch.float16, device=DEVICE)
    first = fatune.attention(q, k, v, is_causal=True)
    second = fatune.attention(q, k, v, is_causal=True)
    assert torch.equal(first, second)


@pytest.mark.parametrize("splits", [1, 3], ids=["one-pass", "split-kv"])
@pytest.mark.parametrize("dtype", CPU_DTYPES, ids=str)
def test_forward_stores_the_lse_in_log2_units(dtype, splits):
    """The per-row LSE the backward recomputes P = exp2(S log2(e) - LSE) from: log2 of the row's sum of
    2^(S log2(e)), so a row's only key gets P = 1 exactly; float64 for float32 inputs (at |LSE| ~ 40 a float32
    LSE rounds by 4e-6, as much as S itself), float32 for 16-bit inputs; -inf for a row that sees no key."""
    from fatune.runtime import plans

    torch.manual_seed(stable_seed("lse", dtype, splits))
    q, k, v = random_qkv(1, 2, 2, 37, 53, 32, 32, dtype=dtype, device=DEVICE)
    keep = torch.rand(1, 2, 37, 53, device=DEVICE) < 0.7
    keep[0, 1, 5] = False
    tiles = LaunchConfig(16, 16, 4, 1)
    config = AttentionConfig(LaunchConfig(16, 16, 4, 1, num_splits=splits), tiles, tiles)
    call = plans.Call(attn_mask=keep, scale=2.0)
    plan = plans.prepare(q, k, v, call, config, True).plan
    _, lse = plan.forward(q.detach(), k.detach(), v.detach(), call.extras)
    scores = (q.double() @ k.double().transpose(-1, -2) * 2.0).masked_fill(~keep, float("-inf"))
    expected = scores.logsumexp(-1) / math.log(2.0)
    assert lse.dtype == (torch.float64 if dtype == torch.float32 else torch.float32)
    assert lse[0, 1, 5] == float("-inf")
    seen = expected.isfinite()
    assert torch.allclose(lse.double()[seen], expected[seen], rtol=0, atol=1e-4)


@pytest.mark.parametrize("atomic", [0, 1], ids=["dq-kernel", "atomic-dq"])
@pytest.mark.parametrize("window", [None, (100, 0)], ids=["causal", "window"])
def test_delta_is_summed_from_p_dp_where_rows_see_few_keys(window, atomic):
    """Delta = rowsum(dO O) from the 16-bit O carries O's rounding into dQ; dQ tiles whose rows see at
    most EXACT_DELTA_KEYS keys sum P dP instead (to float32 rounding), the other tiles keep rowsum(dO O).
    The dQ kernel does it, or with atomic dQ the pass before the dK/dV kernel."""
    from fatune.kernel.triton.launch import Plan
    from fatune.runtime import plans

    torch.manual_seed(4)
    length, tile = 200, 32
    q, k, v = random_qkv(1, 1, 1, length, length, 32, 32, dtype=torch.float16, device=DEVICE)
    grad_out = torch.randn(1, 1, length, 32, dtype=torch.float16, device=DEVICE)
    config = AttentionConfig(fwd=LaunchConfig(tile, tile, 4, 1), dkdv=LaunchConfig(tile, tile, 4, 1, atomic_dq=atomic),
                             dq=LaunchConfig(tile, tile, 4, 1))
    call = plans.Call(is_causal=window is None, window_size=window or (-1, -1))
    plan = plans.prepare(q, k, v, call, config, True).plan
    assert plan.adds_dq_atomically() == bool(atomic)
    out, lse = plan.forward(q.detach(), k.detach(), v.detach())
    captured = []
    allocate = Plan.allocate_backward

    def capture(self, *args, **kwargs):
        captured.append(allocate(self, *args, **kwargs))
        return captured[-1]

    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(Plan, "allocate_backward", capture)
        plan.backward(grad_out, q.detach(), k.detach(), v.detach(), out, lse)
    delta = captured[0][0].reshape(length).double()

    rows, cols = torch.arange(length)[:, None], torch.arange(length)[None, :]
    visible = cols <= rows if window is None else (cols <= rows) & (cols >= rows - window[0])
    scores = (q[0, 0].double() @ k[0, 0].double().T) * 32 ** -0.5
    p = scores.masked_fill(~visible, float("-inf")).softmax(-1)
    exact = (p * (grad_out[0, 0].double() @ v[0, 0].double().T)).sum(-1)
    from_o = (grad_out[0, 0].double() * out[0, 0].double()).sum(-1)
    exact_rows = torch.zeros(length, dtype=torch.bool)
    for start in range(0, length, tile):  # a dQ tile's key range: from its first row's left edge to its last row
        first = 0 if window is None else max(start - window[0], 0) // tile * tile
        if min(start + tile, length) - first <= 128:
            exact_rows[start:start + tile] = True
    assert exact_rows.any() and not exact_rows.all()
    assert torch.allclose(delta[exact_rows], exact[exact_rows], rtol=1e-5, atol=1e-5)
    assert torch.allclose(delta[~exact_rows], from_o[~exact_rows], rtol=1e-5, atol=1e-5)
    assert not torch.allclose(from_o[exact_rows], exact[exact_rows], rtol=1e-5, atol=1e-5)  # the test can tell them apart


# ---------------------------------------------------------------- GPU (pytest -m gpu)

GPU_SHAPES = [
    (2, 8, 8, 1, 1, 64, 64),
    (2, 8, 8, 17, 17, 64, 64),
    (2, 8, 8, 257, 257, 128, 128),
    (2, 8, 8, 1000, 1000, 64, 64),
    (2, 8, 8, 1000, 1000, 128, 128),
    (2, 8, 8, 4096, 4096, 64, 64),
    (2, 8, 8, 4096, 4096, 128, 128),
    (2, 8, 8, 113, 2048, 64, 64),
    (2, 8, 8, 2048, 113, 128, 128),
    (1, 4, 4, 1023, 1025, 16, 16),
    (1, 4, 4, 1023, 1025, 32, 32),
]


@pytest.mark.gpu
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=str)
@pytest.mark.parametrize("shape", GPU_SHAPES, ids=lambda s: "x".join(map(str, s)))
def test_gpu_matches_reference(shape, dtype, causal, poison_outputs, record_gpu_errors):
    torch.manual_seed(stable_seed(shape, dtype, causal))
    q, k, v = random_qkv(*shape, dtype=dtype, device="cuda")
    record_gpu_errors(run_and_compare(q, k, v, is_causal=causal))


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=str)
@pytest.mark.parametrize("shape", [(1, 3, 1, 1, 1, 32, 5), (3, 9, 3, 1, 1, 16, 19), (2, 4, 4, 1, 1, 64, 64),
                                   (2, 4, 2, 1, 70, 16, 16), (2, 4, 2, 70, 1, 16, 16), (1, 2, 2, 2, 1, 128, 128)],
                         ids=lambda s: "x".join(map(str, s)))
def test_gpu_one_query_or_one_key(shape, dtype, poison_outputs, record_gpu_errors):
    """Triton specialises a length of 1 into the kernels: ptxas crashed (SIGSEGV) compiling dQ's pipelined key
    loop so specialised at head dims 16-32 (a random call found it). Forward and gradients run anyway."""
    torch.manual_seed(stable_seed(shape, dtype))
    q, k, v = random_qkv(*shape, dtype=dtype, device="cuda")
    record_gpu_errors(run_and_compare(q, k, v, enable_gqa=True))


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=str)
@pytest.mark.parametrize("lengths", [(300, 200), (200, 300)], ids=lambda t: f"{t[0]}x{t[1]}")
@pytest.mark.parametrize("head_dim", [64, 128, 256])
def test_gpu_rows_that_see_one_key_give_exactly_zero_dq_and_dk(head_dim, lengths, dtype, poison_outputs):
    """window_size=(0, 0): a row sees one key (or none), its softmax is exactly 1 and softmax's backward gives dS = 0,
    so dQ and dK are exactly 0 (PyTorch's too). P (dP - Delta) alone left them ~1e-5 off: dP summed in two kernels
    in two orders (random call FATUNE_RANDOM_SEED=1920265862, bf16 d256, dK past the accuracy rule's floor)."""
    import fatune

    torch.manual_seed(stable_seed(head_dim, lengths, dtype))
    q, k, v = random_qkv(2, 6, 2, *lengths, head_dim, head_dim, dtype=dtype, device="cuda")
    out = fatune.attention(q, k, v, enable_gqa=True, window_size=(0, 0))
    dq, dk, dv = torch.autograd.grad(out, (q, k, v), torch.randn_like(out))
    assert dq.abs().max().item() == 0.0 and dk.abs().max().item() == 0.0
    assert dv.abs().max().item() > 0.0


@pytest.mark.gpu
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize("shape", [(2, 4, 4, 1000, 777, 64, 64), (1, 4, 2, 300, 300, 128, 128)],
                         ids=lambda s: "x".join(map(str, s)))
def test_gpu_float32(shape, causal, poison_outputs, record_gpu_errors):
    torch.manual_seed(stable_seed(shape, causal))
    q, k, v = random_qkv(*shape, dtype=torch.float32, device="cuda")
    record_gpu_errors(run_and_compare(q, k, v, is_causal=causal, enable_gqa=True))


@pytest.mark.gpu
@pytest.mark.parametrize("layout", ["blhd", "strided"])
def test_gpu_any_strides(layout, poison_outputs, record_gpu_errors):
    torch.manual_seed(13)
    q, k, v = random_qkv(2, 8, 8, 1000, 1000, 64, 64, dtype=torch.bfloat16, device="cuda", layout=layout)
    record_gpu_errors(run_and_compare(q, k, v, is_causal=True, grad_layout="transposed"))


@pytest.mark.serial
@pytest.mark.gpu
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize("head_dim", [64, 128])
def test_gpu_memory_is_linear_in_length(head_dim, causal, monkeypatch, tmp_path):
    """Peak extra memory of forward+backward grows like L (no L x L buffer): within a linear budget at each length
    as the built-in config runs it, and at most ~doubling with L for one fixed config (the built-in config's choice
    of family can change with the grid's size, and with it the constant: the Gluon backward's fp32 dQ sums). No DB:
    fatune's own kernels, not a route to an SDPA backend."""
    from fatune.runtime.dispatch import Dispatcher
    from tests.conftest import use_dispatcher

    use_dispatcher(monkeypatch, Dispatcher(user_db=tmp_path / "none.sqlite", shipped=[]))

    def peak_extra(seqlen: int, config=None) -> int:
        q, k, v = random_qkv(1, 8, 8, seqlen, seqlen, head_dim, head_dim, dtype=torch.bfloat16, device="cuda")
        grad_out = torch.randn_like(q)
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        base = torch.cuda.memory_allocated()
        out = fatune.attention(q, k, v, is_causal=causal, config=config)
        out.backward(grad_out)
        torch.cuda.synchronize()
        return torch.cuda.max_memory_allocated() - base

    sizes = [4096, 8192, 16384]
    io_bytes = [8 * n * head_dim * 2 * 8 for n in sizes]  # out + dq/dk/dv + lse/delta, generously
    for n, io in zip(sizes, io_bytes):
        peak = peak_extra(n)
        assert peak <= io, f"L={n}: peak extra memory {peak} B exceeds linear budget {io} B (an L x L buffer?)"
    q = torch.empty(1, 8, sizes[-1], head_dim, dtype=torch.bfloat16, device="cuda")
    config = fatune.explain(q, q, q, is_causal=causal).decision.config
    peaks = [peak_extra(n, config) for n in sizes]
    assert peaks[2] <= 2.2 * peaks[1] and peaks[1] <= 2.2 * peaks[0], f"peaks {peaks} grow faster than L ({config})"


def test_a_grad_output_past_int32_offsets_is_copied_into_the_outputs_layout(monkeypatch, poison_outputs):
    """dO arrives with the backward, past the input checks: one whose rows lie too far apart for the kernels'
    int32 slice offsets is copied into the output's layout (which fits: the forward checked it), and the
    gradients keep the accuracy rule. The limit is lowered so that a small call crosses it."""
    from fatune import call as inputs
    from fatune.kernel.triton import launch

    torch.manual_seed(5)
    q, k, v = random_qkv(1, 2, 2, 40, 33, 16, 16, dtype=torch.float16, device=DEVICE)
    limit = 40 * 16  # the inputs' and the output's slices reach 39 x 16 + 15; an every-other-lane dO 39 x 32 + 30
    monkeypatch.setattr(inputs, "MAX_SLICE_OFFSET", limit)
    monkeypatch.setattr(launch, "MAX_SLICE_OFFSET", limit)
    copies = []
    new_buffer = launch.new_buffer
    monkeypatch.setattr(launch, "new_buffer", lambda *args: copies.append(tuple(args[0])) or new_buffer(*args))
    run_and_compare(q, k, v, is_causal=True, grad_layout="every-other-lane")
    assert copies.count((1, 2, 40, 16)) == 3  # the output, dQ and the copy of dO
