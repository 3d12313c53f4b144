"""Suite `transformers`: a Hugging Face Llama-style model trained and generating with attn_implementation
"fatune" beside "sdpa", the same random weights and data for both.

- train: `steps` optimizer steps (AdamW) of a causal-LM loss on random tokens, bf16; every step's loss for both
  implementations (the curves must agree: the largest relative gap is reported) and the training throughput in
  tokens per second over the steps after the first few (compiles and allocator warm-up left out).
- generate: greedy decoding of `new_tokens` tokens for a batch of 8 prompts that fill a 4k cache (DynamicCache),
  after a warm-up generation from the same prompt; each token's scores time-stamped as generation makes them:
  the prompt's prefill up to the first, and milliseconds per generated token between the later ones (medians over
  GENERATE_REPEATS generations).

Wall-clock timings with the GPU synchronized around each measured region, medians where repeated. In Triton's
interpreter (`--interpret`) a tiny model runs a few steps on the CPU (a smoke run; timings not meaningful).
Needs transformers (`pip install 'fatune[transformers]'`).
"""

from __future__ import annotations

import copy
import math
import statistics
import time
from dataclasses import dataclass

import torch

from fatune.bench.common import bench_device, on_gpu
from fatune.bench.results import PlotSpec, Report, fmt, markdown_table

NAME = "transformers"
IMPLS = ("sdpa", "fatune")
PLOT = PlotSpec(x="step", y="loss", xlog=False, xlabel="step", ylabel="training loss")


@dataclass(frozen=True)
class Workload:
    """A model and what it runs: its sizes, the training batch, the generation batch."""

    hidden: int
    layers: int
    heads: int
    kv_heads: int
    head_dim: int
    vocab: int
    batch: int
    length: int
    steps: int
    prompt: int
    new_tokens: int
    generate_batch: int = 8
    dtype: torch.dtype = torch.bfloat16

    def label(self) -> str:
        return (f"llama {self.layers}x{self.hidden} h{self.heads}/{self.kv_heads}x{self.head_dim} "
                f"B{self.batch} L{self.length}")

    def config(self, implementation: str):
        from transformers import LlamaConfig

        return LlamaConfig(hidden_size=self.hidden, intermediate_size=self.hidden * 8 // 3 // 64 * 64 or 64,
                           num_hidden_layers=self.layers, num_attention_heads=self.heads,
                           num_key_value_heads=self.kv_heads, head_dim=self.head_dim, vocab_size=self.vocab,
                           max_position_embeddings=max(self.length, self.prompt + self.new_tokens),
                           attn_implementation=implementation)


GPU_WORKLOAD = Workload(hidden=2048, layers=8, heads=16, kv_heads=4, head_dim=128, vocab=32000, batch=8,
                        length=2048, steps=50, prompt=4096 - 64, new_tokens=64)
INTERPRETER_WORKLOAD = Workload(hidden=64, layers=2, heads=4, kv_heads=2, head_dim=16, vocab=97, batch=2,
                                length=24, steps=3, prompt=12, new_tokens=3, generate_batch=2, dtype=torch.float32)
WARMUP_STEPS = 5  # steps left out of the throughput (compiles, allocator warm-up)
GENERATE_REPEATS = 3  # timed generations: the median prefill and the median step between tokens


def _model(workload: Workload, device: torch.device):
    """The random-weight model both implementations start from, with attn_implementation="fatune" registered."""
    from transformers import LlamaForCausalLM

    from fatune import huggingface

    if not huggingface.register():
        raise RuntimeError("attn_implementation='fatune' could not be registered: this suite needs transformers >= 5")
    torch.manual_seed(0)
    return LlamaForCausalLM(workload.config("sdpa")).to(device, workload.dtype)


class _Stamps:
    """A logits processor that only notes the time (the GPU synchronized) each time a generation's forward has
    made the next token's scores: the first after the prefill, each later one a decode step after the last."""

    def __init__(self, device: torch.device):
        self.device, self.times = device, []

    def __call__(self, input_ids: torch.Tensor, scores: torch.Tensor) -> torch.Tensor:
        _sync(self.device)
        self.times.append(time.perf_counter())
        return scores


def _sync(device: torch.device) -> None:
    if on_gpu(device):
        torch.cuda.synchronize(device)


def train(workload: Workload, device: torch.device) -> dict[str, dict]:
    """Per implementation: every step's loss and the tokens per second after WARMUP_STEPS."""
    initial = _model(workload, device)
    data = torch.randint(0, workload.vocab, (workload.steps, workload.batch, workload.length),
                         generator=torch.Generator().manual_seed(1)).to(device)
    results = {}
    for implementation in IMPLS:
        model = copy.deepcopy(initial).train()
        model.set_attn_implementation(implementation)
        optimizer = torch.optim.AdamW(model.parameters(), lr=3e-4, foreach=True)
        losses, started = [], None
        for step in range(workload.steps):
            if step == min(WARMUP_STEPS, workload.steps - 1):
                _sync(device)
                started = time.perf_counter()
            loss = model(data[step], labels=data[step]).loss
            loss.backward()
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
            losses.append(loss.detach())
        _sync(device)
        timed_steps = workload.steps - min(WARMUP_STEPS, workload.steps - 1)
        seconds = time.perf_counter() - started
        results[implementation] = {"losses": [float(x) for x in losses],
                                   "tokens_per_s": timed_steps * workload.batch * workload.length / seconds}
        del model, optimizer
    return results


