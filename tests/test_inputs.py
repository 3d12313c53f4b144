"""Bad input gets a clear error naming the argument; CPU tensors fall back (or raise in strict mode)."""

from __future__ import annotations

import logging
import re
import sys

import numpy as np
import pytest
import torch

import fatune
import fatune.runtime.plans as plans
from fatune import logs, settings
from fatune.call import check_contents, check_inputs
from fatune.kernel import codegen as loader
from fatune.runtime.plans import FallbackError
from tests.conftest import DEVICE


def qkv(b=2, h=4, hkv=4, lq=16, lk=16, d=32, dv=32, dtype=torch.float16, device=DEVICE):
    return (torch.randn(b, h, lq, d, dtype=dtype, device=device), torch.randn(b, hkv, lk, d, dtype=dtype, device=device),
            torch.randn(b, hkv, lk, dv, dtype=dtype, device=device))


def i32(values):
    return torch.tensor(values, dtype=torch.int32, device=DEVICE)


def _packed_qkv():
    return (torch.randn(10, 2, 16, dtype=torch.float16, device=DEVICE),
            torch.randn(12, 2, 16, dtype=torch.float16, device=DEVICE),
            torch.randn(12, 2, 16, dtype=torch.float16, device=DEVICE))


# (case id, (q, k, v) factory, kwargs, error type, text the message must contain)
BAD_INPUTS = [
    ("not-a-tensor", lambda: ([1.0], *qkv()[1:]), {}, TypeError, "query"),
    ("3d-query", lambda: (qkv()[0][0], *qkv()[1:]), {}, ValueError, "query"),
    ("int-dtype", lambda: tuple(t.to(torch.int32) for t in qkv()), {}, TypeError, "query"),
    ("float64", lambda: tuple(t.double() for t in qkv()), {}, TypeError, "float16, bfloat16 or float32"),
    ("dtype-mismatch", lambda: (qkv()[0], qkv()[1].float(), qkv()[2]), {}, TypeError, "key"),
    ("batch-mismatch", lambda: (qkv()[0], *qkv(b=3)[1:]), {}, ValueError, "batch"),
    ("heads-mismatch", lambda: qkv(hkv=2), {}, ValueError, "enable_gqa"),
    ("gqa-not-multiple", lambda: qkv(h=4, hkv=3), {"enable_gqa": True}, ValueError, "multiple"),
    ("key-head-dim", lambda: (qkv()[0], qkv(d=16)[1], qkv()[2]), {}, ValueError, "key"),
    ("head-dim-0", lambda: qkv(d=0, dv=0), {}, ValueError, "head dim"),
    ("head-dim-300", lambda: qkv(d=300, dv=300), {}, ValueError, "head dim in 1..256"),
    ("value-length", lambda: (*qkv()[:2], qkv(lk=9)[2]), {}, ValueError, "value"),
    ("mask-shape", lambda: qkv(), {"attn_mask": torch.ones(3, 16, 16, dtype=torch.bool)}, ValueError, "attn_mask"),
    ("mask-dtype", lambda: qkv(), {"attn_mask": torch.ones(16, 16, dtype=torch.int64)}, TypeError, "attn_mask"),
    ("mask-type", lambda: qkv(), {"attn_mask": [[True]]}, TypeError, "attn_mask"),
    ("window-below-minus-1", lambda: qkv(), {"window_size": (-2, 0)}, ValueError, "window_size"),
    ("window-not-pair", lambda: qkv(), {"window_size": 4}, TypeError, "window_size"),
    ("alignment", lambda: qkv(), {"is_causal": True, "causal_alignment": "middle"}, ValueError, "causal_alignment"),
    ("dropout-1", lambda: qkv(), {"dropout_p": 1.0}, ValueError, "dropout_p"),
    ("scale-nan", lambda: qkv(), {"scale": float("nan")}, TypeError, "scale"),
    ("scale-past-float32", lambda: qkv(), {"scale": 2.4e38}, ValueError, "scale: expected a magnitude"),
    ("alibi-shape", lambda: qkv(), {"alibi_slopes": torch.ones(3)}, ValueError, "alibi_slopes"),
    ("alibi-dtype", lambda: qkv(), {"alibi_slopes": torch.ones(4, dtype=torch.float16)}, TypeError, "alibi_slopes"),
    ("seqlens-int64", lambda: qkv(), {"seqlens_k": torch.tensor([3, 4])}, TypeError, "seqlens_k"),
    ("seqlens-too-long", lambda: qkv(), {"seqlens_k": i32([3, 40])}, ValueError, "seqlens_k"),
    ("cu-not-int32", _packed_qkv, {"cu_seqlens_q": torch.tensor([0, 4, 10]), "cu_seqlens_k": i32([0, 5, 12])},
     TypeError, "cu_seqlens_q"),
    ("cu-not-monotone", _packed_qkv, {"cu_seqlens_q": i32([0, 7, 3, 10]), "cu_seqlens_k": i32([0, 5, 6, 12])},
     ValueError, "cu_seqlens_q"),
    ("cu-wrong-total", _packed_qkv, {"cu_seqlens_q": i32([0, 4, 9]), "cu_seqlens_k": i32([0, 5, 12])},
     ValueError, "cu_seqlens_q"),
    ("cu-only-q", _packed_qkv, {"cu_seqlens_q": i32([0, 4, 10])}, ValueError, "cu_seqlens_k"),
    ("cu-count-mismatch", _packed_qkv, {"cu_seqlens_q": i32([0, 4, 10]), "cu_seqlens_k": i32([0, 5, 6, 12])},
     ValueError, "cu_seqlens_k"),
    # flags are bools, as torch's SDPA takes them: is_causal="False" must not turn causal attention on
    ("is-causal-str", lambda: qkv(), {"is_causal": "False"}, TypeError, "is_causal"),
    ("is-causal-int", lambda: qkv(), {"is_causal": 1}, TypeError, "is_causal"),
    ("enable-gqa-str", lambda: qkv(), {"enable_gqa": "yes"}, TypeError, "enable_gqa"),
    ("strict-str", lambda: qkv(), {"strict": "off"}, TypeError, "strict"),
    ("window-float", lambda: qkv(), {"window_size": (1.5, 0)}, TypeError, "window_size"),
    ("alibi-requires-grad", lambda: qkv(), {"alibi_slopes": torch.ones(4, requires_grad=True)}, ValueError,
     "alibi_slopes"),
    ("max-seqlen-k-unpacked", lambda: qkv(), {"max_seqlen_k": 16}, ValueError, "max_seqlen_k: only used with packed"),
    ("max-seqlen-too-small", _packed_qkv, {"cu_seqlens_q": i32([0, 4, 10]), "cu_seqlens_k": i32([0, 5, 12]),
                                           "max_seqlen_q": 3}, ValueError, "max_seqlen_q"),
    # the type is what is wrong, and the message says so (not "too small")
    ("max-seqlen-numpy", _packed_qkv, {"cu_seqlens_q": i32([0, 4, 10]), "cu_seqlens_k": i32([0, 5, 12]),
                                       "max_seqlen_q": np.int64(6)}, TypeError, "max_seqlen_q: expected a Python int"),
]


