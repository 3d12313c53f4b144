"""fatune.attention under torch.compile(fullgraph=True), in CUDA graphs, and as an nn.Module."""

from __future__ import annotations

import pytest
import torch

import fatune
from tests.conftest import DEVICE


class TinyModel(torch.nn.Module):
    def __init__(self, dim=32, heads=2, dtype=torch.float32):
        super().__init__()
        self.heads = heads
        self.proj = torch.nn.Linear(dim, 3 * dim, dtype=dtype)
        self.attn = fatune.FlashAttention(is_causal=True)

    def forward(self, x):
        b, n, d = x.shape
        q, k, v = self.proj(x).view(b, n, 3, self.heads, d // self.heads).permute(2, 0, 3, 1, 4)
        return self.attn(q, k, v).transpose(1, 2).reshape(b, n, d)


def _eager_and_compiled(model, x, backend):
    eager = model(x)
    eager.sum().backward()
    grad = model.proj.weight.grad.clone()
    model.proj.weight.grad = None
    compiled = torch.compile(model, fullgraph=True, backend=backend)
    out = compiled(x)
    out.sum().backward()
    return eager, out, grad, model.proj.weight.grad


@pytest.mark.skipif(torch.cuda.is_available(), reason="CPU variant; the GPU test uses inductor")
def test_compile_fullgraph_matches_eager_on_cpu():
    torch.manual_seed(0)
    model = TinyModel()
    x = torch.randn(2, 40, 32)
    eager, out, grad, compiled_grad = _eager_and_compiled(model, x, "aot_eager")
    torch.testing.assert_close(out, eager)
    torch.testing.assert_close(compiled_grad, grad)


def test_custom_op_passes_torch_library_checks():
    q = torch.randn(1, 2, 24, 16, dtype=torch.float16, device=DEVICE)
    k, v = torch.randn_like(q), torch.randn_like(q)
    config = fatune.dispatch.dispatcher().decide(fatune.inputs.check_inputs(q, k, v), q.device).config
    args = (q, k, v, None, None, None, None, None, torch.zeros(1, dtype=torch.int64), 0.0, True, 0.25, False, -1, -1,
            "", 0, 0, fatune.custom_op.config_to_list(config))
    torch.library.opcheck(torch.ops.fatune.attention_forward.default, args,
                          test_utils=("test_schema", "test_faketensor"))


@pytest.mark.gpu
def test_gpu_compile_inductor_matches_eager():
    torch.manual_seed(0)
    model = TinyModel(dim=256, heads=4, dtype=torch.bfloat16).cuda()
    x = torch.randn(2, 300, 256, device="cuda", dtype=torch.bfloat16)
    eager, out, grad, compiled_grad = _eager_and_compiled(model, x, "inductor")
    torch.testing.assert_close(out, eager)
    torch.testing.assert_close(compiled_grad, grad, atol=2e-2, rtol=2e-2)


@pytest.mark.gpu
def test_gpu_forward_and_backward_capture_in_a_cuda_graph():
    torch.manual_seed(0)
    q, k, v = (torch.randn(2, 4, 300, 64, device="cuda", dtype=torch.bfloat16, requires_grad=True) for _ in range(3))
    grad_out = torch.randn(2, 4, 300, 64, device="cuda", dtype=torch.bfloat16)
    reference = fatune.attention(q, k, v, is_causal=True)
    reference_grads = torch.autograd.grad(reference, (q, k, v), grad_out)
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):  # warm up on a side stream (compiles, allocator) as torch's docs do
        for _ in range(3):
            q.grad = k.grad = v.grad = None
            fatune.attention(q, k, v, is_causal=True).backward(grad_out)
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    q.grad = k.grad = v.grad = None
    with torch.cuda.graph(graph, capture_error_mode="thread_local"):
        captured = fatune.attention(q, k, v, is_causal=True)
        captured.backward(grad_out)
    graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(captured, reference)
    for got, want in zip((q.grad, k.grad, v.grad), reference_grads):
        assert torch.equal(got, want)