def generate(workload: Workload, device: torch.device) -> dict[str, dict]:
    """Per implementation: the prefill's milliseconds and the milliseconds per generated token (greedy, a
    DynamicCache; the median prefill of GENERATE_REPEATS generations, and the median of their steps between
    tokens), and the tokens (both implementations must pick the same ones)."""
    from transformers import LogitsProcessorList

    initial = _model(workload, device).eval()
    prompt = torch.randint(0, workload.vocab, (workload.generate_batch, workload.prompt),
                           generator=torch.Generator().manual_seed(2)).to(device)
    results = {}
    for implementation in IMPLS:
        model = copy.deepcopy(initial)
        model.set_attn_implementation(implementation)
        options = dict(do_sample=False, pad_token_id=0, min_new_tokens=workload.new_tokens)
        with torch.no_grad():
            # warm-up: the timed generation itself, so that what each new cache length builds once (kernels, plans,
            # cuDNN's graphs; tuning on first use) happens here, not in the timed calls
            model.generate(prompt, max_new_tokens=workload.new_tokens, **options)
            _sync(device)
            prefills, steps = [], []
            for _ in range(GENERATE_REPEATS):
                stamps = _Stamps(device)
                start = time.perf_counter()
                tokens = model.generate(prompt, max_new_tokens=workload.new_tokens,
                                        logits_processor=LogitsProcessorList([stamps]), **options)
                prefills.append(stamps.times[0] - start)
                steps += [after - before for before, after in zip(stamps.times, stamps.times[1:])]
        results[implementation] = {"prefill_ms": statistics.median(prefills) * 1e3,
                                   # (a single new token has no step after it)
                                   "ms_per_token": statistics.median(steps) * 1e3 if steps else math.nan,
                                   "tokens": tokens[:, workload.prompt:].tolist()}
        del model
    return results


def run(interpret: bool = False) -> Report:
    """Train and generate with both implementations; rows per step (losses) and per implementation."""
    device = bench_device()
    workload = INTERPRETER_WORKLOAD if interpret or not on_gpu(device) else GPU_WORKLOAD
    trained, generated = train(workload, device), generate(workload, device)
    reference = trained["sdpa"]["losses"]
    gap = max(abs(a - b) / abs(b) for a, b in zip(trained["fatune"]["losses"], reference))
    pairs = [(a, b) for x, y in zip(generated["fatune"]["tokens"], generated["sdpa"]["tokens"]) for a, b in zip(x, y)]
    agreement = sum(a == b for a, b in pairs) / max(1, len(pairs))
    rows = [{"shape": workload.label(), "part": "train", "impl": impl, "step": step, "loss": loss}
            for impl in IMPLS for step, loss in enumerate(trained[impl]["losses"])]
    base = trained["sdpa"]["tokens_per_s"], generated["sdpa"]["ms_per_token"]
    summary_rows = [{"shape": workload.label(), "part": "summary", "impl": impl, "tokens_per_s": trained[impl]["tokens_per_s"],
                     "train_vs_sdpa": trained[impl]["tokens_per_s"] / base[0],
                     "prefill_ms": generated[impl]["prefill_ms"], "ms_per_token": generated[impl]["ms_per_token"],
                     "decode_vs_sdpa": base[1] / generated[impl]["ms_per_token"]} for impl in IMPLS]
    rows += summary_rows
    sizes = (f"Llama-style, {workload.layers} layers, hidden {workload.hidden}, {workload.heads} heads on "
             f"{workload.kv_heads} K/V heads of {workload.head_dim}, {str(workload.dtype).removeprefix('torch.')}")
    table = markdown_table(summary_rows, [
        ("impl", "impl"), ("train tokens/s", fmt("tokens_per_s", ".0f")), ("vs sdpa", fmt("train_vs_sdpa")),
        ("prefill ms", fmt("prefill_ms", ".1f")), ("decode ms/token", fmt("ms_per_token", ".2f")),
        ("vs sdpa", fmt("decode_vs_sdpa"))])
    markdown = (f"{sizes}. Training: batch {workload.batch} x {workload.length} tokens, {workload.steps} AdamW "
                f"steps on random tokens (throughput after {min(WARMUP_STEPS, workload.steps - 1)}); the loss curves differ by at most "
                f"{gap:.2%} (relative). Generation: batch {workload.generate_batch}, a {workload.prompt}-token "
                f"prompt, {workload.new_tokens} greedy tokens, DynamicCache; {agreement:.0%} of the generated "
                f"tokens the same from both (random weights: near-ties decide many).\n\n{table}\n")
    summary = {"loss_gap": gap, "token_agreement": agreement,
               **{f"{row['impl']}_{key}": row[key] for row in summary_rows
                  for key in ("tokens_per_s", "prefill_ms", "ms_per_token")}}
    return Report(NAME, rows, markdown, summary, plot=PLOT)
