"""fatune.attention under torch.compile(fullgraph=True), in CUDA graphs, and as an nn.Module.

The compile tests run in fresh processes: a user compiles before any eager call, so
nothing may rely on caches an eager call would have filled.
"""

from __future__ import annotations

import dataclasses
import inspect
import os
import subprocess
import sys

import pytest
import torch
from torch.utils.flop_counter import FlopCounterMode

import fatune
from fatune.call import ARGUMENTS, Call
from fatune.kernel.spec import AttentionConfig, GluonBackwardConfig, GluonConfig
from fatune.kernel.triton.heuristics import INTERPRETER_CONFIG
from fatune.ops import config_from_list, config_to_list
from tests.conftest import DEVICE, UNCHECKED_PRELUDE

# A fresh process: compile first, then compare forward and gradients with eager.
COMPILE_SCRIPT = """
import sys, torch, fatune

DEVICE, DTYPE, BACKEND, MODE, DYNAMIC = sys.argv[1], getattr(torch, sys.argv[2]), sys.argv[3], sys.argv[4], sys.argv[5]
MODE = None if MODE == "default" else MODE
DYNAMIC = {"none": None, "true": True, "false": False}[DYNAMIC]


class Block(torch.nn.Module):
    # attention through the module (GQA, causal) and through the function (key-padding mask, window)
    def __init__(self, dim, heads, kv_heads):
        super().__init__()
        self.heads, self.kv_heads, self.head_dim = heads, kv_heads, dim // heads
        self.q = torch.nn.Linear(dim, dim, dtype=DTYPE)
        self.kv = torch.nn.Linear(dim, 2 * kv_heads * self.head_dim, dtype=DTYPE)
        self.attn = fatune.FlashAttention(is_causal=True, enable_gqa=True)

    def forward(self, x, keep):
        b, n, _ = x.shape
        q = self.q(x).view(b, n, self.heads, self.head_dim).transpose(1, 2)
        k, v = self.kv(x).view(b, n, 2, self.kv_heads, self.head_dim).permute(2, 0, 3, 1, 4)
        first = self.attn(q, k, v)
        second = fatune.attention(q, k.repeat_interleave(2, 1), v.repeat_interleave(2, 1), attn_mask=keep,
                                  window_size=(7, 3))
        return (first + second).transpose(1, 2).reshape(b, n, -1)


torch.manual_seed(0)
model = Block(32, 2, 1).to(DEVICE)  # small: on the CPU every kernel runs in the interpreter
compiled = torch.compile(model, fullgraph=True, backend=BACKEND, mode=MODE, dynamic=DYNAMIC)
for n in (40, 57, 81):  # several sequence lengths: dynamic=True must not recompile for them
    x = torch.randn(1, n, 32, device=DEVICE, dtype=DTYPE, requires_grad=True)
    keep = torch.rand(1, 1, 1, n, device=DEVICE) < 0.8
    results = []
    for fn in (compiled, model):
        x.grad = None
        model.zero_grad()
        out = fn(x, keep)
        out.backward(torch.ones_like(out))
        results.append((out.detach().clone(), x.grad.clone(), model.q.weight.grad.clone()))
    for got, want in zip(*results):
        torch.testing.assert_close(got, want, atol=1e-4, rtol=1e-4)
stats = dict(torch._dynamo.utils.counters["stats"])
print("OK", stats)
if DYNAMIC:
    assert stats["unique_graphs"] == 1, f"recompiled for a new length: {stats}"
"""


def run_compile_script(device: str, dtype: str, backend: str, mode: str = "default", dynamic: str = "none"):
    env = dict(os.environ)
    script = (UNCHECKED_PRELUDE if device == "cpu" else "") + COMPILE_SCRIPT  # conftest.OVERFLOW_CHECKED's policy
    result = subprocess.run([sys.executable, "-c", script, device, dtype, backend, mode, dynamic],
                            capture_output=True, text=True, timeout=900, env=env)
    assert result.returncode == 0, result.stdout[-2000:] + result.stderr[-6000:]
    assert "OK" in result.stdout


@pytest.mark.skipif(torch.cuda.is_available(), reason="CPU variant; the GPU tests use inductor")
@pytest.mark.parametrize("dynamic", ["none", "true"])
def test_compile_fullgraph_from_a_fresh_process_matches_eager_on_cpu(dynamic):
    run_compile_script("cpu", "float32", "aot_eager", dynamic=dynamic)


