"""Bad input gets a clear error naming the argument; CPU tensors fall back (or raise in strict mode)."""

from __future__ import annotations

import logging

import pytest
import torch

import fatune
import fatune.plans as plans
from fatune.plans import FallbackError
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
    ("max-seqlen-too-small", _packed_qkv, {"cu_seqlens_q": i32([0, 4, 10]), "cu_seqlens_k": i32([0, 5, 12]),
                                           "max_seqlen_q": 3}, ValueError, "max_seqlen_q"),
]


@pytest.mark.parametrize("make, kwargs, error, text", [case[1:] for case in BAD_INPUTS],
                         ids=[case[0] for case in BAD_INPUTS])
def test_bad_input_names_the_argument(make, kwargs, error, text):
    q, k, v = make()
    with pytest.raises(error, match=text):
        fatune.attention(q, k, v, **kwargs)


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
    monkeypatch.setattr(plans, "_logged", set())
    monkeypatch.setattr(plans, "_plans", {})
    monkeypatch.delenv(plans.STRICT_ENV, raising=False)


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
        monkeypatch.setenv(plans.STRICT_ENV, "1")
    with pytest.raises(FallbackError, match="strict"):
        fatune.attention(q, k, v, **kwargs)
