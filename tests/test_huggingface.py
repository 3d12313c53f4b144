"""Hugging Face transformers models with attn_implementation="fatune", against the same weights on "sdpa":
logits, padded and packed batches, sliding windows, GQA, gradients, greedy generation with a KV cache; the
registration (no import of transformers by `import fatune`) and the features fatune refuses by name. Tiny
random-weight models built here, run in Triton's interpreter on the CPU (no downloads)."""

from __future__ import annotations

import copy
import subprocess
import sys

import pytest
import torch

from fatune import huggingface
from tests.conftest import DEVICE

transformers = pytest.importorskip("transformers")
if huggingface.unsupported():
    pytest.skip(f"attn_implementation='fatune': {huggingface.unsupported()}", allow_module_level=True)
from transformers import (  # noqa: E402
    DataCollatorWithFlattening,
    LlamaConfig,
    LlamaForCausalLM,
    MistralConfig,
    MistralForCausalLM,
    Qwen2Config,
    Qwen2ForCausalLM,
)

SIZES = dict(hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4, head_dim=16,
             vocab_size=97, max_position_embeddings=256)
WINDOW = 6
MODELS = {  # name: (model class, config)
    "llama-mha": (LlamaForCausalLM, lambda: LlamaConfig(**SIZES, num_key_value_heads=4)),
    "llama-gqa": (LlamaForCausalLM, lambda: LlamaConfig(**SIZES, num_key_value_heads=2)),
    "mistral-window": (MistralForCausalLM, lambda: MistralConfig(**SIZES, num_key_value_heads=2, sliding_window=WINDOW)),
    # layer 0 full attention, layer 1 a sliding window
    "qwen2-window": (Qwen2ForCausalLM, lambda: Qwen2Config(**SIZES, num_key_value_heads=2, use_sliding_window=True,
                                                           sliding_window=WINDOW, max_window_layers=1)),
}
LENGTH = 19  # odd, and over three windows
ATOL = 2e-4  # float32: fatune's kernels in the interpreter against torch's SDPA


def pair(name: str, dtype: torch.dtype = torch.float32):
    """The same random weights on SDPA and on fatune (set_attn_implementation)."""
    model_class, config = MODELS[name]
    torch.manual_seed(0)
    reference = model_class(config()).to(DEVICE, dtype).eval()
    reference.set_attn_implementation("sdpa")
    model = copy.deepcopy(reference)
    model.set_attn_implementation("fatune")
    assert model.config._attn_implementation == "fatune"
    return reference, model


@pytest.fixture
def calls(monkeypatch):
    """The fatune.attention calls a model makes: which mask form each got."""
    seen, attention = [], huggingface.attention

    def spy(*args, **kwargs):
        mask = args[3] if len(args) > 3 else kwargs.get("attn_mask")
        seen.append({"mask": None if mask is None else tuple(mask.shape), "window": tuple(kwargs.get("window_size", (-1, -1))),
                     "seqlens_k": kwargs.get("seqlens_k") is not None, "packed": kwargs.get("cu_seqlens_q") is not None,
                     "causal": kwargs.get("is_causal"), "dropout": kwargs.get("dropout_p")})
        return attention(*args, **kwargs)

    monkeypatch.setattr(huggingface, "attention", spy)
    return seen


def tokens(batch: int, length: int, seed: int = 1) -> torch.Tensor:
    return torch.randint(0, SIZES["vocab_size"], (batch, length), generator=torch.Generator().manual_seed(seed)).to(DEVICE)


@pytest.mark.parametrize("name", MODELS)
def test_logits_match_sdpa_without_a_dense_mask(name, calls):
    """Causal prefill, GQA without repeat_kv, sliding windows: no mask tensor reaches the kernels."""
    reference, model = pair(name)
    ids = tokens(2, LENGTH)
    with torch.no_grad():
        expected, got = reference(ids).logits, model(ids).logits
    torch.testing.assert_close(got, expected, atol=ATOL, rtol=0)
    assert calls and all(call["mask"] is None and call["causal"] for call in calls), calls
    windows = [call["window"] for call in calls]
    if name.startswith("llama"):
        assert set(windows) == {(-1, -1)}
    else:  # Mistral: every layer; Qwen2: its second layer
        assert (WINDOW - 1, 0) in windows