# A fresh process: README's prepared-mask pattern compiled whole (the mask prepared inside the compiled function),
# with and without fullgraph, against eager.
PREPARED_MASK_SCRIPT = """
import sys, torch, fatune

DEVICE, BACKEND = sys.argv[1], sys.argv[2]


def step(q, k, v, keep):
    mask = fatune.prepare_mask(keep, (1, 2, 40, 40))
    return fatune.attention(q, k, v, attn_mask=mask) + fatune.attention(q, k, v, attn_mask=mask, is_causal=True)


torch.manual_seed(0)
q, k, v = (torch.randn(1, 2, 40, 16, device=DEVICE, requires_grad=True) for _ in range(3))
keep = torch.rand(1, 1, 1, 40, device=DEVICE) < 0.8
for fullgraph in (True, False):
    compiled = torch.compile(step, fullgraph=fullgraph, backend=BACKEND)
    results = []
    for fn in (compiled, step):
        out = fn(q, k, v, keep)
        results.append((out.detach(), *torch.autograd.grad(out.square().sum(), (q, k, v))))
    for got, want in zip(*results):
        torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)
print("OK")
"""


def run_script(script: str, *args: str) -> None:
    result = subprocess.run([sys.executable, "-c", script, *args], capture_output=True, text=True, timeout=900,
                            env=dict(os.environ))
    assert result.returncode == 0, result.stdout[-2000:] + result.stderr[-6000:]
    assert "OK" in result.stdout


@pytest.mark.skipif(torch.cuda.is_available(), reason="CPU variant; the GPU tests use inductor")
def test_prepare_mask_inside_a_compiled_function_on_cpu():
    run_script(UNCHECKED_PRELUDE + PREPARED_MASK_SCRIPT, "cpu", "aot_eager")


@pytest.mark.parametrize("config", [
    None,
    INTERPRETER_CONFIG,
    # the Gluon family's kernels (whose configs have other fields), alone and beside the Triton family's
    AttentionConfig(GluonConfig(block_n=128, num_stages=2), INTERPRETER_CONFIG.dkdv, INTERPRETER_CONFIG.dq),
    AttentionConfig(GluonConfig(block_n=64, num_stages=3, consumers=3, consumer_regs=160),
                    GluonBackwardConfig(block_m=64, num_stages=2, group_split=2), INTERPRETER_CONFIG.dq),
])
def test_a_config_passes_through_the_ops_argument_list_unchanged(config):
    assert config_from_list(config_to_list(config)) == config


def test_a_config_list_without_classes_is_read_as_three_triton_configs():
    """The form the op took before configs named their class (a saved exported program's)."""
    untagged = [value for launch in (INTERPRETER_CONFIG.fwd, INTERPRETER_CONFIG.dkdv, INTERPRETER_CONFIG.dq)
                for value in dataclasses.astuple(launch)]
    assert config_from_list(untagged) == INTERPRETER_CONFIG


@pytest.mark.parametrize("values", [[7], [2**62] * 3, [0], [-1, 1, 2], [True] + [16] * 11,
                                    config_to_list(INTERPRETER_CONFIG)[:-1], config_to_list(INTERPRETER_CONFIG) + [1]])
def test_a_crafted_config_list_is_refused_by_name(values):
    """The op's config argument is untrusted: a list config_to_list would not write raises a ValueError naming it."""
    with pytest.raises(ValueError, match="config"):
        config_from_list(values)


def test_a_config_of_a_subclass_passes_and_anything_else_is_refused_by_name():
    class Tuned(type(INTERPRETER_CONFIG.fwd)):
        pass

    config = INTERPRETER_CONFIG.replace(fwd=Tuned(*dataclasses.astuple(INTERPRETER_CONFIG.fwd)))
    assert config_from_list(config_to_list(config)) == INTERPRETER_CONFIG
    with pytest.raises(TypeError, match="config: expected a fatune.AttentionConfig"):
        config_to_list({"fwd": 1})


def _op_args(q, k, v, config=(), **arguments) -> tuple:
    """fatune::attention_forward's arguments for a call (its schema follows fatune.call.ARGUMENTS)."""
    call = Call(**arguments)
    return (q, k, v, *call._replace(window_size=list(call.window_size)), None, list(config), None)


