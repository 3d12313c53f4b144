"""Calls routed to a torch SDPA backend a tuned entry measured faster: which entries route, which calls may be
routed, what runs where the backend cannot (fatune's kernels, said once), and untrusted entries naming a backend
that does not exist."""

from __future__ import annotations

import logging
import math

import pytest
import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

import fatune
from fatune import logs
from fatune.call import check_inputs
from fatune.runtime import routes
from fatune.runtime.dispatch import Dispatcher
from tests.conftest import DEVICE, use_dispatcher
from tests.test_db import make_entry
from tests.test_dispatch import CAPABILITY, GPU, write

# fatune's forward+backward 3.0 ms (make_entry); SDPA's as given
ROUTES = [  # (entry changes, the backend a call of its key runs on: "" for fatune's kernels)
    ({"sdpa_backend": "cudnn", "sdpa_ms": 2.5}, "cudnn"),
    ({"sdpa_backend": "flash", "sdpa_ms": 2.9}, "flash"),
    ({"sdpa_backend": "cudnn", "sdpa_ms": 3.0}, ""),  # a tie keeps fatune's kernels
    ({"sdpa_backend": "cudnn", "sdpa_ms": 3.5}, ""),
    ({"sdpa_backend": "cudnn", "sdpa_ms": math.nan}, ""),  # not measured
    ({"sdpa_backend": "", "sdpa_ms": 1.0}, ""),
    ({"sdpa_backend": "cudnn", "sdpa_ms": 2.0, "interpreted": True}, ""),  # an interpreter's timings decide nothing
    ({"sdpa_backend": "cudnn", "sdpa_ms": 0.5, "fwd_ms": 1.0, "bwd_ms": math.nan, "fwd_bwd_ms": math.nan,
      "seqlen_q_bucket": 16}, "cudnn"),  # forward-only entries compare forward times
    ({"sdpa_backend": "cudnn", "sdpa_ms": 2.0, "mask_variant": "causal+dropout"}, "cudnn"),
    # SDPA timed as a yardstick on a variant it cannot compute as fatune does: never a route
    ({"sdpa_backend": "cudnn", "sdpa_ms": 0.5, "mask_variant": "causal+window-left+bottom-right"}, ""),
    ({"sdpa_backend": "cudnn", "sdpa_ms": 0.5, "mask_variant": "causal+seqlens-k"}, ""),
]


@pytest.mark.parametrize("changes, route", ROUTES)
def test_an_entry_routes_to_the_sdpa_backend_it_measured_faster(changes, route):
    assert make_entry(**changes).check().route() == route


def test_the_dispatcher_says_which_backend_and_by_what_margin(tmp_path):
    path = write(tmp_path / "u.sqlite", make_entry(gpu=GPU, capability=CAPABILITY, dtype="float16",
                                                   sdpa_backend="cudnn", sdpa_ms=2.0))
    q = torch.empty(1, 4, 4096, 64, dtype=torch.float16, device="meta")
    decision = Dispatcher(user_db=path, shipped=[]).lookup(check_inputs(q, q, q, is_causal=True), GPU, CAPABILITY, None)
    assert decision.route == "cudnn" and decision.margin == pytest.approx(1.5)
    assert "torch SDPA's cudnn backend, measured 1.50x faster" in decision.describe()


def _problem(**kwargs):
    q, k = torch.randn(1, 2, 8, 16), torch.randn(1, 2, 12, 16)  # L_q != L_k: the alignments differ
    return check_inputs(q, k, k, **kwargs), q


@pytest.mark.parametrize("kwargs, routable", [
    ({}, True),
    ({"is_causal": True}, True),
    ({"dropout_p": 0.1}, True),
    ({"is_causal": True, "causal_alignment": "bottom_right"}, False),
    ({"is_causal": True, "window_size": (4, 0)}, False),
    ({"attn_mask": torch.ones(8, 12, dtype=torch.bool)}, False),
    ({"seqlens_k": torch.tensor([5], dtype=torch.int32)}, False),
    ({"alibi_slopes": torch.ones(2)}, False),
])
def test_only_calls_sdpa_computes_as_fatune_does_may_be_routed(kwargs, routable):
    """No mask tensor, window, key lengths, ALiBi or bottom-right alignment: SDPA would compute another thing
    (or return NaN where fatune returns 0)."""
    problem, q = _problem(**kwargs)
    reason = routes.unroutable("cudnn", problem, q, q, q)
    if routable:
        assert reason == "SDPA's cudnn backend runs on CUDA GPUs"  # the only reason left on this CPU
    else:
        assert reason is not None and "variant" in reason


def test_a_backend_that_does_not_exist_is_refused_by_name():
    problem, q = _problem(is_causal=True)
    assert "no backend 'turbo'" in routes.unroutable("turbo", problem, q, q, q)
    assert "no backend 'math'" in routes.unroutable("math", problem, q, q, q)


@pytest.fixture
def routed_db(tmp_path, monkeypatch):
    """A user DB whose entry for (1, 2, 48, 32) float16 causal calls measured SDPA's cuDNN backend faster (a new
    DB each time)."""
    made = []

    def make(backend: str = "cudnn", **changes):
        made.append(backend)
        path = write(tmp_path / f"u{len(made)}.sqlite", make_entry(
            gpu=GPU, capability=CAPABILITY, dtype="float16", head_dim=32, head_dim_v=32, seqlen_q_bucket=64,
            seqlen_k_bucket=64, sdpa_backend=backend, sdpa_ms=1.0, **changes))
        use_dispatcher(monkeypatch, Dispatcher(user_db=path, shipped=[]))
        monkeypatch.setattr(logs, "_warned", set())
    return make


def inputs():
    torch.manual_seed(0)
    return [torch.randn(1, 2, 48, 32, device=DEVICE, dtype=torch.float16, requires_grad=True) for _ in range(3)]


@pytest.mark.parametrize("backend", ["cudnn", "turbo"])
def test_where_the_backend_cannot_run_fatunes_kernels_do_said_once(routed_db, caplog, backend):
    """On this CPU no SDPA backend of a route runs (nor does a backend no torch has, from an untrusted DB): the
    tuned entry's configs run on fatune's kernels, with one log line, and no error."""
    routed_db(backend)
    q, k, v = inputs()
    with caplog.at_level(logging.WARNING, logger="fatune"):
        out = fatune.attention(q, k, v, is_causal=True)
        fatune.attention(q, k, v, is_causal=True).sum().backward()
    said = [r.message for r in caplog.records if "SDPA" in r.message]
    assert len(said) == 1 and "fatune's kernels run" in said[0], said
    explained = fatune.explain(q, k, v, is_causal=True)
    assert explained.backend != f"sdpa-{backend}" and explained.decision.route == backend
    config = explained.decision.config
    assert torch.equal(out, fatune.attention(q, k, v, is_causal=True, config=config))