@pytest.mark.parametrize("make, kwargs, error, text", [case[1:] for case in BAD_INPUTS],
                         ids=[case[0] for case in BAD_INPUTS])
def test_bad_input_names_the_argument(make, kwargs, error, text):
    q, k, v = make()
    with pytest.raises(error, match=text):
        fatune.attention(q, k, v, **kwargs)


# the options torch.compile's path checks before they become the custom op's typed arguments
COMPILED_OPTIONS = [case for case in BAD_INPUTS if case[0] in (
    "is-causal-str", "is-causal-int", "enable-gqa-str", "window-float", "window-below-minus-1", "window-not-pair",
    "alignment", "dropout-1", "scale-nan", "scale-past-float32")]


@pytest.mark.parametrize("make, kwargs, error, text", [case[1:] for case in COMPILED_OPTIONS],
                         ids=[case[0] for case in COMPILED_OPTIONS])
def test_the_compiled_path_checks_options_as_eager_does(make, kwargs, error, text):
    """What torch.compile traces (fatune.ops.attention) refuses what eager refuses, before an option could
    be turned into the op's bool, int or float (is_causal="False" into True, a window of 1.5 into 1)."""
    q, k, v = make()
    with pytest.raises(error, match=text):
        fatune.ops.attention(q, k, v, plans.Call(**kwargs), None)


def test_mismatched_devices_name_the_argument():
    q, k, v = qkv(device="cpu")
    k = k.to("meta")
    with pytest.raises(ValueError, match="key: expected a tensor on cpu"):
        fatune.attention(q, k, v)


def test_additive_mask_requiring_grad_is_refused():
    q, k, v = qkv()
    mask = torch.zeros(16, 16, dtype=torch.float16, device=DEVICE, requires_grad=True)
    with pytest.raises(ValueError, match="attn_mask"):
        fatune.attention(q, k, v, attn_mask=mask)


@pytest.fixture
def no_gpu_no_interpreter(monkeypatch):
    monkeypatch.setattr(plans, "interpreting", lambda: False)
    monkeypatch.setattr(logs, "_warned", set())
    monkeypatch.setattr(plans, "_plans", {})
    monkeypatch.delenv(settings.STRICT_ENV, raising=False)