def test_custom_op_passes_torch_library_checks():
    q = torch.randn(1, 2, 24, 16, dtype=torch.float16, device=DEVICE)
    k, v = torch.randn_like(q), torch.randn_like(q)
    for config in ([], config_to_list(INTERPRETER_CONFIG)):
        torch.library.opcheck(torch.ops.fatune.attention_forward.default,
                              _op_args(q, k, v, config, is_causal=True, scale=0.25),
                              test_utils=("test_schema", "test_faketensor"))
    # mask tensors: the key spans the op returns for the backward, shaped by the mask's distinct rows (fake too)
    for mask in (torch.rand(1, 1, 24, 24, device=DEVICE) < 0.7,
                 (torch.rand(24, device=DEVICE) < 0.7).expand(1, 2, 24, 24), torch.randn(1, 2, 24, 24, device=DEVICE)):
        torch.library.opcheck(torch.ops.fatune.attention_forward.default, _op_args(q, k, v, attn_mask=mask, scale=0.25),
                              test_utils=("test_schema", "test_faketensor"))
    # a paged cache: k and v as 3 pages of 16 keys, the block table naming two of them per sequence
    pages, table = torch.randn(3, 2, 16, 16, dtype=torch.float16, device=DEVICE), torch.tensor(
        [[2, 0]], dtype=torch.int32, device=DEVICE)
    torch.library.opcheck(torch.ops.fatune.attention_forward.default,
                          _op_args(q, pages, pages, block_table=table, scale=0.25),
                          test_utils=("test_schema", "test_faketensor"))


def test_the_ops_schema_and_the_public_signature_follow_the_argument_table():
    """fatune.attention's parameters, their defaults, and the custom op's arguments all come from one table."""
    parameters = list(inspect.signature(fatune.attention).parameters.values())
    assert [p.name for p in parameters] == ["query", "key", "value", *(a.name for a in ARGUMENTS), "config", "strict"]
    for parameter, argument in zip(parameters[3:], ARGUMENTS):
        assert parameter.default == argument.default, argument.name
        assert (parameter.kind == parameter.KEYWORD_ONLY) == argument.keyword_only, argument.name
    schema = torch.ops.fatune.attention_forward.default._schema
    assert [a.name for a in schema.arguments] == ["q", "k", "v", *(a.name for a in ARGUMENTS), "seed", "config",
                                                  "strict"]


def test_module_and_function_agree():
    q, k, v = (torch.randn(1, 2, 30, 16, dtype=torch.float16, device=DEVICE) for _ in range(3))
    module = fatune.FlashAttention(is_causal=True)
    assert torch.equal(module(q, k, v), fatune.attention(q, k, v, is_causal=True))
    assert torch.equal(module(q, k, v, is_causal=False), fatune.attention(q, k, v))


def _flops(call) -> tuple[int, torch.Tensor]:
    with FlopCounterMode(display=False) as counter:
        out = call()
    return counter.get_total_flops(), out


def _counted(b, h, lq, lk, d, dv) -> tuple[int, int]:
    """The forward's and a training step's FLOPs as torch counts SDPA's: every (query, key) pair, no mask
    subtracted; the backward recomputes S and computes dP, dV, dQ and dK."""
    pairs = b * h * lq * lk
    return 2 * pairs * (d + dv), 2 * pairs * (d + dv) + 2 * pairs * (3 * d + 2 * dv)


@pytest.mark.parametrize("b, h, h_kv, lq, lk, d, dv, options", [
    (2, 2, 2, 33, 47, 16, 16, {"is_causal": True}),
    (1, 4, 2, 40, 40, 32, 16, {"enable_gqa": True, "window_size": (8, 0)}),
    (1, 2, 2, 24, 24, 16, 16, {"attn_mask": "bool"}),
])
def test_a_flop_counter_counts_the_call_and_sees_the_same_results(b, h, h_kv, lq, lk, d, dv, options):
    """Under torch's FlopCounterMode a call runs as fatune's custom ops, counted as torch counts SDPA (they counted
    nothing), with the results and gradients of an eager call."""
    q = torch.randn(b, h, lq, d, dtype=torch.float16, device=DEVICE, requires_grad=True)
    k = torch.randn(b, h_kv, lk, d, dtype=torch.float16, device=DEVICE, requires_grad=True)
    v = torch.randn(b, h_kv, lk, dv, dtype=torch.float16, device=DEVICE, requires_grad=True)
    if options.get("attn_mask") == "bool":
        options = {**options, "attn_mask": torch.rand(lq, lk, device=DEVICE) < 0.8}
    grad = torch.randn(b, h, lq, dv, dtype=torch.float16, device=DEVICE)

    forward, step = _counted(b, h, lq, lk, d, dv)
    routed = fatune.explain(q, k, v, **options).backend.startswith("sdpa-")
    if routed:  # a call routed to torch's SDPA: the mode sees SDPA's op, counted by torch's formula
        sdpa = torch.nn.functional.scaled_dot_product_attention
        forward = _flops(lambda: sdpa(q, k, v, **options))[0]
        step = _flops(lambda: torch.autograd.grad(sdpa(q, k, v, **options), (q, k, v), grad))[0]

    expected = fatune.attention(q, k, v, **options)
    expected_grads = torch.autograd.grad(expected, (q, k, v), grad)
    flops, out = _flops(lambda: fatune.attention(q, k, v, **options))
    assert flops == forward > 0
    torch.testing.assert_close(out, expected, atol=0, rtol=0)
    flops, grads = _flops(lambda: torch.autograd.grad(fatune.attention(q, k, v, **options), (q, k, v), grad))
    assert flops == step
    for got, want in zip(grads, expected_grads):
        torch.testing.assert_close(got, want, atol=0, rtol=0)
    if not routed:
        with torch.no_grad():
            assert _flops(lambda: fatune.attention(q, k, v, **options))[0] == forward