@pytest.mark.parametrize("name", ["llama-gqa", "mistral-window"])
@pytest.mark.parametrize("side", ["right", "left", "holes"])
def test_padded_batches_match_sdpa_where_tokens_are_real(name, side, calls):
    """Right padding runs as key lengths (seqlens_k); left padding (a generation's prefill) as the kept tokens
    packed into variable-length sequences; padding with holes as transformers' mask."""
    reference, model = pair(name)
    ids = tokens(3, LENGTH)
    keep = torch.ones_like(ids)
    for row, pad in enumerate((0, 5, 11)):
        if pad:
            keep[row, -pad:] = 0 if side == "right" else 1
            keep[row, :pad] = 1 if side == "right" else 0
    if side == "holes":
        keep[0, 7] = 0
    with torch.no_grad():
        expected = reference(ids, attention_mask=keep).logits
        got = model(ids, attention_mask=keep).logits
    real = keep.bool()
    torch.testing.assert_close(got[real], expected[real], atol=ATOL, rtol=0)
    path = {"right": lambda call: call["seqlens_k"] and call["mask"] is None,
            "left": lambda call: call["packed"] and call["mask"] is None,
            "holes": lambda call: call["mask"] == (3, 1, LENGTH, LENGTH)}[side]
    assert calls and all(path(call) for call in calls), calls


@pytest.mark.parametrize("name", ["llama-gqa", "qwen2-window"])
def test_packed_batches_run_as_variable_length_sequences(name, calls):
    """DataCollatorWithFlattening's packed batch (position_ids restarting per sequence, no mask) runs as fatune's
    packed variable-length call, and matches SDPA on the same batch and each sequence run alone."""
    reference, model = pair(name)
    lengths = (7, 13, 4)
    features = [{"input_ids": tokens(1, n, seed=n)[0].tolist()} for n in lengths]
    batch = DataCollatorWithFlattening()(features)
    ids, positions = batch["input_ids"].to(DEVICE), batch["position_ids"].to(DEVICE)
    with torch.no_grad():
        expected = reference(ids, position_ids=positions, use_cache=False).logits
        got = model(ids, position_ids=positions, use_cache=False).logits
        alone = torch.cat([reference(tokens(1, n, seed=n)).logits for n in lengths], dim=1)
    torch.testing.assert_close(got, expected, atol=ATOL, rtol=0)
    torch.testing.assert_close(got, alone, atol=ATOL, rtol=0)
    assert calls and all(call["packed"] for call in calls), calls


def test_sequence_offsets_from_the_collator_run_as_those_sequences(calls):
    """cu_seq_lens_q/k (DataCollatorWithFlattening(return_flash_attn_kwargs=True)) without position ids: the
    sequences they give, as flash-attn's path runs them (SDPA, which ignores them, gets the same block-diagonal
    causal mask as a tensor)."""
    reference, model = pair("llama-gqa")
    lengths = (5, 9, 6)
    ids = tokens(1, sum(lengths))
    offsets = torch.tensor([0, 5, 14, 20], dtype=torch.int32, device=DEVICE)
    document = torch.repeat_interleave(torch.arange(3, device=DEVICE), torch.tensor(lengths, device=DEVICE))
    order = torch.arange(sum(lengths), device=DEVICE)
    block = (document[:, None] == document[None, :]) & (order[None, :] <= order[:, None])
    with torch.no_grad():
        expected = reference(ids, attention_mask=block[None, None], use_cache=False).logits
        got = model(ids, cu_seq_lens_q=offsets, cu_seq_lens_k=offsets, max_length_q=9, max_length_k=9,
                    use_cache=False).logits
    torch.testing.assert_close(got, expected, atol=ATOL, rtol=0)
    assert calls and all(call["packed"] for call in calls), calls


@pytest.mark.parametrize("name", ["mistral-window", "qwen2-window"])
def test_sequence_offsets_from_the_collator_hold_in_sliding_window_layers_too(name):
    """Every layer runs the collator's sequences, its window within each (a model of full and sliding layers
    too): each document's logits are those of the document run alone (its positions relative under RoPE)."""
    reference, model = pair(name)
    lengths = (5, 9, 6)  # the second longer than the window
    ids = tokens(1, sum(lengths))
    offsets = torch.tensor([0, 5, 14, 20], dtype=torch.int32, device=DEVICE)
    with torch.no_grad():
        expected = torch.cat([reference(ids[:, a:b], use_cache=False).logits
                              for a, b in zip(offsets[:-1].tolist(), offsets[1:].tolist())], 1)
        got = model(ids, cu_seq_lens_q=offsets, cu_seq_lens_k=offsets, max_length_q=9, max_length_k=9,
                    use_cache=False).logits
    torch.testing.assert_close(got, expected, atol=ATOL, rtol=0)