def test_cpu_tensors_fall_back_with_one_logged_reason(no_gpu_no_interpreter, caplog):
    q, k, v = qkv(device="cpu", dtype=torch.float32)
    with caplog.at_level(logging.WARNING, logger="fatune"):
        out = fatune.attention(q, k, v, is_causal=True, window_size=(4, 0))
        fatune.attention(q, k, v, is_causal=True, window_size=(4, 0))
    assert len([r for r in caplog.records if "falls back" in r.message]) == 1
    keep = torch.ones(16, 16, dtype=torch.bool).tril().triu(-4)
    expected = torch.nn.functional.scaled_dot_product_attention(q, k, v, attn_mask=keep)
    torch.testing.assert_close(out, expected)


@pytest.mark.parametrize("how", ["argument", "environment"])
def test_strict_mode_raises_instead_of_falling_back(how, no_gpu_no_interpreter, monkeypatch):
    q, k, v = qkv(device="cpu")
    kwargs = {"strict": True} if how == "argument" else {}
    if how == "environment":
        monkeypatch.setenv(settings.STRICT_ENV, "1")
    with pytest.raises(FallbackError, match="strict"):
        fatune.attention(q, k, v, **kwargs)


# Inputs that are odd but valid: fatune computes what they mean, never overflows or crashes.
# (case id, kwargs, kwargs of the equivalent call)
EQUIVALENT_CALLS = [
    ("window-right-maxsize", {"window_size": (-1, sys.maxsize)}, {}),
    ("window-left-2**64", {"window_size": (2**64, -1)}, {}),
    ("window-both-huge", {"window_size": (2**63, 2**63)}, {}),
    ("causal-window-huge", {"is_causal": True, "window_size": (2**70, 0)}, {"is_causal": True,
                                                                            "causal_alignment": "bottom_right"}),
    ("scale-numpy-float32", {"scale": np.float32(0.5)}, {"scale": 0.5}),
    ("scale-numpy-float64", {"scale": np.float64(0.5)}, {"scale": 0.5}),
    ("scale-int", {"scale": 1}, {"scale": 1.0}),
]


@pytest.mark.parametrize("kwargs, same_as", [case[1:] for case in EQUIVALENT_CALLS],
                         ids=[case[0] for case in EQUIVALENT_CALLS])
def test_odd_but_valid_arguments_mean_what_they_say(kwargs, same_as):
    q, k, v = qkv(lq=20, lk=24)
    torch.testing.assert_close(fatune.attention(q, k, v, **kwargs), fatune.attention(q, k, v, **same_as),
                               rtol=0, atol=0)


def test_a_numpy_dropout_rate_drops_out_as_a_float_does():
    """A rate out of numpy (a float subclass SDPA takes) crashed generating the kernels (numpy's bool in the spec)."""
    q, k, v = qkv(lq=20, lk=24)
    outs = []
    for rate in (np.float64(0.0), np.float64(0.25), np.float32(0.25), 0.25):
        plans.clear()  # each rate's plan built from it
        torch.manual_seed(3)
        outs.append(fatune.attention(q, k, v, dropout_p=rate))
    torch.testing.assert_close(outs[0], fatune.attention(q, k, v), rtol=0, atol=0)
    for out in outs[1:3]:
        torch.testing.assert_close(out, outs[3], rtol=0, atol=0)


def test_a_packed_calls_given_maximum_length_past_its_tokens_sizes_no_idle_programs():
    """max_seqlen_q/k past the packed tokens (a model's maximum length for a short batch) give the result of the
    true maximum, as fast: no sequence is longer than the tokens (2**40 sized a grid that never finished)."""
    q, k, v = _packed_qkv()
    cu = {"cu_seqlens_q": i32([0, 4, 10]), "cu_seqlens_k": i32([0, 5, 12])}
    for check_values in (True, False):
        problem = check_inputs(q, k, v, **cu, max_seqlen_q=2**40, max_seqlen_k=2**40,
                               check_index_values=check_values)
        assert (problem.max_seqlen_q, problem.max_seqlen_k) == (10, 12)  # the tokens
    out = fatune.attention(q, k, v, **cu, max_seqlen_q=2**40, max_seqlen_k=2**40)
    torch.testing.assert_close(out, fatune.attention(q, k, v, **cu), rtol=0, atol=0)


def test_explain_names_an_argument_attention_does_not_take():
    with pytest.raises(TypeError, match="explain: takes fatune.attention's arguments, got 'causal'"):
        fatune.explain(*qkv(), causal=True)


def test_zero_heads_give_an_empty_result():
    q, k, v = qkv(h=0, hkv=0)
    out = fatune.attention(q, k, v)
    assert out.shape == (2, 0, 16, 32)


def test_no_keys_give_zeros_whatever_the_queries_hold():
    """L_k = 0: every row sees no key and returns 0, also where an input holds inf or NaN (they reach no key)."""
    q, k, v = qkv(lq=5, lk=0)
    q[0, 0, 0, 0], q[1, 1, 2, 3] = float("inf"), float("nan")
    q.requires_grad_()
    out = fatune.attention(q, k, v)
    out.sum().backward()
    assert torch.equal(out, torch.zeros_like(out)) and torch.equal(q.grad, torch.zeros_like(q))


