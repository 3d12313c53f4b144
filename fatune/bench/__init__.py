"""`fatune bench`: suites that measure fatune beside torch SDPA's backends and FlexAttention.

Suites (`fatune bench --suite NAME`), one module each:

- dense (fatune.bench.dense): the training-step grid, D x causal x L x dtype, against SDPA's backends and
  Flex; geometric means of fatune's speed over each.
- masked (fatune.bench.masked): sliding windows, key padding, packed documents, GQA and boolean mask tensors
  against Flex and SDPA.
- inference (fatune.bench.inference): decode and chunked prefill against a KV cache, forward only, against SDPA.
- overhead (fatune.bench.overhead): the host cost of a call, forward and training step.
- search-quality (fatune.bench.search_quality): how fast a search finds the best config of a kernel's space.
- tuning-gain (fatune.bench.tuning_gain): tuned entries against the built-in heuristic.
- transformers (fatune.bench.models): a Hugging Face Llama-style model trained and generating on fatune and
  on SDPA.

Every suite writes the same files (fatune.bench.results: results.json, results.csv, bench.md, and bench.png
where it plots). Timing follows fatune.tuning.timing: random inputs, warm-up and compile outside the timed
region, CUDA events and medians. Only fatune.cli imports this package.
"""

from __future__ import annotations

SUITES = ("dense", "masked", "inference", "overhead", "search-quality", "tuning-gain", "transformers")