@pytest.mark.parametrize("name", ["llama-gqa", "mistral-window"])
@pytest.mark.parametrize("side", ["right", "left"])
def test_gradients_match_sdpa(name, side):
    reference, model = pair(name)
    ids = tokens(2, LENGTH)
    keep = torch.ones_like(ids)
    if side == "right":
        keep[1, -4:] = 0
    else:
        keep[1, :4] = 0
    grads = []
    for m in (reference, model):
        m.train()
        loss = m(ids, attention_mask=keep, labels=ids.masked_fill(keep == 0, -100)).loss
        loss.backward()
        grads.append({n: p.grad for n, p in m.named_parameters()})
    for n, g in grads[0].items():
        torch.testing.assert_close(grads[1][n], g, atol=ATOL, rtol=1e-3, msg=n)


def test_dropout_in_training_reaches_the_kernels(calls):
    model_class, config = MODELS["llama-gqa"]
    torch.manual_seed(0)
    model = model_class(config()).to(DEVICE).train()
    model.config.attention_dropout = 0.25
    for layer in model.model.layers:
        layer.self_attn.attention_dropout = 0.25
    model.set_attn_implementation("fatune")
    ids = tokens(2, LENGTH)
    loss = model(ids, labels=ids).loss
    loss.backward()
    assert torch.isfinite(loss) and all(p.grad is not None for p in model.parameters() if p.requires_grad)
    # the kernels' own dropout (tested against its mask in the kernel suite) is what runs
    assert calls and all(call["dropout"] == 0.25 for call in calls), calls
    calls.clear()
    model.eval()
    with torch.no_grad():
        first, second = model(ids).logits, model(ids).logits
    torch.testing.assert_close(first, second, atol=0, rtol=0)  # no dropout in eval
    assert calls and all(call["dropout"] == 0.0 for call in calls)


@pytest.mark.parametrize("padded", [False, True])
def test_a_compiled_model_matches_sdpa(padded):
    """torch.compile of the whole model: the masks are traced (transformers' own), the attention runs through
    fatune's custom ops."""
    reference, model = pair("llama-gqa")
    ids = tokens(2, LENGTH)
    keep = torch.ones_like(ids)
    if padded:
        keep[1, -5:] = 0
    torch._dynamo.reset()
    compiled = torch.compile(model, backend="aot_eager")
    with torch.no_grad():
        got, expected = compiled(ids, attention_mask=keep).logits, reference(ids, attention_mask=keep).logits
    real = keep.bool()
    torch.testing.assert_close(got[real], expected[real], atol=ATOL, rtol=0)


@pytest.mark.parametrize("name", ["llama-gqa", "qwen2-window"])
@pytest.mark.parametrize("cache", ["dynamic", "static"])
def test_greedy_generation_with_a_kv_cache_matches_sdpa(name, cache):
    """Prefill, then one token at a time against the cache (L_q = 1), a left-padded batch included."""
    reference, model = pair(name)
    ids = tokens(2, 9)
    keep = torch.ones_like(ids)
    keep[0, :3] = 0  # left padding, as generation pads
    options = dict(attention_mask=keep, max_new_tokens=6, do_sample=False, pad_token_id=0)
    if cache == "static":
        options["cache_implementation"] = "static"
    with torch.no_grad():
        expected = reference.generate(ids, **options)
        got = model.generate(ids, **options)
    assert torch.equal(got, expected)


@pytest.mark.parametrize("name", ["llama-gqa", "mistral-window"])
def test_a_prefill_into_an_empty_static_cache_matches_sdpa(name):
    """Unpadded prompts into an empty StaticCache: transformers gives no mask (SDPA's top-left causal alignment keeps
    each query off the unwritten keys past the prompt), and fatune's logits are SDPA's; and the first generated
    tokens too."""
    reference, model = pair(name)
    ids = tokens(2, 9)
    config = reference.config
    with torch.no_grad():
        expected = reference(ids, past_key_values=transformers.StaticCache(config=config, max_cache_len=16)).logits
        got = model(ids, past_key_values=transformers.StaticCache(config=config, max_cache_len=16)).logits
    torch.testing.assert_close(got, expected, atol=ATOL, rtol=0)
    options = dict(max_new_tokens=4, do_sample=False, pad_token_id=0, cache_implementation="static")
    with torch.no_grad():
        assert torch.equal(model.generate(ids, **options), reference.generate(ids, **options))