def test_meta_tensors_give_shapes():
    q, k, v = qkv(dv=24, device="meta")
    out = fatune.attention(q, k, v, is_causal=True)
    assert out.device.type == "meta" and out.shape == (2, 4, 16, 24)


def test_mask_dtype_message_lists_each_dtype_once():
    q, k, v = qkv(dtype=torch.float32)
    with pytest.raises(TypeError) as error:
        fatune.attention(q, k, v, attn_mask=torch.ones(16, 16, dtype=torch.int64, device=DEVICE))
    assert str(error.value).count("torch.float32") == 1


def test_unwritable_kernel_cache_costs_one_warning(tmp_path, monkeypatch, caplog):
    blocker = tmp_path / "a-file"
    blocker.write_text("not a folder")
    monkeypatch.setenv(settings.CACHE_ENV, str(blocker / "kernels"))  # cannot be created, even by root
    monkeypatch.setattr(loader, "_modules", {})
    monkeypatch.setattr(loader, "_fallback_dir", None)
    q, k, v = qkv(d=48, dv=48)  # a spec no other test loads first
    with caplog.at_level(logging.WARNING, logger="fatune"):
        first = fatune.attention(q, k, v, scale=0.3)
        monkeypatch.setattr(plans, "_plans", {})
        monkeypatch.setattr(loader, "_modules", {})
        second = fatune.attention(q, k, v, scale=0.3)
    assert torch.equal(first, second)
    warnings = [r.message for r in caplog.records if settings.CACHE_ENV in r.message]
    assert len(warnings) == 1 and str(blocker) in warnings[0]


@pytest.mark.parametrize("case", ["seqlens-past-the-end", "seqlens-negative", "cu-seqlens-garbage"])
def test_unread_index_values_are_clamped_in_the_kernels(case, monkeypatch):
    """Under CUDA-graph capture and torch.compile the index tensors are not read on the host: the kernels
    clamp them, so no value makes them touch memory outside the tensors."""
    from fatune import call as inputs

    monkeypatch.setattr(inputs, "contents_readable", lambda: False)
    if case.startswith("seqlens"):
        q, k, v = qkv(lq=20, lk=24)
        given = i32([30, 5]) if case == "seqlens-past-the-end" else i32([-3, 24])
        out = fatune.attention(q, k, v, seqlens_k=given)
        monkeypatch.setattr(inputs, "contents_readable", lambda: True)
        meant = fatune.attention(q, k, v, seqlens_k=given.clamp(0, 24))
        torch.testing.assert_close(out, meant, rtol=0, atol=0)
    else:
        q, k, v = _packed_qkv()
        out = fatune.attention(q, k, v, cu_seqlens_q=i32([0, 7, 3, 99]), cu_seqlens_k=i32([-5, 40, 6, 12]),
                               max_seqlen_q=10, max_seqlen_k=12)
        assert out.shape == (10, 2, 16)


def _counting_index_reads(monkeypatch) -> list:
    """The index-value checks from now on, plans built afresh (an earlier test's plan of the same call would
    spare the first call's read)."""
    plans.clear()
    reads = []
    check = check_contents

    def counting(*args):
        reads.append(args)
        return check(*args)

    monkeypatch.setattr(plans, "check_contents", counting)
    return reads


def test_index_values_are_read_once_per_unchanged_tensor(monkeypatch):
    """cu_seqlens / seqlens_k values are read (a GPU sync) once per tensor: calls with the same, unwritten
    tensors reuse the check, an in-place write (a new version) or another tensor is read again."""
    reads = _counting_index_reads(monkeypatch)
    q, k, v = _packed_qkv()
    cu_q, cu_k = i32([0, 4, 10]), i32([0, 5, 12])
    lengths = {"max_seqlen_q": 9, "max_seqlen_k": 11}
    first = fatune.attention(q, k, v, cu_seqlens_q=cu_q, cu_seqlens_k=cu_k, **lengths)  # checked building its plan
    for _ in range(3):
        again = fatune.attention(q, k, v, cu_seqlens_q=cu_q, cu_seqlens_k=cu_k, **lengths)
    assert len(reads) == 1 and torch.equal(first, again)
    cu_q[1] = 7  # a new version: read again, and a bad value is still caught
    fatune.attention(q, k, v, cu_seqlens_q=cu_q, cu_seqlens_k=cu_k, **lengths)
    assert len(reads) == 2
    cu_q[1] = 11
    with pytest.raises(ValueError, match="cu_seqlens_q"):
        fatune.attention(q, k, v, cu_seqlens_q=cu_q, cu_seqlens_k=cu_k, **lengths)
    fatune.attention(q, k, v, cu_seqlens_q=i32([0, 4, 10]), cu_seqlens_k=cu_k, **lengths)  # another tensor
    assert len(reads) == 4
    padded_q, padded_k, padded_v = qkv(lq=20, lk=24)
    seqlens = i32([5, 24])
    for _ in range(3):
        fatune.attention(padded_q, padded_k, padded_v, seqlens_k=seqlens)
    assert len(reads) == 5