def test_a_routed_call_runs_forward_and_backward_on_the_backend(routed_db, monkeypatch):
    """Where the backend takes the call (here: told so, with SDPA's math backend, the one this CPU has, as the
    route), eager calls run on it alone through torch's autograd, and torch's switches are as they were after;
    a config argument and torch.func run fatune's kernels."""
    monkeypatch.setattr(routes, "unroutable", lambda *args: None)
    monkeypatch.setitem(routes.BACKENDS, "math", SDPBackend.MATH)
    runs = []
    real_run = routes.run
    monkeypatch.setattr(routes, "run", lambda *args: runs.append(args[0]) or real_run(*args))
    routed_db("math")
    switches = {name: getter() for name, (getter, _) in routes._SWITCHES.items()}
    q, k, v = inputs()
    out = fatune.attention(q, k, v, is_causal=True)
    out.float().square().sum().backward()
    assert runs == ["math"] and fatune.explain(q, k, v, is_causal=True).backend == "sdpa-math"
    assert switches == {name: getter() for name, (getter, _) in routes._SWITCHES.items()}
    expected = [t.detach().clone().requires_grad_() for t in (q, k, v)]
    with sdpa_kernel(SDPBackend.MATH):
        reference = F.scaled_dot_product_attention(*expected, is_causal=True)
    reference.float().square().sum().backward()
    assert torch.equal(out, reference)
    for got, want in zip((q, k, v), expected):
        assert torch.equal(got.grad, want.grad)
    config = fatune.explain(q, k, v, is_causal=True).decision.config
    fatune.attention(q, k, v, is_causal=True, config=config)
    torch.func.grad(lambda x: fatune.attention(x, k.detach(), v.detach(), is_causal=True).float().sum())(q.detach())
    assert runs == ["math"]  # neither was routed


def compiled_graphs(fn, **options):
    """torch.compile(fn) and the code of the forward and backward graphs it runs (AOTAutograd's, as compiled)."""
    from torch._dynamo.backends.common import aot_autograd
    from torch._dynamo.backends.debugging import boxed_nop

    codes = []

    def capture(graph, example_inputs):
        codes.append(graph.code)
        return boxed_nop(graph, example_inputs)

    torch._dynamo.reset()
    return torch.compile(fn, fullgraph=True, backend=aot_autograd(fw_compiler=capture, bw_compiler=capture),
                         **options), codes


@pytest.fixture
def math_route(routed_db, monkeypatch):
    """Calls of routed_db's key routed to SDPA's math backend (the one this CPU has), fatune's plans counted."""
    from fatune.runtime import plans

    monkeypatch.setattr(routes, "unroutable", lambda *args: None)
    monkeypatch.setitem(routes.BACKENDS, "math", SDPBackend.MATH)
    routed_db("math")
    built = []
    real_build = plans._build
    monkeypatch.setattr(plans, "_build", lambda *args: built.append(args[3]) or real_build(*args))
    return built


@pytest.mark.parametrize("case, routed", [("fixed sizes", True), ("dynamic sizes", False), ("config", False),
                                           ("deterministic", False)])
def test_torch_compile_traces_a_routed_call_as_its_backend_where_its_sizes_are_fixed(math_route, monkeypatch, case,
                                                                                     routed):
    """torch.compile decides the route while tracing: with sizes the trace holds fixed the graphs call SDPA (here
    its CPU kernels, for the math backend's route), whose autograd computes the gradients, and fatune's plans are
    never built. With symbolic sizes, a config argument or deterministic algorithms on, the graphs call fatune's
    ops, which decide per call when they run."""
    if case == "deterministic":
        monkeypatch.setattr(routes, "_deterministic", lambda: True)
    config = fatune.explain(*inputs(), is_causal=True).decision.config if case == "config" else None
    math_route.clear()
    step, graphs = compiled_graphs(lambda q, k, v: fatune.attention(q, k, v, is_causal=True, config=config),
                                   dynamic=case == "dynamic sizes")
    q, k, v = inputs()
    out = step(q, k, v)
    out.float().square().sum().backward()
    assert len(graphs) == 2
    for code in graphs:
        assert ("fatune" not in code and "scaled_dot_product" in code) == routed, code
    assert bool(math_route) != routed
    expected = [t.detach().clone().requires_grad_() for t in (q, k, v)]
    reference = F.scaled_dot_product_attention(*expected, is_causal=True)
    reference.float().square().sum().backward()
    for got, want in zip((out, *(t.grad for t in (q, k, v))), (reference, *(t.grad for t in expected))):
        torch.testing.assert_close(got, want, atol=2e-3, rtol=2e-3)


def test_a_call_traced_with_dynamic_sizes_says_once_that_it_loses_its_route(math_route, caplog):
    step, _ = compiled_graphs(lambda q, k, v: fatune.attention(q, k, v, is_causal=True), dynamic=True)
    with caplog.at_level(logging.WARNING, logger="fatune"):
        for _ in range(2):
            step(*inputs())
    said = [r.message for r in caplog.records if "dynamic sizes" in r.message]
    assert len(said) == 1 and "SDPA's math backend" in said[0] and "dynamic=False" in said[0], said


def test_a_compiled_graph_holds_the_state_it_was_traced_with(routed_db, monkeypatch):
    """What a route depends on besides the call (the tuned DBs on disk, $FATUNE_STRICT) is an argument of the traced
    call: torch.compile's on-disk caches, keyed by the graph, do not hand a process a route decided elsewhere."""
    from fatune.runtime import plans

    monkeypatch.setattr(routes, "unroutable", lambda *args: None)
    monkeypatch.setitem(routes.BACKENDS, "math", SDPBackend.MATH)
    routed_db("math")
    before = plans.traced_state()
    graphs = []
    torch._dynamo.reset()
    step = torch.compile(lambda q, k, v: fatune.attention(q, k, v, is_causal=True), fullgraph=True,
                         backend=lambda graph, example_inputs: graphs.append(graph.code) or graph.forward)
    step(*inputs())
    assert repr(before) in graphs[0]
    monkeypatch.setenv("FATUNE_STRICT", "1")
    assert plans.traced_state() != before
    monkeypatch.delenv("FATUNE_STRICT")
    routed_db("math")  # another DB
    assert plans.traced_state() != before