def test_the_losss_arguments_pass_through_the_attention_unrefused():
    """A causal LM passes its loss's arguments (shift_labels, under context parallelism or a padding-free collator)
    on to its layers: they change nothing fatune computes."""
    reference, model = pair("llama-gqa")
    ids = tokens(1, 9)
    with torch.no_grad():
        expected = reference(ids, labels=ids, shift_labels=ids).loss
        got = model(ids, labels=ids, shift_labels=ids).loss
    torch.testing.assert_close(got, expected, atol=ATOL, rtol=0)


def test_from_pretrained_and_from_config_take_fatune(tmp_path):
    reference, _ = pair("llama-gqa")
    reference.save_pretrained(tmp_path)
    loaded = LlamaForCausalLM.from_pretrained(tmp_path, attn_implementation="fatune")
    assert loaded.config._attn_implementation == "fatune"
    built = transformers.AutoModelForCausalLM.from_config(MODELS["llama-mha"][1](), attn_implementation="fatune")
    assert built.config._attn_implementation == "fatune"
    ids = tokens(1, 11)
    with torch.no_grad():
        torch.testing.assert_close(loaded.to(DEVICE)(ids).logits, reference(ids).logits, atol=ATOL, rtol=0)


def test_soft_capping_is_refused_by_name():
    """Gemma2's attention-logit soft-capping has no fatune kernel: an error naming it, never a silent result."""
    config = transformers.Gemma2Config(**SIZES, num_key_value_heads=2, attn_logit_softcapping=50.0, sliding_window=4)
    torch.manual_seed(0)
    model = transformers.Gemma2ForCausalLM(config).to(DEVICE).eval()
    model.set_attn_implementation("fatune")
    with pytest.raises(NotImplementedError, match="soft-capping"), torch.no_grad():
        model(tokens(1, 8))


REGISTRATION = """
import sys, time
start = time.perf_counter()
import fatune
assert "transformers" not in sys.modules, "import fatune imported transformers"
from transformers import LlamaConfig, LlamaForCausalLM
config = LlamaConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2,
                     vocab_size=50, attn_implementation="fatune")
assert LlamaForCausalLM(config).config._attn_implementation == "fatune"
"""


@pytest.mark.parametrize("order", ["fatune-first", "transformers-first"])
def test_import_fatune_registers_in_either_order(order):
    script = REGISTRATION if order == "fatune-first" else \
        "import transformers.modeling_utils\n" + REGISTRATION.replace(
            'assert "transformers" not in sys.modules, "import fatune imported transformers"\n', "")
    subprocess.run([sys.executable, "-c", script], check=True, capture_output=True, text=True, timeout=300)


def test_a_transformers_without_its_masking_functions_is_refused_by_name(monkeypatch):
    """Where transformers lacks a masking function fatune's mask reads (older than 5), registering returns False
    and says why, naming the version, rather than failing inside a model later."""
    from transformers import masking_utils

    assert huggingface.unsupported() is None
    monkeypatch.delattr(masking_utils, "packed_sequence_mask_function")
    assert transformers.__version__ in huggingface.unsupported()
    assert huggingface.register() is False


def test_register_again_heals_a_registry_another_library_reset():
    from transformers import masking_utils
    from transformers.modeling_utils import AttentionInterface

    assert huggingface.register()
    AttentionInterface._global_mapping.pop(huggingface.NAME)
    masking_utils.AttentionMaskInterface._global_mapping.pop(huggingface.NAME)
    assert huggingface.register()
    assert AttentionInterface._global_mapping[huggingface.NAME] is huggingface.attention_forward
    assert masking_utils.AttentionMaskInterface._global_mapping[huggingface.NAME] is huggingface.mask


def test_registration_costs_import_fatune_almost_nothing():
    from fatune import huggingface

    import time

    start = time.perf_counter()
    for _ in range(20):
        huggingface.install()
    assert (time.perf_counter() - start) / 20 < 0.02


@pytest.mark.gpu
def test_gpu_a_bf16_training_loop_follows_sdpas_loss_curve():
    """A Llama-style model (GQA, 4 layers) trained 20 AdamW steps in bf16 on fatune and on SDPA from the same
    weights and data: the loss curves agree within 2% at every step."""
    import dataclasses

    from fatune.bench import models

    workload = dataclasses.replace(models.GPU_WORKLOAD, hidden=1024, layers=4, heads=8, kv_heads=2, batch=4,
                                   length=1024, steps=20)
    trained = models.train(workload, torch.device("cuda"))
    for step, (got, expected) in enumerate(zip(trained["fatune"]["losses"], trained["sdpa"]["losses"])):
        assert abs(got - expected) <= 0.02 * abs(expected), (step, got, expected)