def test_index_values_without_given_lengths_are_read_every_call(monkeypatch):
    """Packed sequences without max_seqlen_q/k: the values size the grid, so a write the version counter
    misses (through .data) must still be seen, and is."""
    reads = _counting_index_reads(monkeypatch)
    q, k, v = _packed_qkv()
    cu_q, cu_k = i32([0, 4, 10]), i32([0, 5, 12])
    for _ in range(3):  # the first call's checks run while its plan is built
        fatune.attention(q, k, v, cu_seqlens_q=cu_q, cu_seqlens_k=cu_k)
    assert len(reads) == 2
    cu_q.data[1] = 1  # the longest query sequence grows from 6 to 9 rows
    out = fatune.attention(q, k, v, cu_seqlens_q=cu_q, cu_seqlens_k=cu_k)
    assert len(reads) == 3
    torch.testing.assert_close(out, fatune.attention(q, k, v, cu_seqlens_q=i32([0, 1, 10]), cu_seqlens_k=cu_k),
                               rtol=0, atol=0)


def test_unreadable_index_values_still_need_given_lengths(monkeypatch):
    """Under CUDA-graph capture and torch.compile the values cannot be read: max_seqlen_q/k are required
    there however often the same tensors were checked before (no earlier check stands in for them)."""
    from fatune import call as inputs

    q, k, v = _packed_qkv()
    cu_q, cu_k = i32([0, 4, 10]), i32([0, 5, 12])
    for _ in range(3):
        fatune.attention(q, k, v, cu_seqlens_q=cu_q, cu_seqlens_k=cu_k, max_seqlen_q=6, max_seqlen_k=7)
    monkeypatch.setattr(inputs, "contents_readable", lambda: False)
    monkeypatch.setattr(plans, "contents_readable", lambda: False)
    with pytest.raises(ValueError, match="max_seqlen_q"):
        fatune.attention(q, k, v, cu_seqlens_q=cu_q, cu_seqlens_k=cu_k)


# The common call (no optional tensors) is looked up by a shorter key (plans.prepare_plain).
def _count_builds(monkeypatch) -> list:
    builds = []
    build = plans._build

    def counting(*args, **kwargs):
        builds.append(args[:3])
        return build(*args, **kwargs)

    monkeypatch.setattr(plans, "_build", counting)
    monkeypatch.setattr(plans, "_plans", {})
    return builds


# Calls whose causal alignment cannot change the mask: (case id, (L_q, L_k), kwargs, kwargs of the plain call
# they become, or None where the alignment stays bottom-right)
ALIGNMENT_CASES = [
    ("causal-window-covering-every-key", (40, 40), {"is_causal": True, "window_size": (80, 0)}, {"is_causal": True}),
    ("bottom-right-asked", (40, 40), {"is_causal": True, "causal_alignment": "bottom_right"}, {"is_causal": True}),
    ("band-covering-every-key", (40, 40), {"window_size": (80, 80)}, {}),
    ("window-kept", (40, 40), {"is_causal": True, "window_size": (8, 0)}, None),
    ("other-lengths", (30, 40), {"is_causal": True, "window_size": (80, 0)}, None),
    ("key-padding", (40, 40), {"is_causal": True, "causal_alignment": "bottom_right", "seqlens_k": [40, 27]}, None),
]


@pytest.mark.parametrize("lengths, kwargs, plain", [case[1:] for case in ALIGNMENT_CASES],
                         ids=[case[0] for case in ALIGNMENT_CASES])
def test_an_alignment_that_cannot_change_the_mask_takes_the_plain_calls_kernel(lengths, kwargs, plain):
    """With L_q = L_k, no key padding and no window left, bottom-right is top-left: such a call runs (and looks up
    tuned entries) as the plain call does. Elsewhere bottom-right stays: it is another mask."""
    from fatune.call import check_inputs

    torch.manual_seed(3)
    q, k, v = qkv(lq=lengths[0], lk=lengths[1], d=16, dv=16)
    if "seqlens_k" in kwargs:
        kwargs = {**kwargs, "seqlens_k": i32(kwargs["seqlens_k"])}
    spec = check_inputs(q, k, v, **kwargs).spec
    if plain is None:
        assert spec.bottom_right
        return
    assert spec == check_inputs(q, k, v, **plain).spec and not spec.bottom_right
    out = fatune.attention(q, k, v, **kwargs)
    torch.testing.assert_close(out, fatune.attention(q, k, v, **plain), rtol=0, atol=0)
    # and it is the mask asked for: bottom-right causal at equal lengths is the lower triangle
    expected = torch.nn.functional.scaled_dot_product_attention(q.float(), k.float(), v.float(),
                                                                is_causal=plain.get("is_causal", False))
    torch.testing.assert_close(out.float(), expected, rtol=2e-3, atol=2e-3)