def test_a_route_traced_now_reads_the_tuned_db_as_it_is_now(math_route, tmp_path, monkeypatch):
    """A process that decided a call eagerly keeps that decision (the dispatcher's memo), but a call traced after
    its DB changed reads the DB afresh: the graph, cached under the new DB's state, holds the new DB's decision."""
    from fatune.runtime.dispatch import dispatcher

    q, k, v = inputs()
    assert fatune.explain(q, k, v, is_causal=True).backend == "sdpa-math"
    from fatune.db.store import TunedDB

    with TunedDB(dispatcher().user_db) as db:  # the entry, re-timed: no route
        db.upsert(make_entry(gpu=GPU, capability=CAPABILITY, dtype="float16", head_dim=32, head_dim_v=32,
                             seqlen_q_bucket=64, seqlen_k_bucket=64, sdpa_backend="", sdpa_ms=math.nan),
                  keep_faster=False)
    step, graphs = compiled_graphs(lambda q, k, v: fatune.attention(q, k, v, is_causal=True))
    step(q, k, v).sum().backward()
    assert all("fatune" in code for code in graphs)


def test_a_graph_traced_with_another_state_takes_no_route(math_route):
    """A traced call whose state argument is not this process's (an exported program's, traced elsewhere) runs
    fatune's ops, which decide when they run."""
    from fatune import ops

    q, k, v = inputs()
    arguments = [*fatune.call.Call(is_causal=True)._replace(window_size=[-1, -1])]
    step, graphs = compiled_graphs(lambda q, k, v: torch.ops.fatune.attention(q, k, v, *arguments, None, None, None,
                                                                              "another state"))
    step(q, k, v)
    assert "fatune.attention_forward" in graphs[0]
    step, graphs = compiled_graphs(lambda q, k, v: torch.ops.fatune.attention(q, k, v, *arguments, None, None, None,
                                                                              ops._traced_state()))
    step(q, k, v)
    assert "fatune" not in graphs[0]


def test_strict_mode_is_kept_where_a_compiled_call_could_take_a_route(routed_db, monkeypatch, tmp_path):
    """A strict call whose tuned DB cannot be read raises under torch.compile as eagerly, even where a later layer
    routes it."""
    from fatune.runtime.dispatch import DispatchError

    monkeypatch.setattr(routes, "unroutable", lambda *args: None)
    monkeypatch.setitem(routes.BACKENDS, "math", SDPBackend.MATH)
    routed_db("math")
    garbage = tmp_path / "garbage.sqlite"
    garbage.write_bytes(b"not a database" * 100)
    shipped = fatune.runtime.dispatch.dispatcher().user_db
    use_dispatcher(monkeypatch, Dispatcher(user_db=garbage, shipped=[shipped]))
    q, k, v = inputs()
    assert fatune.explain(q, k, v, is_causal=True).backend == "sdpa-math"  # not strict: routed
    with pytest.raises(DispatchError):
        fatune.attention(q, k, v, is_causal=True, strict=True)
    torch._dynamo.reset()
    step = torch.compile(lambda q, k, v: fatune.attention(q, k, v, is_causal=True, strict=True), fullgraph=True,
                         backend="aot_eager")
    with pytest.raises(DispatchError):
        step(q, k, v)


def test_a_compiled_call_without_keys_is_not_routed(math_route, monkeypatch):
    """Rows that see no key return 0 under torch.compile as eagerly (SDPA returns NaN): no route is tried there."""
    monkeypatch.setattr(routes, "run", lambda *args: pytest.fail("routed"))
    q = torch.randn(1, 2, 48, 32, dtype=torch.float16, device=DEVICE)
    k = torch.randn(1, 2, 0, 32, dtype=torch.float16, device=DEVICE)
    torch._dynamo.reset()
    step = torch.compile(lambda q, k: fatune.attention(q, k, k, is_causal=True), fullgraph=True, backend="aot_eager")
    assert torch.equal(step(q, k), torch.zeros_like(q))