def test_a_flop_counter_counts_packed_sequences_each_on_its_own():
    lengths = [10, 1, 19]
    cu = torch.tensor([0, 10, 11, 30], dtype=torch.int32, device=DEVICE)
    q = torch.randn(30, 4, 16, dtype=torch.float16, device=DEVICE)
    k, v = (torch.randn(30, 2, 16, dtype=torch.float16, device=DEVICE) for _ in range(2))
    flops, out = _flops(lambda: fatune.attention(q, k, v, cu_seqlens_q=cu, cu_seqlens_k=cu, max_seqlen_q=19,
                                                  max_seqlen_k=19, enable_gqa=True, is_causal=True))
    assert flops == sum(_counted(1, 4, n, n, 16, 16)[0] for n in lengths)
    torch.testing.assert_close(out, fatune.attention(q, k, v, cu_seqlens_q=cu, cu_seqlens_k=cu, max_seqlen_q=19,
                                                     max_seqlen_k=19, enable_gqa=True, is_causal=True), atol=0, rtol=0)


def test_a_flop_counter_on_tensors_without_data_counts_packed_sequences_at_most_all_pairs():
    """Packed lengths cannot be read from fake tensors: each sequence counts at its given maximum, clamped to the
    tokens, and all of them at most every (query, key) pair of the tokens."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    with FakeTensorMode():
        q, k, v = (torch.empty(30, 2, 16, dtype=torch.float16) for _ in range(3))
        cu = torch.tensor([0, 10, 11, 30], dtype=torch.int32)
        for longest in (19, 4096):
            flops, _ = _flops(lambda: fatune.attention(q, k, v, cu_seqlens_q=cu, cu_seqlens_k=cu,
                                                       max_seqlen_q=longest, max_seqlen_k=longest))
            assert flops == _counted(1, 2, 30, 30, 16, 16)[0] if longest > 19 else 3 * _counted(1, 2, 19, 19, 16, 16)[0]


def test_under_a_dispatch_mode_the_strict_argument_still_decides(monkeypatch):
    """strict=False beats $FATUNE_STRICT=1 (and strict=True $FATUNE_STRICT=0) under a FLOP counter as in an eager
    call; a tuned-entry miss raises only in strict mode."""
    from fatune.runtime.dispatch import DispatchError

    q, k, v = (torch.randn(1, 2, 24, 16, dtype=torch.float16, device=DEVICE) for _ in range(3))
    monkeypatch.setenv("FATUNE_STRICT", "1")
    expected = fatune.attention(q, k, v, is_causal=True, strict=False)
    torch.testing.assert_close(_flops(lambda: fatune.attention(q, k, v, is_causal=True, strict=False))[1], expected,
                               atol=0, rtol=0)
    if fatune.explain(q, k, v, is_causal=True, strict=False).reason.startswith("no tuned entry"):
        monkeypatch.setenv("FATUNE_STRICT", "0")
        with pytest.raises(DispatchError):
            _flops(lambda: fatune.attention(q, k, v, is_causal=True, strict=True))


def test_double_backward_under_a_dispatch_mode_is_refused_as_in_an_eager_call():
    q, k, v = (torch.randn(1, 2, 24, 16, dtype=torch.float16, device=DEVICE, requires_grad=True) for _ in range(3))
    with FlopCounterMode(display=False), pytest.raises(RuntimeError, match="double backward"):
        torch.autograd.grad(fatune.attention(q, k, v).sum(), q, create_graph=True)


def test_selective_activation_checkpointing_recomputes_or_saves_the_call():
    """Selective activation checkpointing (a dispatch mode) sees the call as one op: a policy can save its output or
    let it be recomputed, with the gradients of an eager call either way."""
    from torch.utils.checkpoint import CheckpointPolicy, checkpoint, create_selective_checkpoint_contexts

    q, k, v = (torch.randn(1, 2, 40, 16, dtype=torch.float16, device=DEVICE, requires_grad=True) for _ in range(3))
    seen = []

    def policy(ctx, op, *args, **kwargs):
        seen.append(op)
        return CheckpointPolicy.MUST_SAVE if op == torch.ops.fatune.attention_forward.default and save \
            else CheckpointPolicy.PREFER_RECOMPUTE

    def block(q, k, v):
        return fatune.attention(q * 1.5, k, v, is_causal=True).square()

    expected = torch.autograd.grad(block(q, k, v).sum(), (q, k, v))
    routed = fatune.explain(q, k, v, is_causal=True).backend.startswith("sdpa-")  # the mode sees SDPA's op
    for save in (True, False):
        seen.clear()
        out = checkpoint(block, q, k, v, use_reentrant=False,
                         context_fn=lambda: create_selective_checkpoint_contexts(policy))
        grads = torch.autograd.grad(out.sum(), (q, k, v))
        assert routed or torch.ops.fatune.attention_forward.default in seen
        for got, want in zip(grads, expected):
            torch.testing.assert_close(got, want, atol=0, rtol=0)


# ---------------------------------------------------------------- GPU (pytest -m gpu)

@pytest.mark.gpu
@pytest.mark.parametrize("mode, dynamic", [("default", "none"), ("reduce-overhead", "none"),
                                           ("max-autotune-no-cudagraphs", "none"), ("default", "true")])
def test_gpu_compile_from_a_fresh_process(mode, dynamic):
    # float32: the compiled model's own matmuls round like eager's, so the comparison can be tight
    run_compile_script("cuda", "float32", "inductor", mode, dynamic)


@pytest.mark.gpu
def test_gpu_prepare_mask_inside_a_compiled_function():
    run_script(PREPARED_MASK_SCRIPT, "cuda", "inductor")


# A fresh process: torch.compile(mode="reduce-overhead") (CUDA-graph trees, whose warm-up and recording runs allocate
# in a pool no tensor but the graph's outputs may outlive) for a small model's bf16 training step and for
# inference (prefill, and decode against a cache: split-KV), each against eager.
REDUCE_OVERHEAD_SCRIPT = """
import torch, fatune