def _step(q, k, v, **kwargs):
    q, k, v = (t.detach().requires_grad_() for t in (q, k, v))
    out = fatune.attention(q, k, v, **kwargs)
    out.backward(torch.ones_like(out))
    return out, q.grad, k.grad, v.grad


def test_plain_call_matches_the_full_path(monkeypatch):
    builds = _count_builds(monkeypatch)
    q, k, v = qkv(b=1, h=2, hkv=2, lq=20, lk=24, d=16, dv=16)
    plain = _step(q, k, v, is_causal=True, window_size=(5, 0))
    assert len(builds) == 1
    assert all(torch.equal(a, b) for a, b in zip(plain, _step(q, k, v, is_causal=True, window_size=(5, 0))))
    assert len(builds) == 1  # the second call is a lookup
    # a list window is not hashable: the full path, same plan, same result
    assert all(torch.equal(a, b) for a, b in zip(plain, _step(q, k, v, is_causal=True, window_size=[5, 0])))
    # with an optional tensor (an all-True mask: the same attention) the full key and checks run
    keep = torch.ones(20, 24, dtype=torch.bool, device=DEVICE)
    masked = _step(q, k, v, is_causal=True, window_size=(5, 0), attn_mask=keep)
    assert len(builds) == 2
    for a, b in zip(plain, masked):
        torch.testing.assert_close(a, b)


def test_plain_call_with_changed_tensors_is_checked_again(monkeypatch):
    builds = _count_builds(monkeypatch)
    q, k, v = qkv(b=1, h=2, hkv=2, lq=16, lk=16, d=16, dv=16)
    fatune.attention(q, k, v)
    assert len(builds) == 1
    # other strides: a new plan, with correct results
    k_t = k.transpose(1, 2).contiguous().transpose(1, 2)
    torch.testing.assert_close(fatune.attention(q, k_t, v), fatune.attention(q, k, v), rtol=0, atol=0)
    assert len(builds) == 2 and builds[-1][1].stride() == k_t.stride()
    # data not 16-byte aligned: a new plan
    v_off = torch.empty(v.numel() + 1, dtype=v.dtype, device=DEVICE)[1:].view(v.shape).copy_(v)
    torch.testing.assert_close(fatune.attention(q, k, v_off), fatune.attention(q, k, v), rtol=0, atol=0)
    assert len(builds) == 3 and builds[-1][2].data_ptr() % 16 != 0
    # each alignment keeps its plan: calls alternating between them build nothing more, and after the first
    # call of each alignment neither takes the full key's path
    full_path, ran = [], []
    full_prepare, run = fatune.api.prepare, fatune.api._run
    monkeypatch.setattr(fatune.api, "prepare", lambda *args: full_path.append(args) or full_prepare(*args))
    monkeypatch.setattr(fatune.api, "_run", lambda plan, *args: ran.append((plan, args[2].data_ptr() % 16)) or
                        run(plan, *args))
    for _ in range(2):
        torch.testing.assert_close(fatune.attention(q, k, v_off), fatune.attention(q, k, v), rtol=0, atol=0)
    assert len(builds) == 3 and full_path == []
    assert len(set(ran)) == 2 and len({plan for plan, _ in ran}) == 2  # one plan per alignment, each its own
    # another dtype or device: the full checks say what is wrong
    with pytest.raises(TypeError, match="key"):
        fatune.attention(q, k.float(), v)
    with pytest.raises(ValueError, match="key: expected a tensor on .* got meta"):
        fatune.attention(q, k.to("meta"), v)
    # another scalar type (True, not 1.0): another key
    fatune.attention(q, k, v, scale=1)
    fatune.attention(q, k, v, scale=1.0)
    assert len(builds) == 7


def _meta(*shape, dtype=torch.float16):
    return torch.empty(*shape, dtype=dtype, device="meta")


def _bshd(length, heads=32, dim=128):
    """A (B, H, L, D) view of (B, L, H, D) memory: rows heads x dim elements apart."""
    return _meta(1, length, heads, dim).transpose(1, 2)