@pytest.mark.skipif(torch.cuda.is_available(), reason="a host without a GPU")
def test_fake_gpu_tensors_on_a_host_without_one_give_the_outputs_sizes(routed_db):
    """Tracing for a GPU on a machine without one (FakeTensorMode): the dispatcher cannot ask the GPU, and the call
    gives the output's sizes as before."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    routed_db("cudnn")
    with FakeTensorMode():
        q = torch.empty(1, 2, 48, 32, dtype=torch.float16, device="cuda")
        out = fatune.attention(q, q, q, is_causal=True)
    assert out.shape == q.shape and out.device.type == "cuda"


def test_the_questions_a_traced_route_asks_are_not_recorded(math_route):
    """make_fx records what a traced call computes, not what deciding its route asked of SDPA: an AOTInductor
    package would replay those questions and expect their answers."""
    from torch.fx.experimental.proxy_tensor import make_fx

    q, k, v = (t.detach() for t in inputs())
    graph = make_fx(lambda q, k, v: fatune.attention(q, k, v, is_causal=True), tracing_mode="fake")(q, k, v)
    targets = [str(node.target) for node in graph.graph.nodes if node.op == "call_function"]
    assert any("scaled_dot_product" in target for target in targets), targets
    assert not any("fused_sdp_choice" in target or "fatune" in target for target in targets), targets


def test_an_exported_program_routes_each_call_by_its_plan(math_route, monkeypatch):
    """torch.export keeps fatune::attention whole: an exported program's calls (tensors with data) take their route
    as eager calls do, through the plan built on the first."""
    runs = []
    real_run = routes.run
    monkeypatch.setattr(routes, "run", lambda *args: runs.append(args[0]) or real_run(*args))

    class Attend(torch.nn.Module):
        def forward(self, q, k, v):
            return fatune.attention(q, k, v, is_causal=True)

    q, k, v = (t.detach() for t in inputs())
    exported = torch.export.export(Attend(), (q, k, v)).module()
    runs.clear()
    math_route.clear()
    for _ in range(3):
        out = exported(q, k, v)
    assert runs == ["math"] * 3 and len(math_route) == 1
    torch.testing.assert_close(out, F.scaled_dot_product_attention(q, k, v, is_causal=True), atol=2e-3, rtol=2e-3)


@pytest.mark.gpu
@pytest.mark.parametrize("backend", sorted(routes.BACKENDS))
@pytest.mark.parametrize("causal, kv_heads", [(False, 8), (True, 8), (True, 2)])
def test_gpu_a_routed_call_meets_the_accuracy_rule(tmp_path, monkeypatch, backend, causal, kv_heads,
                                                   record_gpu_errors):
    """A tuned entry for this GPU that measured `backend` faster: the call runs on it (where this GPU's torch
    takes it), forward and gradients within the accuracy rule, odd lengths included."""
    from tests.reference import random_qkv, run_and_compare

    gpu, capability = GPU, CAPABILITY
    path = write(tmp_path / "u.sqlite", make_entry(
        gpu=gpu, capability=capability, dtype="bfloat16", head_dim=128, head_dim_v=128,
        mask_variant="causal" if causal else "none", group_size=8 // kv_heads, seqlen_q_bucket=1024,
        seqlen_k_bucket=1024, sdpa_backend=backend, sdpa_ms=1.0))
    use_dispatcher(monkeypatch, Dispatcher(user_db=path, shipped=[]))
    q, k, v = random_qkv(2, 8, kv_heads, 999, 999, 128, 128, dtype=torch.bfloat16, device="cuda")
    kwargs = {"is_causal": causal, "enable_gqa": kv_heads != 8}
    explained = fatune.explain(q, k, v, **kwargs)
    if explained.backend != f"sdpa-{backend}":
        pytest.skip(f"this GPU's torch does not run {backend} here: {explained.reason}")
    record_gpu_errors(run_and_compare(q, k, v, **kwargs))


@pytest.mark.gpu
@pytest.mark.parametrize("backend", sorted(routes.BACKENDS))
def test_gpu_torch_compile_runs_a_routed_call_on_its_backend(tmp_path, monkeypatch, backend, record_gpu_errors):
    """Compiled with inductor, a call a tuned entry routes runs on the backend (fatune's plans never built), its
    output and gradients within the accuracy rule."""
    from fatune.runtime import plans
    from tests.reference import random_qkv, run_and_compare

    path = write(tmp_path / "u.sqlite", make_entry(
        gpu=GPU, capability=CAPABILITY, dtype="bfloat16", head_dim=128, head_dim_v=128, mask_variant="causal",
        group_size=4, seqlen_q_bucket=1024, seqlen_k_bucket=1024, sdpa_backend=backend, sdpa_ms=1.0))
    use_dispatcher(monkeypatch, Dispatcher(user_db=path, shipped=[]))
    q, k, v = random_qkv(2, 8, 2, 999, 999, 128, 128, dtype=torch.bfloat16, device="cuda")
    kwargs = {"is_causal": True, "enable_gqa": True}
    explained = fatune.explain(q, k, v, **kwargs)
    if explained.backend != f"sdpa-{backend}":
        pytest.skip(f"this GPU's torch does not run {backend} here: {explained.reason}")
    plans.clear()
    built = []
    real_prepare = plans.prepare
    monkeypatch.setattr(plans, "prepare", lambda *args: built.append(1) or real_prepare(*args))
    torch._dynamo.reset()
    record_gpu_errors(run_and_compare(q, k, v, attention=torch.compile(fatune.attention, fullgraph=True), **kwargs))
    assert not built, "fatune's plans were built for a routed compiled call"


@pytest.mark.gpu
@pytest.mark.parametrize("deterministic", [False, True])
def test_gpu_a_call_routed_to_cudnn_runs_it_as_sdpa_would_unless_determinism_is_required(
        tmp_path, monkeypatch, deterministic, record_gpu_errors, request):
    """SDPA as it is (where it picks cuDNN itself) or cuDNN's op itself: the same output as SDPA's cuDNN backend,
    bit for bit, and never SDPA with its switches turned. With deterministic algorithms required fatune's kernels
    run instead, within the accuracy rule."""
    from types import SimpleNamespace

    from fatune.runtime import plans
    from tests.reference import random_qkv, run_and_compare

    path = write(tmp_path / "u.sqlite", make_entry(
        gpu=GPU, capability=CAPABILITY, dtype="bfloat16", head_dim=128, head_dim_v=128, mask_variant="causal",
        group_size=4, seqlen_q_bucket=1024, seqlen_k_bucket=1024, sdpa_backend="cudnn", sdpa_ms=1.0))
    use_dispatcher(monkeypatch, Dispatcher(user_db=path, shipped=[]))
    q, k, v = random_qkv(2, 8, 2, 777, 777, 128, 128, dtype=torch.bfloat16, device="cuda")
    kwargs = {"is_causal": True, "enable_gqa": True}
    prepared = plans.prepare_plain(q, k, v, 0.0, True, None, True, (-1, -1), None, None, None, None, None)
    if routes.SWITCHED in prepared.paths:
        pytest.skip(f"this GPU's torch runs cuDNN only through its switches here: {prepared.paths}")
    if deterministic:
        monkeypatch.setitem(routes._OPS, "cudnn", lambda *args, **kwargs: pytest.fail("cuDNN's op ran"))
        request.getfixturevalue("deterministic_algorithms")
        record_gpu_errors(run_and_compare(q, k, v, **kwargs))
        return
    calls = []
    op, sdpa = routes._OPS["cudnn"], F.scaled_dot_product_attention
    monkeypatch.setitem(routes._OPS, "cudnn", lambda *args, **kw: calls.append(("op", args[4])) or op(*args, **kw))
    monkeypatch.setattr(routes, "F", SimpleNamespace(scaled_dot_product_attention=lambda *args, **kw: calls.append(
        ("sdpa", torch.backends.cuda.flash_sdp_enabled())) or sdpa(*args, **kw)))
    with torch.no_grad():
        routed = fatune.attention(q, k, v, **kwargs)
    plans.clear()
    with torch.inference_mode():  # a plan built on inference tensors
        inference = [t.clone() for t in (q, k, v)]
        routed_inference = fatune.attention(*inference, **kwargs)
    with torch.no_grad(), sdpa_kernel(SDPBackend.CUDNN_ATTENTION):
        assert torch.equal(routed, sdpa(q, k, v, **kwargs))
        assert torch.equal(routed_inference, sdpa(*inference, **kwargs))
    assert calls in ([("op", False)] * 2, [("sdpa", True)] * 2), calls  # no log-sum-exp; flash not switched off
    record_gpu_errors(run_and_compare(q, k, v, **kwargs))  # with gradients, through that plan


def test_autocast_and_a_backend_that_refuses_after_all_run_fatunes_kernels(routed_db, monkeypatch, caplog):
    """Under autocast (the inputs already in its dtype) no route is taken: none was measured there. A backend that
    refuses a call after its route was chosen (a switch turned since, say) hands it to fatune's kernels, said
    once."""
    monkeypatch.setattr(routes, "unroutable", lambda *args: None)
    monkeypatch.setitem(routes.BACKENDS, "math", SDPBackend.MATH)
    routed_db("math")
    q, k, v = inputs()
    kernels = fatune.attention(q, k, v, is_causal=True, config=fatune.explain(q, k, v, is_causal=True).decision.config)
    runs = []
    real_run = routes.run
    monkeypatch.setattr(routes, "run", lambda *args: runs.append(args[0]) or real_run(*args))
    with torch.autocast("cpu", dtype=torch.float16):
        assert torch.equal(fatune.attention(q, k, v, is_causal=True), kernels)
    assert runs == []

    monkeypatch.setattr(routes.F, "scaled_dot_product_attention", raising(RuntimeError("No available kernel.")))
    assert_kernels_run_said_once((q, k, v), kernels, caplog, "refused a call")
    assert runs == ["math", "math"]


def raising(error: Exception):
    def fail(*args, **kwargs):
        raise error
    return fail


def assert_kernels_run_said_once(qkv, kernels, caplog, said: str) -> None:
    """Two calls run fatune's kernels (their output is `kernels`), with one log line that says `said`."""
    with caplog.at_level(logging.WARNING, logger="fatune"):
        for _ in range(2):
            assert torch.equal(fatune.attention(*qkv, is_causal=True), kernels)
    assert len([r for r in caplog.records if said in r.message]) == 1


@pytest.fixture
def direct_cudnn(routed_db, monkeypatch):
    """A route to cuDNN that calls its op itself, the op played by SDPA's math backend (the one this CPU has);
    the arguments of each call are recorded."""
    calls = []

    def op(query, key, value, attn_bias, compute_log_sumexp, dropout_p, is_causal, return_debug_mask, *, scale):
        calls.append((attn_bias, compute_log_sumexp, dropout_p, is_causal, return_debug_mask, scale))
        with sdpa_kernel(SDPBackend.MATH):
            return (F.scaled_dot_product_attention(query, key, value, dropout_p=dropout_p, is_causal=is_causal,
                                                   scale=scale), None)

    monkeypatch.setattr(routes, "unroutable", lambda *args: None)
    monkeypatch.setattr(routes, "_takes", lambda *args: True)
    monkeypatch.setattr(routes, "_sdpa_choice", lambda *args, **kwargs: int(SDPBackend.MATH))  # not cuDNN
    monkeypatch.setitem(routes._OPS, "cudnn", op)
    routed_db("cudnn")
    return calls


def test_a_call_routed_to_cudnn_calls_its_op_as_sdpa_would(direct_cudnn):
    """The op computes the log-sum-exp (which its backward reads) only where autograd records the call; the
    gradients are the op's own."""
    q, k, v = inputs()
    with torch.no_grad():
        fatune.attention(q, k, v, is_causal=True, scale=0.3)
    out = fatune.attention(q, k, v, is_causal=True, scale=0.3)
    out.float().sum().backward()
    assert direct_cudnn == [(None, False, 0.0, True, False, 0.3), (None, True, 0.0, True, False, 0.3)]
    expected = [t.detach().clone().requires_grad_() for t in (q, k, v)]
    with sdpa_kernel(SDPBackend.MATH):
        reference = F.scaled_dot_product_attention(*expected, is_causal=True, scale=0.3)
    reference.float().sum().backward()
    assert torch.equal(out, reference)
    for got, want in zip((q, k, v), expected):
        assert torch.equal(got.grad, want.grad)


@pytest.mark.parametrize("warn_only", [False, True])
def test_deterministic_mode_and_a_refusing_op_leave_cudnn_for_fatunes_kernels(direct_cudnn, monkeypatch, caplog,
                                                                               warn_only):
    """cuDNN's attention is not deterministic: with deterministic algorithms on (warnings only too, where
    fatune's kernels take their deterministic paths as well) fatune's kernels run. An op that raises hands its
    call signature to them for good, said once; running out of memory or a failed device is the caller's to
    know."""
    q, k, v = inputs()
    kernels = fatune.attention(q, k, v, is_causal=True, config=fatune.explain(q, k, v, is_causal=True).decision.config)
    torch.use_deterministic_algorithms(True, warn_only=warn_only)
    try:
        assert torch.equal(fatune.attention(q, k, v, is_causal=True), kernels) and direct_cudnn == []
    finally:
        torch.use_deterministic_algorithms(False)
    fatune.attention(q, k, v, is_causal=True)
    assert len(direct_cudnn) == 1
    for error in (torch.OutOfMemoryError("CUDA out of memory"), torch.AcceleratorError("illegal memory access")):
        monkeypatch.setitem(routes._OPS, "cudnn", raising(error))
        with pytest.raises(type(error)):
            fatune.attention(q, k, v, is_causal=True)
    tries = []
    refuse = raising(RuntimeError("cuDNN Frontend error: no valid engine configs"))
    monkeypatch.setitem(routes._OPS, "cudnn", lambda *args, **kwargs: tries.append(1) or refuse())
    assert_kernels_run_said_once((q, k, v), kernels, caplog, "raised on a call routed to it")
    assert len(tries) == 1 and fatune.explain(q, k, v, is_causal=True).backend != "sdpa-cudnn"


OP, SDPA, SWITCHED, KERNELS = routes.OP, routes.SDPA, routes.SWITCHED, routes.KERNELS
INFERENCE = RuntimeError("inference tensors cannot require grad")


# (SDPA's pick without gradients and with, whether cuDNN takes the tensors without and with, the paths)
@pytest.mark.parametrize("picks, takes, expected", [
    (("cudnn", "cudnn"), (True, True), (SDPA, SDPA)),  # SDPA as it is, where it picks cuDNN itself
    (("flash", "flash"), (True, True), (OP, OP)),
    (("cudnn", "flash"), (True, True), (SDPA, OP)),
    (("flash", "flash"), (True, False), (OP, KERNELS)),  # cuDNN takes the call, not its backward (nor would SDPA)
    (("cudnn", INFERENCE), (True, INFERENCE), (SDPA, SWITCHED)),  # a plan built on inference tensors: SDPA decides
    (("flash", "flash"), (True, INFERENCE), (OP, SWITCHED)),
    (("flash", "flash"), (False, True), (KERNELS, OP)),
    (("flash", "flash"), (None, True), (SWITCHED, OP)),  # a torch that cannot say: SDPA decides per call
])
def test_a_routed_call_reaches_its_backend_the_cheapest_way_that_takes_it(monkeypatch, picks, takes, expected):
    def answer(options, grad):
        if isinstance(options[grad], Exception):
            raise options[grad]
        return options[grad]

    # SDPA wants gradients where grad mode is on and an input requires them; the plan may be built under no_grad
    monkeypatch.setattr(routes, "_sdpa_choice", lambda q, *args, **kwargs: int(
        routes.BACKENDS[answer(picks, torch.is_grad_enabled() and q.requires_grad)]))
    monkeypatch.setattr(routes, "_takes", lambda backend, problem, q, k, v: answer(
        takes, torch.is_grad_enabled() and q.requires_grad))
    monkeypatch.setitem(routes._OPS, "cudnn", object())
    problem, q = _problem(is_causal=True)
    assert routes.paths("cudnn", problem, q, q, q) == expected
    with torch.no_grad():
        assert routes.paths("cudnn", problem, q, q, q) == expected
    flash = tuple(SDPA if pick == "flash" else SWITCHED for pick in picks)  # without an op of its own
    monkeypatch.delitem(routes._OPS, "flash", raising=False)
    assert routes.paths("flash", problem, q, q, q) == flash
    # a torch that cannot say what SDPA picks, or asks otherwise: the op where it takes the call
    without_choice = tuple(OP if took is True else KERNELS if took is False else SWITCHED for took in takes)
    monkeypatch.setattr(routes, "_sdpa_choice", raising(TypeError("unexpected keyword argument 'enable_gqa'")))
    assert routes.paths("cudnn", problem, q, q, q) == without_choice
    monkeypatch.setattr(routes, "_sdpa_choice", None)
    assert routes.paths("cudnn", problem, q, q, q) == without_choice


def test_what_sdpa_picks_is_asked_with_every_backend_switched_on(monkeypatch):
    """A plan built inside the caller's sdpa_kernel context records what SDPA picks outside it (here: flash
    before cuDNN), and leaves the context's switches as they were. This torch's own answer is an SDPBackend."""
    problem, q = _problem(is_causal=True)
    assert routes._default_choice(problem, q, q, q) in {int(backend) for backend in SDPBackend.__members__.values()}
    monkeypatch.setattr(routes, "_sdpa_choice", lambda *args, **kwargs: int(
        SDPBackend.FLASH_ATTENTION if torch.backends.cuda.flash_sdp_enabled() else SDPBackend.CUDNN_ATTENTION))
    monkeypatch.setattr(routes, "_takes", lambda *args: True)
    monkeypatch.setitem(routes._OPS, "cudnn", object())
    with sdpa_kernel(SDPBackend.CUDNN_ATTENTION):
        assert routes.paths("cudnn", problem, q, q, q) == (OP, OP)
        assert not torch.backends.cuda.flash_sdp_enabled() and torch.backends.cuda.cudnn_sdp_enabled()
    assert routes.paths("flash", problem, q, q, q) == (SDPA, SDPA)


def test_a_call_routed_to_the_backend_sdpa_picks_itself_calls_sdpa_as_it_is(direct_cudnn, monkeypatch):
    """No switch turned, no op of the backend's: SDPA decides per call (on this CPU it runs its own backend). With
    deterministic algorithms required, SDPA switched to the backend alone, which refuses (fatune's kernels run)."""
    monkeypatch.setattr(routes, "_sdpa_choice", lambda *args, **kwargs: int(SDPBackend.CUDNN_ATTENTION))
    switches = []  # backends switched off for a call (the plan's question to SDPA switches them all on)

    def spied(setter):
        def switch(on: bool) -> None:
            if not on:
                switches.append(setter)
            setter(on)
        return switch

    monkeypatch.setattr(routes, "_SWITCHES", {name: (getter, spied(setter))
                                              for name, (getter, setter) in routes._SWITCHES.items()})
    q, k, v = inputs()
    out = fatune.attention(q, k, v, is_causal=True, scale=0.3)
    expected = [t.detach().clone().requires_grad_() for t in (q, k, v)]
    reference = F.scaled_dot_product_attention(*expected, is_causal=True, scale=0.3)
    assert torch.equal(out, reference) and direct_cudnn == [] and switches == []
    out.float().sum().backward()
    reference.float().sum().backward()
    for got, want in zip((q, k, v), expected):
        assert torch.equal(got.grad, want.grad)
    kernels = fatune.attention(q, k, v, is_causal=True, config=fatune.explain(q, k, v, is_causal=True).decision.config)
    # the caller switched cuDNN off: the route still runs it, through its op (no switch turned)
    with sdpa_kernel(SDPBackend.MATH):
        assert torch.equal(fatune.attention(q, k, v, is_causal=True), F.scaled_dot_product_attention(
            q, k, v, is_causal=True)) and len(direct_cudnn) == 1
    assert switches == []
    # a torch without cuDNN's op: switched to it alone (which refuses on this CPU)
    monkeypatch.delitem(routes._OPS, "cudnn")
    with sdpa_kernel(SDPBackend.MATH):
        assert torch.equal(fatune.attention(q, k, v, is_causal=True), kernels) and switches
    switches.clear()
    monkeypatch.setattr(routes, "_deterministic", lambda: True)  # deterministic algorithms: no route
    assert torch.equal(fatune.attention(q, k, v, is_causal=True), kernels) and switches == []


def test_a_call_that_wants_gradients_cudnn_does_not_take_so_goes_through_sdpa(direct_cudnn, monkeypatch, caplog):
    """Through SDPA, which decides per call (on this CPU it refuses: fatune's kernels run, said once)."""
    monkeypatch.setattr(routes, "paths", lambda *args: (routes.OP, routes.SWITCHED))
    q, k, v = inputs()
    with torch.no_grad():
        fatune.attention(q, k, v, is_causal=True)
    with caplog.at_level(logging.WARNING, logger="fatune"):
        fatune.attention(q, k, v, is_causal=True)
    assert len(direct_cudnn) == 1 and direct_cudnn[0][1] is False
    assert [r for r in caplog.records if "SDPA's cudnn backend refused a call" in r.message]


def test_a_call_that_wants_gradients_the_op_does_not_take_runs_fatunes_kernels_untried(direct_cudnn, monkeypatch,
                                                                                      caplog):
    """Where the backend's op does not take such tensors with gradients (nor would SDPA), such calls run fatune's
    kernels without trying the backend each time, and explain says so; calls without gradients take the op."""
    monkeypatch.setattr(routes, "paths", lambda *args: (routes.OP, routes.KERNELS))
    sdpa, tried = routes.F.scaled_dot_product_attention, []
    monkeypatch.setattr(routes.F, "scaled_dot_product_attention",
                        lambda *args, **kwargs: tried.append(1) or sdpa(*args, **kwargs))
    q, k, v = inputs()
    kernels = fatune.attention(q, k, v, is_causal=True, config=fatune.explain(q, k, v, is_causal=True).decision.config)
    with caplog.at_level(logging.WARNING, logger="fatune"):
        assert torch.equal(fatune.attention(q, k, v, is_causal=True), kernels)
    assert direct_cudnn == [] and tried == [] and not [r for r in caplog.records if "SDPA" in r.message]
    explained = fatune.explain(q, k, v, is_causal=True)
    assert explained.backend != "sdpa-cudnn" and "its op does not take these tensors with gradients" in explained.reason
    with torch.no_grad():
        fatune.attention(q, k, v, is_causal=True)
        assert fatune.explain(q, k, v, is_causal=True).backend == "sdpa-cudnn"
    assert len(direct_cudnn) == 1


def test_a_call_whose_route_refuses_tries_it_once_whatever_its_alignment(direct_cudnn, monkeypatch):
    """Data aligned otherwise than the plan's takes the full key's plan: the route refused on the way is not
    tried a second time."""
    q, k, v = inputs()
    fatune.attention(q, k, v, is_causal=True)
    shifted = torch.empty(v.numel() + 1, dtype=v.dtype)[1:].view(v.shape).copy_(v)
    monkeypatch.setitem(routes._OPS, "cudnn", raising(RuntimeError("cuDNN Frontend error")))  # fatune's kernels run
    monkeypatch.setattr(routes, "paths", lambda *args: (routes.OP, routes.OP))
    runs = []
    real_run = routes.run
    monkeypatch.setattr(routes, "run", lambda *args: runs.append(args[0]) or real_run(*args))
    expected = fatune.attention(q, k, v, is_causal=True, config=fatune.explain(q, k, v, is_causal=True).decision.config)
    assert torch.equal(fatune.attention(q, k, shifted, is_causal=True), expected) and runs == ["cudnn"]


# a tuned entry's forward (ms) and the problem it timed; the margin the route was measured faster by; the call
# (B, H, L_q, L_k): host-bound or not
TIMED = {"fwd_ms": 0.165, "batch": 32, "heads": 32, "seqlen_q": 512, "seqlen_k": 512}
HOST_BOUND = [
    (TIMED, 1.03, (1, 8, 128, 128), True),  # 0.08 us predicted
    (TIMED, 1.03, (32, 32, 512, 512), False),  # the timed problem itself: 165 us
    (TIMED, 1.03, (1, 32, 512, 512), True),  # 5.2 us, 0.15 us of it at stake
    (TIMED, 1.2, (1, 32, 512, 512), True),  # 0.9 us at stake
    (TIMED, 3.0, (1, 32, 512, 512), False),  # 3.4 us at stake: the route saves more GPU time than host time
    (TIMED, 3.0, (1, 8, 128, 128), True),
    (TIMED, 1.03, (1, 16, 1024, 1024), False),  # 10.3 us
    (TIMED, math.nan, (1, 8, 128, 128), False),
    (TIMED, 0.5, (1, 8, 128, 128), False),  # no route is slower than fatune
    ({**TIMED, "fwd_ms": math.nan}, 1.03, (1, 8, 128, 128), False),  # what the entry cannot say decides nothing
    ({**TIMED, "fwd_ms": math.inf}, 1.03, (1, 8, 128, 128), False),
    ({**TIMED, "fwd_ms": -1.0}, 1.03, (1, 8, 128, 128), False),
    ({**TIMED, "fwd_ms": "0.1"}, 1.03, (1, 8, 128, 128), False),
    ({**TIMED, "batch": 0}, 1.03, (1, 8, 128, 128), False),  # an entry that does not store its problem
    ({**TIMED, "batch": "ab"}, 1.03, (1, 8, 128, 128), False),  # untrusted: never a string repeated
    ({**TIMED, "heads": 2.5}, 1.03, (1, 8, 128, 128), False),
    ({k: v for k, v in TIMED.items() if k != "seqlen_k"}, 1.03, (1, 8, 128, 128), False),
    (None, 1.03, (1, 8, 128, 128), False),
]


@pytest.mark.parametrize("entry, margin, call, expected", HOST_BOUND)
def test_a_call_is_host_bound_where_its_forward_and_the_gpu_time_at_stake_are_small(entry, margin, call, expected):
    batch, heads, seqlen_q, seqlen_k = call
    q = torch.empty(batch, heads, seqlen_q, 64, device="meta", dtype=torch.bfloat16)
    k = torch.empty(batch, heads, seqlen_k, 64, device="meta", dtype=torch.bfloat16)
    assert routes.host_bound(entry, margin, check_inputs(q, k, k, is_causal=True)) is expected


def test_a_host_bound_call_without_gradients_runs_fatunes_kernels_and_one_with_them_the_route(direct_cudnn,
                                                                                               routed_db, monkeypatch):
    """A call whose forward the entry predicts too short to pay a route's host cost: without gradients fatune's
    kernels run (their launch costs the host less), and explain says so; with gradients, or while a CUDA graph
    captures it (a replay costs no host time), the route runs. An entry that predicts a longer forward routes
    both."""
    routed_db("cudnn", fwd_ms=0.165, batch=32, heads=32, seqlen_q=512, seqlen_k=512)  # sdpa_ms 1.0: margin 3
    q, k, v = inputs()
    with torch.no_grad():
        config = fatune.explain(q, k, v, is_causal=True).decision.config
        kernels = fatune.attention(q, k, v, is_causal=True, config=config)
        assert torch.equal(fatune.attention(q, k, v, is_causal=True), kernels) and direct_cudnn == []
        explained = fatune.explain(q, k, v, is_causal=True)
        assert explained.backend == "triton-interpreter" and "host-bound" in explained.reason
        with monkeypatch.context() as capturing:
            capturing.setattr(routes, "_capturing", lambda query: True)
            fatune.attention(q, k, v, is_causal=True)
        assert direct_cudnn == [(None, False, 0.0, True, False, None)]
    out = fatune.attention(q, k, v, is_causal=True)
    assert len(direct_cudnn) == 2 and direct_cudnn[1][1] is True  # the op, with its log-sum-exp for the backward
    out.float().sum().backward()
    assert fatune.explain(q, k, v, is_causal=True).backend == "sdpa-cudnn"
    routed_db("cudnn", fwd_ms=0.165, batch=1, heads=2, seqlen_q=64, seqlen_k=64)  # 92 us predicted: routed
    with torch.no_grad():
        fatune.attention(q, k, v, is_causal=True)
        assert fatune.explain(q, k, v, is_causal=True).backend == "sdpa-cudnn"
    assert len(direct_cudnn) == 3 and direct_cudnn[2][1] is False


def test_each_backend_has_its_op_called_as_sdpa_calls_it(monkeypatch):
    """Each backend's op (flash's and the memory-efficient one's behind cuDNN's arguments) gets the call's
    arguments as SDPA passes them once it has chosen that backend."""
    calls = []
    monkeypatch.setattr(torch, "_scaled_dot_product_flash_attention",
                        lambda *args, **kwargs: calls.append(("flash", args[3:], kwargs)) or ("out",))
    monkeypatch.setattr(torch, "_scaled_dot_product_efficient_attention",
                        lambda *args, **kwargs: calls.append(("efficient", args[3:], kwargs)) or ("out",))
    flash = routes._flash_op(torch._scaled_dot_product_flash_attention)
    efficient = routes._efficient_op(torch._scaled_dot_product_efficient_attention)
    q = torch.zeros(1)
    assert flash(q, q, q, None, True, 0.1, True, False, scale=0.5)[0] == "out"
    assert efficient(q, q, q, None, False, 0.1, True, False, scale=0.5)[0] == "out"
    assert calls == [("flash", (0.1, True, False), {"scale": 0.5}),
                     ("efficient", (None, False, 0.1, True), {"scale": 0.5})]
    assert {"cudnn", "flash", "efficient"} <= set(routes._OPS)  # this torch has all three


@pytest.mark.parametrize("path", [routes.OP, routes.SDPA, routes.SWITCHED])
@pytest.mark.parametrize("error", [RuntimeError("cuDNN Frontend error: no valid engine configs"),
                                   TypeError("scaled_dot_product_attention(): argument 'scale' must be float")])
def test_a_backend_that_raises_hands_its_call_signature_to_fatunes_kernels(direct_cudnn, monkeypatch, caplog, path,
                                                                           error):
    """Whatever path reaches the backend, an error of the backend's (not a refusal SDPA may take back, nor the
    device's) runs fatune's kernels for that call signature from now on, said once; the backend is tried once."""
    q, k, v = inputs()
    kernels = fatune.attention(q, k, v, is_causal=True, config=fatune.explain(q, k, v, is_causal=True).decision.config)
    monkeypatch.setattr(routes, "paths", lambda *args: (path, path))
    tries = []
    failing = raising(error)
    monkeypatch.setitem(routes._OPS, "cudnn", lambda *args, **kwargs: tries.append(1) or failing())
    monkeypatch.setattr(routes.F, "scaled_dot_product_attention", lambda *args, **kwargs: tries.append(1) or failing())
    monkeypatch.setattr(routes, "_SWITCHES", {name: (lambda: True, lambda on: None) for name in routes._SWITCHES})
    assert_kernels_run_said_once((q, k, v), kernels, caplog, "raised on a call routed to it")
    assert len(tries) == 1


def test_a_routed_call_takes_any_real_scale_and_dropout_as_floats(direct_cudnn):
    """A scale or dropout fatune takes (any real number) reaches the backend as the Python float SDPA takes."""
    from fractions import Fraction

    q, k, v = inputs()
    with torch.no_grad():
        fatune.attention(q, k, v, is_causal=True, scale=Fraction(1, 4), dropout_p=Fraction(0))
    assert direct_cudnn == [(None, False, 0.0, True, False, 0.25)]
    assert all(type(value) is float for value in direct_cudnn[0][2::3])


def test_a_routed_calls_output_has_the_layout_fatunes_kernels_give_it(direct_cudnn):
    """Queries viewed from (B, L, H, D) memory: the output is such a view too, as from fatune's kernels, however
    the backend lays it out (here: contiguous), and the gradients pass through the copy."""
    torch.manual_seed(1)
    q, k, v = (torch.randn(1, 48, 2, 32, dtype=torch.float16, device=DEVICE).transpose(1, 2).requires_grad_()
               for _ in range(3))
    kernels = fatune.attention(q, k, v, is_causal=True, config=fatune.explain(q, k, v, is_causal=True).decision.config)
    out = fatune.attention(q, k, v, is_causal=True)
    assert len(direct_cudnn) == 1 and out.stride() == kernels.stride() == q.stride()
    out.transpose(1, 2).view(1, 48, 64)  # a free view, as of fatune's kernels' output
    out.float().sum().backward()
    expected = [t.detach().clone().requires_grad_() for t in (q, k, v)]
    with sdpa_kernel(SDPBackend.MATH):
        F.scaled_dot_product_attention(*expected, is_causal=True).float().sum().backward()
    for got, want in zip((q, k, v), expected):
        assert torch.equal(got.grad, want.grad)
    contiguous = [t.detach().contiguous() for t in (q, k, v)]
    with torch.no_grad():
        routed = fatune.attention(*contiguous, is_causal=True)
    assert routed.is_contiguous()


def test_explain_says_when_a_route_is_not_taken(direct_cudnn):
    """Under autocast and deterministic algorithms a routed key runs fatune's kernels: explain says so."""
    q, k, v = inputs()
    assert fatune.explain(q, k, v, is_causal=True).backend == "sdpa-cudnn"
    with torch.autocast("cpu", dtype=torch.float16):
        explained = fatune.explain(q, k, v, is_causal=True)
    assert explained.backend != "sdpa-cudnn" and "not routed to SDPA's cudnn backend: autocast is on" in str(explained)
    torch.use_deterministic_algorithms(True, warn_only=True)
    try:
        explained = fatune.explain(q, k, v, is_causal=True)
    finally:
        torch.use_deterministic_algorithms(False)
    assert explained.backend != "sdpa-cudnn" and "deterministic algorithms are on" in explained.reason


def test_a_plan_built_under_deterministic_algorithms_takes_its_route_once_they_are_off(direct_cudnn, monkeypatch):
    """The first call of a key under deterministic algorithms runs fatune's kernels and leaves the route
    undecided (torch's can_use_* refuse cuDNN then): once they are off, the key's calls take the route."""
    refused = lambda *args, **kwargs: torch.are_deterministic_algorithms_enabled()  # noqa: E731
    monkeypatch.setattr(routes, "unroutable", lambda *args: "does not take these tensors here" if refused() else None)
    monkeypatch.setattr(routes, "_takes", lambda *args, **kwargs: not refused())
    q, k, v = inputs()
    torch.use_deterministic_algorithms(True)
    try:
        fatune.attention(q, k, v, is_causal=True)
        explained = fatune.explain(q, k, v, is_causal=True)
    finally:
        torch.use_deterministic_algorithms(False)
    assert direct_cudnn == [] and "not routed to SDPA's cudnn backend: deterministic algorithms" in explained.reason
    fatune.attention(q, k, v, is_causal=True)
    assert len(direct_cudnn) == 1 and fatune.explain(q, k, v, is_causal=True).backend == "sdpa-cudnn"


def test_whether_a_backend_takes_a_call_is_asked_with_every_backend_switched_on(monkeypatch):
    """A plan built inside the caller's sdpa_kernel context (which switches the route's backend off, and torch's
    can_use_* with it) still learns whether the backend takes the call; the context's switches stay as they
    were."""
    monkeypatch.setattr(torch.backends.cuda, "can_use_cudnn_attention",
                        lambda params, debug=False: torch.backends.cuda.cudnn_sdp_enabled())
    problem, q = _problem(is_causal=True)
    with sdpa_kernel(SDPBackend.MATH):
        assert routes._takes("cudnn", problem, q, q, q) is True
        assert not torch.backends.cuda.cudnn_sdp_enabled() and not torch.backends.cuda.flash_sdp_enabled()
    assert torch.backends.cuda.cudnn_sdp_enabled()