torch.manual_seed(0)
DIM, HEADS, KV_HEADS, HEAD_DIM = 256, 4, 2, 64


class Block(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.q = torch.nn.Linear(DIM, HEADS * HEAD_DIM)
        self.kv = torch.nn.Linear(DIM, 2 * KV_HEADS * HEAD_DIM)
        self.o = torch.nn.Linear(HEADS * HEAD_DIM, DIM)

    def forward(self, x, cache=None):
        b, n, _ = x.shape
        q = self.q(x).view(b, n, HEADS, HEAD_DIM).transpose(1, 2)
        k, v = self.kv(x if cache is None else cache).view(b, -1, 2, KV_HEADS, HEAD_DIM).permute(2, 0, 3, 1, 4)
        out = fatune.attention(q, k, v, is_causal=cache is None, enable_gqa=True, dropout_p=0.0)
        return self.o(out.transpose(1, 2).reshape(b, n, -1))


model = Block().cuda().to(torch.bfloat16)
compiled = torch.compile(model, mode="reduce-overhead")
x = torch.randn(2, 512, DIM, device="cuda", dtype=torch.bfloat16)
target = torch.randn_like(x)


def train_step(fn):
    model.zero_grad(set_to_none=True)
    loss = (fn(x) - target).square().mean()
    loss.backward()
    return loss.detach().clone(), [p.grad.clone() for p in model.parameters()]


for step in range(4):
    torch.compiler.cudagraph_mark_step_begin()
    got = train_step(compiled)
    want = train_step(model)
    torch.testing.assert_close(got[0], want[0], atol=2e-2, rtol=2e-2)
    for g, w in zip(got[1], want[1]):
        torch.testing.assert_close(g, w, atol=2e-2, rtol=2e-2)

with torch.no_grad():
    cache = torch.randn(2, 4096, DIM, device="cuda", dtype=torch.bfloat16)
    for step in range(4):
        for inputs in ((x,), (x[:, :1], cache)):
            torch.compiler.cudagraph_mark_step_begin()
            got = compiled(*inputs).clone()
            torch.testing.assert_close(got, model(*inputs), atol=2e-2, rtol=2e-2)
print("OK")
"""


@pytest.mark.gpu
def test_gpu_reduce_overhead_training_step_and_inference_match_eager():
    run_script(REDUCE_OVERHEAD_SCRIPT)


def warm_up_on_a_side_stream(fn) -> None:
    """Run fn a few times on a side stream before a capture (compiles, allocator), as torch's docs do."""
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        for _ in range(3):
            fn()
    torch.cuda.current_stream().wait_stream(stream)


@pytest.mark.gpu
@pytest.mark.parametrize("deterministic", [False, True], ids=["default", "deterministic"])
@pytest.mark.parametrize("dropout_p", [0.0, 0.2], ids=["plain", "dropout"])
def test_gpu_forward_and_backward_capture_in_a_cuda_graph(dropout_p, deterministic, monkeypatch, request):
    """Capture forward+backward in a CUDA graph; each replay must equal an eager call with its seed (bit for
    bit; only a dQ added up atomically, as the Hopper heuristic does at d64 causal, may differ in its last
    bits, unless torch's deterministic mode is on)."""
    from fatune.kernel.triton import dropout

    if deterministic:
        request.getfixturevalue("deterministic_algorithms")

    seeds = []
    draw = dropout.draw_seed

    def recording_draw(device):
        seeds.append(draw(device))
        return seeds[-1]

    monkeypatch.setattr(dropout, "draw_seed", recording_draw)
    torch.manual_seed(0)
    q, k, v = (torch.randn(2, 4, 300, 64, device="cuda", dtype=torch.bfloat16, requires_grad=True) for _ in range(3))
    grad_out = torch.randn(2, 4, 300, 64, device="cuda", dtype=torch.bfloat16)

    def step():
        q.grad = k.grad = v.grad = None
        out = fatune.attention(q, k, v, is_causal=True, dropout_p=dropout_p)
        out.backward(grad_out)
        return out

    warm_up_on_a_side_stream(step)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        captured = step()
    captured_seed = seeds[-1] if dropout_p else None
    grads = (q.grad, k.grad, v.grad)
    outputs = []
    for _ in range(2):
        graph.replay()
        torch.cuda.synchronize()
        outputs.append(captured.clone())
        replayed = tuple(g.clone() for g in grads)
        if dropout_p:  # the eager call uses the seed the replay drew
            seed_value = captured_seed.clone()
            monkeypatch.setattr(dropout, "draw_seed", lambda device: seed_value.clone())
        eager = step()
        assert torch.equal(captured, eager)
        for name, got, want in zip("qkv", replayed, (q.grad, k.grad, v.grad)):
            if name == "q" and not deterministic:
                torch.testing.assert_close(got, want, rtol=2**-7, atol=1e-5)
            else:
                assert torch.equal(got, want), name
        monkeypatch.setattr(dropout, "draw_seed", recording_draw)
    if dropout_p:
        assert not torch.equal(outputs[0], outputs[1]), "every replay must draw a fresh dropout seed"


@pytest.mark.gpu
def test_gpu_split_kv_decode_replays_in_a_cuda_graph():
    """Split-KV decode (its merge's arrival counts included) captured once, replayed on new inputs:
    every replay equals an eager call, and eager calls after the capture still do."""
    torch.manual_seed(0)
    q = torch.randn(2, 8, 1, 128, device="cuda", dtype=torch.bfloat16)
    k, v = (torch.randn(2, 2, 4096, 128, device="cuda", dtype=torch.bfloat16) for _ in range(2))
    assert fatune.explain(q, k, v, enable_gqa=True).launched.fwd.num_splits > 1, "the shape must split"

    def decode():
        return fatune.attention(q, k, v, enable_gqa=True)

    warm_up_on_a_side_stream(decode)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        captured = decode()
    for _ in range(3):
        for tensor in (q, k, v):
            tensor.copy_(torch.randn_like(tensor))
        graph.replay()
        eager = decode()
        torch.cuda.synchronize()
        assert torch.equal(captured, eager)