# (case id, call arguments, the name the error gives, or None: the call fits the kernels' int32 slice offsets).
# Meta tensors: sizes past 2^31 elements without the memory.
SLICE_OFFSETS = [
    ("bshd-at-the-limit", lambda: ((_bshd(2**19),) * 3, {}), None),
    ("bshd-one-row-past", lambda: ((_bshd(2**19 + 1),) * 3, {}), "query"),
    ("bhld-long", lambda: ((_meta(1, 32, 2**24, 128),) * 3, {}), None),
    ("bhld-past", lambda: ((_meta(1, 1, 2**24 + 1, 128),) * 3, {}), "query"),
    ("long-cache", lambda: ((_meta(1, 32, 1, 128), _bshd(2**21 + 1, 8), _bshd(2**21 + 1, 8)), {"enable_gqa": True}),
     "key"),
    ("value-past-query-fits", lambda: ((_meta(1, 4, 16, 128), _meta(1, 4, 2**24, 128), _meta(1, 4, 2**24, 256)), {}),
     "value"),
    # outputs and gradients whose input-like layout would overflow put their rows next to each other instead
    ("output-wider-than-query", lambda: ((_bshd(2**18 + 1, 32, 64), _bshd(2**18 + 1, 1, 64),
                                          _bshd(2**18 + 1, 1, 256)), {"enable_gqa": True}), None),
    ("expanded-key-gets-a-row-major-gradient", lambda: ((_meta(1, 32, 2**19 + 1, 128),
                                                         *(_meta(1, 1, 2**19 + 1, 128).expand(1, 32, -1, -1),) * 2),
                                                        {}), None),
    ("output-past-even-row-major", lambda: ((_meta(1, 1, 2**23 + 1, 64),) * 2
                                            + (_meta(1, 1, 1, 256).expand(1, 1, 2**23 + 1, 256),), {}),
     "query (its output)"),
    ("packed-tokens", lambda: ((_meta(2**19 + 1, 32, 128),) * 3,
                               {"cu_seqlens_q": i32([0, 2**19 + 1]).to("meta"),
                                "cu_seqlens_k": i32([0, 2**19 + 1]).to("meta"),
                                "max_seqlen_q": 2**19 + 1, "max_seqlen_k": 2**19 + 1}), "query"),
    ("mask-at-the-limit", lambda: (qkv(1, 1, 1, 46340, 46340, device="meta"),
                                   {"attn_mask": _meta(46340, 46340, dtype=torch.bool)}), None),
    ("mask-past", lambda: (qkv(1, 1, 1, 46341, 46341, device="meta"),
                           {"attn_mask": _meta(46341, 46341, dtype=torch.bool)}), "attn_mask"),
    ("broadcast-mask-rows", lambda: (qkv(1, 1, 1, 2**16, 2**16, device="meta"),
                                     {"attn_mask": _meta(1, 2**16, dtype=torch.bool)}), None),
    ("paged-pages-are-int64", lambda: ((_meta(1, 8, 1, 128), _meta(2**20, 8, 16, 128), _meta(2**20, 8, 16, 128)),
                                       {"block_table": i32([[0]]).to("meta")}), None),
]


@pytest.mark.parametrize("make, name", [case[1:] for case in SLICE_OFFSETS], ids=[case[0] for case in SLICE_OFFSETS])
def test_offsets_past_int32_inside_a_slice_name_the_argument(make, name):
    """Offsets inside one (batch, head) slice are int32 in the kernels: a call that would overflow them (and read
    the wrong rows, or crash) is refused by name, and one at the limit runs."""
    from fatune.call import check_inputs

    (q, k, v), kwargs = make()
    if name is None:
        check_inputs(q, k, v, check_index_values=False, **kwargs)
        return
    with pytest.raises(ValueError, match=r"^" + re.escape(name) + r": .* int32"):
        check_inputs(q, k, v, check_index_values=False, **kwargs)


@pytest.mark.parametrize("shape, strides, expected", [
    ((2, 8, 16, 64), (8 * 16 * 64, 16 * 64, 64, 1), (8 * 16 * 64, 16 * 64, 64, 1)),
    ((2, 8, 16, 64), (16 * 8 * 64, 64, 8 * 64, 1), (16 * 8 * 64, 64, 8 * 64, 1)),  # (B, L, H, D) memory kept
    ((1, 32, 2**19 + 1, 128), (2**19 * 128, 0, 128, 1), ((2**19 + 1) * 32 * 128, (2**19 + 1) * 128, 128, 1)),
    ((2**19 + 1, 32, 128), (32 * 128, 128, 1), (128, (2**19 + 1) * 128, 1)),  # packed rows past int32: (H, total, D)
])
def test_outputs_and_gradients_take_the_inputs_layout_unless_its_rows_overflow_int32(shape, strides, expected):
    from fatune.kernel.layout import MAX_SLICE_OFFSET, layout_like, slice_offset

    out_shape, out_strides = layout_like(shape, strides)
    assert out_shape == shape and out_strides == expected
    assert slice_offset(out_shape, out_strides, 0 if len(shape) == 3 else 2) <= MAX_SLICE_OFFSET