def _pair_of(model, implementation: str = "sdpa"):
    model = model.to(DEVICE).eval()
    model.set_attn_implementation(implementation)
    other = copy.deepcopy(model)
    other.set_attn_implementation("fatune")
    return model, other


def _falcon():
    return transformers.FalconForCausalLM(transformers.FalconConfig(
        hidden_size=32, num_hidden_layers=2, num_attention_heads=4, vocab_size=97, alibi=True,
        new_decoder_architecture=False))


def _phimoe():  # a sliding mask, and layers that do not pass the window to the attention
    return transformers.PhimoeForCausalLM(transformers.PhimoeConfig(
        **{**SIZES, "intermediate_size": 32}, num_key_value_heads=2, sliding_window=4, num_local_experts=2,
        num_experts_per_tok=1))


def _olmoe():  # layers that pass a window over a full causal mask (SDPA ignores it)
    config = transformers.OlmoeConfig(**{**SIZES, "intermediate_size": 32}, num_key_value_heads=2, num_experts=2,
                                      num_experts_per_tok=1)
    config.sliding_window = 4
    return transformers.OlmoeForCausalLM(config)


@pytest.mark.parametrize("build", [_falcon, _phimoe, _olmoe], ids=["falcon-alibi", "phimoe-window", "olmoe-window"])
@pytest.mark.parametrize("batch", ["unpadded", "right-padded", "packed"])
def test_models_that_change_the_mask_or_window_it_match_sdpa(build, batch):
    """Falcon adds ALiBi to the mask it asks for (allow_is_causal_skip=False); Phi-MoE's layers get a sliding mask
    without the window as an argument; OLMoE's layers pass a window SDPA never applies. The mask decides."""
    torch.manual_seed(0)
    reference, model = _pair_of(build())
    ids = tokens(1 if batch == "packed" else 2, 11)
    kwargs = {}
    if batch == "right-padded":
        keep = torch.ones_like(ids)
        keep[1, -3:] = 0
        kwargs["attention_mask"] = keep
    elif batch == "unpadded":
        kwargs["attention_mask"] = torch.ones_like(ids)
    else:
        kwargs.update(position_ids=torch.tensor([[0, 1, 2, 3, 4, 0, 1, 2, 3, 4, 5]], device=DEVICE), use_cache=False)
    with torch.no_grad():
        expected, got = reference(ids, **kwargs).logits, model(ids, **kwargs).logits
    real = kwargs["attention_mask"].bool() if "attention_mask" in kwargs else torch.ones_like(ids, dtype=torch.bool)
    torch.testing.assert_close(got[real], expected[real], atol=ATOL, rtol=0)


def test_a_relative_position_bias_is_refused_by_name():
    model = transformers.T5Model(transformers.T5Config(d_model=32, d_kv=8, d_ff=64, num_heads=4, num_layers=1,
                                                       vocab_size=97)).to(DEVICE).eval()
    model.set_attn_implementation("fatune")
    layer = model.encoder.block[0].layer[0].SelfAttention.config._attn_implementation
    if layer != "fatune":
        pytest.skip(f"transformers {transformers.__version__} leaves T5's layers on {layer!r}")
    ids = tokens(1, 6)
    with pytest.raises(NotImplementedError, match="relative position bias"), torch.no_grad():
        model(input_ids=ids, decoder_input_ids=ids)


def test_a_lookup_of_transformers_modeling_code_does_not_use_up_the_registration():
    script = ("import importlib.util, sys\nimport fatune\n"
              "assert importlib.util.find_spec('transformers.modeling_utils') is not None\n" +
              REGISTRATION.split("import fatune\n", 1)[1].replace(
                  'assert "transformers" not in sys.modules, "import fatune imported transformers"\n', ""))
    subprocess.run([sys.executable, "-c", script], check=True, capture_output=True, text=True, timeout=300)


class _Layer(torch.nn.Module):
    is_causal = True


@pytest.mark.parametrize("name, value, refused", [
    ("indices", torch.zeros(1, 1, 8, 4, dtype=torch.long), "sparse indexer"),
    ("block_indices", torch.zeros(1, 1, 2, dtype=torch.long), "sparse indexer"),
    ("sinks", torch.zeros(4), "attention sinks"),
    ("head_mask", torch.ones(4), "head mask"),
    ("some_new_bias", torch.zeros(1, 4, 8, 8), "some_new_bias="),
    ("position_ids", torch.arange(8)[None], None),
    ("sliding_window", 4, None),
    ("some_flag", True, None),
    ("indices", None, None),
])
def test_an_argument_that_may_change_the_scores_is_refused_by_name(name, value, refused):
    """A sparse indexer's keys (passed to backends other than eager and sdpa), sinks, a head mask or any tensor
    argument fatune does not know would be ignored: an error naming it, never a silent result."""
    q, k, v = (torch.randn(1, 4, 8, 16, device=DEVICE) for _ in range(3))
    call = lambda: huggingface.attention_forward(_Layer(), q, k, v, None, **{name: value})  # noqa: E731
    if refused is None:
        out, weights = call()
        assert out.shape == (1, 8, 4, 16) and weights is None
    else:
        with pytest.raises(NotImplementedError, match=refused):
            call()


def test_the_output_is_contiguous_and_asking_for_weights_is_said(caplog):
    """As SDPA's path: the (B, L, H, D) output is contiguous (models .view() it) whatever the query's layout; a
    model asking for attention weights gets none, said once."""
    import logging

    from fatune import logs

    logs._warned.discard(next((m for m in logs._warned if "output_attentions" in m), None))
    q, k, v = (torch.randn(1, 4, 8, 16, device=DEVICE) for _ in range(3))  # (B, H, L, D) contiguous
    with caplog.at_level(logging.WARNING, logger="fatune"):
        out, weights = huggingface.attention_forward(_Layer(), q, k, v, None, output_attentions=True)
    assert out.is_contiguous() and weights is None
    assert [r for r in caplog.records if "output_attentions=True returns none" in r.message]


def test_a_model_without_sdpa_support_gets_eagers_additive_mask():
    """GIT's text layers add the mask they get to their scores (it declares no SDPA support): fatune's mask function
    gives it eager's additive mask, and its logits are eager's, causal (the last token changes no earlier logit)."""
    config = transformers.GitConfig(
        vision_config=dict(hidden_size=32, intermediate_size=37, num_hidden_layers=1, num_attention_heads=4,
                           image_size=16, patch_size=8),
        hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4, vocab_size=97,
        max_position_embeddings=64, num_image_with_embedding=None, bos_token_id=1, eos_token_id=2)
    torch.manual_seed(0)
    eager, model = _pair_of(transformers.GitForCausalLM(config), "eager")
    ids = tokens(2, 13)
    changed = ids.clone()
    changed[:, -1] = (changed[:, -1] + 1) % 97
    with torch.no_grad():
        expected, got, got_changed = eager(input_ids=ids).logits, model(input_ids=ids).logits, \
            model(input_ids=changed).logits
    torch.testing.assert_close(got, expected, atol=ATOL, rtol=0)
    assert torch.equal(got[:, :-1], got_changed[:, :-1])


@pytest.mark.parametrize("kwargs", [{}, {"logits_to_keep": 3}, {"right_padding": True}])
def test_gemma4s_kv_shared_layers_match_eager(kwargs):
    """Gemma-4 slices its masks' query rows before its KV-shared layers (to the last logits_to_keep, its masks then
    4-d tensors or none): fatune's logits are eager's, the last queries seeing every key before them."""
    config = transformers.Gemma4TextConfig(
        hidden_size=64, intermediate_size=96, num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2,
        head_dim=16, global_head_dim=16, vocab_size=97, vocab_size_per_layer_input=97, hidden_size_per_layer_input=8,
        sliding_window=6, layer_types=["sliding_attention", "full_attention"] * 2, num_kv_shared_layers=2,
        max_position_embeddings=256)
    torch.manual_seed(0)
    eager, model = _pair_of(transformers.Gemma4ForCausalLM(config), "eager")
    ids = tokens(2, 19)
    if kwargs.pop("right_padding", False):
        kwargs["attention_mask"] = torch.ones_like(ids)
        kwargs["attention_mask"][1, -4:] = 0
    with torch.no_grad():
        expected, got = eager(ids, **kwargs).logits, model(ids, **kwargs).logits
    real = kwargs["attention_mask"].bool()[:, -got.shape[1]:, None] if "attention_mask" in kwargs else \
        torch.ones((), dtype=torch.bool)
    torch.testing.assert_close(torch.where(real, got, 0), torch.where(real, expected, 0), atol=ATOL, rtol=0)