def test_calls_on_tensors_without_data_give_sizes_strides_and_gradients():
    """Meta tensors, FakeTensorMode and make_fx take fatune's custom op: the eager output's sizes and strides, and an
    output connected to autograd (gradient shapes, memory planning)."""
    from torch._subclasses.fake_tensor import FakeTensorMode
    from torch.fx.experimental.proxy_tensor import make_fx

    q, k, v = qkv(hkv=2, dv=24)
    eager = fatune.attention(q, k, v, is_causal=True, enable_gqa=True)
    with FakeTensorMode() as mode:
        fake = fatune.attention(*(mode.from_tensor(t) for t in (q, k, v)), is_causal=True, enable_gqa=True)
    assert (fake.shape, fake.stride(), fake.dtype) == (eager.shape, eager.stride(), eager.dtype)
    meta = [t.to("meta").requires_grad_() for t in (q, k, v)]
    out = fatune.attention(*meta, is_causal=True, enable_gqa=True)
    out.sum().backward()
    assert out.shape == eager.shape and [t.grad.shape for t in meta] == [t.shape for t in (q, k, v)]
    for mode_name in ("real", "fake", "symbolic"):
        graph = make_fx(lambda a, b, c: fatune.attention(a, b, c, enable_gqa=True), tracing_mode=mode_name)(q, k, v)
        assert "fatune.attention_forward" in graph.code, mode_name


def test_the_module_drops_out_in_training_mode_only():
    q, k, v = qkv(dtype=torch.float32)
    module = fatune.FlashAttention(dropout_p=0.5)
    torch.testing.assert_close(module.eval()(q, k, v), fatune.attention(q, k, v), rtol=0, atol=0)
    assert not torch.allclose(module.train()(q, k, v), fatune.attention(q, k, v))


def test_autocast_casts_the_inputs_as_sdpa_does():
    """Under torch.autocast, float32 q, k and v run in autocast's dtype, as torch's SDPA takes them (mixed dtypes
    too); their gradients come back in float32."""
    q, k, v = (t.float().requires_grad_() for t in qkv(device="cpu"))
    with torch.autocast("cpu", dtype=torch.bfloat16):
        out = fatune.attention(q, k.bfloat16(), v, is_causal=True)
        expected = torch.nn.functional.scaled_dot_product_attention(q, k.bfloat16(), v, is_causal=True)
    assert out.dtype == expected.dtype == torch.bfloat16
    torch.testing.assert_close(out.float(), expected.float(), atol=2e-2, rtol=0)
    out.float().sum().backward()
    assert q.grad.dtype == torch.float32 and q.grad.abs().max() > 0


DENSE_FALLBACK_CHILD = """
import json, os
os.environ.pop("TRITON_INTERPRET", None)  # CPU tensors without the interpreter: the dense fallback
import torch, fatune
from torch.utils.flop_counter import FlopCounterMode

q, k, v = (torch.randn(1, 2, 16, 32, requires_grad=True) for _ in range(3))
expected = torch.func.grad(lambda a: torch.nn.functional.scaled_dot_product_attention(
    a.double(), k.double(), v.double(), is_causal=True).sum())(q)
call = lambda a: fatune.attention(a, k, v, is_causal=True)
compiled = torch.compile(call, backend="aot_eager", fullgraph=True)
grads = {"func.grad": torch.func.grad(lambda a: call(a).sum())(q),
         "compiled": torch.autograd.grad(compiled(q).sum(), q)[0]}
with FlopCounterMode(display=False):
    grads["flop counter"] = torch.autograd.grad(call(q).sum(), q)[0]
    grads["func.grad in a mode"] = torch.func.grad(lambda a: call(a).sum())(q)
print(json.dumps({name: (g.double() - expected).abs().max().item() for name, g in grads.items()}))
"""


def test_the_dense_fallback_differentiates_under_compile_func_and_dispatch_modes():
    """Without the interpreter a CPU call runs a dense torch implementation; its gradients come through the custom
    op's backward (torch.compile), torch.func.grad and a FLOP counter as they do eagerly (they raised, or were
    wrong under torch.func.grad once computed there by torch.func)."""
    from tests.test_db import run_child

    (errors,) = run_child(DENSE_FALLBACK_CHILD)
    assert all(error < 1e-5 for error in errors.values()), errors


def test_autocast_casts_a_half_precision_mask_with_the_inputs_and_explain_sees_it():
    q, k, v = qkv(device="cpu")  # float16
    mask = torch.randn(16, 16, dtype=torch.float16)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        out = fatune.attention(q, k, v, mask)
        expected = torch.nn.functional.scaled_dot_product_attention(q, k, v, mask)
        assert fatune.explain(q, k, v, attn_mask=mask).spec.dtype == "bfloat16"
    assert out.dtype == expected.dtype == torch.bfloat16
    torch.testing.assert_close(out.float(), expected.float(), atol=2e-2, rtol=0)
