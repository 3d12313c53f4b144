#!/usr/bin/env bash
# The GPU runs: pytest's GPU suites and the `fatune bench` suites, as the device tool runs them (repo root,
# .whl carried):
#   bash benchmarks/gpu_run.sh STAGE [STAGE ...]
# Stages write their logs and results under $RUN and keep going after a failure; after each stage everything is
# packed into $OUT/run.tar.gz, and the accuracy reports (one gpu_report.json.gwN per pytest-xdist worker) into
# $OUT/gpu_report.tar.gz besides (the device tool returns at most 8 files from $OUT).
# Two GPUs at once: install first (`gpu_run.sh install`), then one tagged run per GPU in parallel, e.g.
#   GPU_RUN_TAG=a CUDA_VISIBLE_DEVICES=0 bash benchmarks/gpu_run.sh masked & GPU_RUN_TAG=b CUDA_VISIBLE_DEVICES=1 ...
# (a tagged run packs into $OUT/run-TAG.tar.gz and $OUT/gpu_report-TAG.tar.gz; a second install is skipped).
#
# Stages:
#   install          the wheels in .whl/ (always done first, once per machine)
#   accuracy         every gpu-marked test but the serial timing/memory ones (FATUNE_GPU_REPORT)
#   core             the core accuracy tests (forward and gradients of the plain and causal kernels)
#   paged-accuracy   the paged KV cache and the random calls (FATUNE_GPU_REPORT)
#   compile          torch.compile modes from fresh processes, CUDA-graph capture
#   serial           timing and memory measurements, alone on the GPU
#   pytest           any selection: PYTEST_ARGS (default: -m gpu tests/test_variants.py)
#   transformers     the transformers GPU tests, with transformers 5 from wheels carried in .whl/hf (the machine's
#                    own lacks what attn_implementation="fatune" needs), fetched once here with
#                      pip download --only-binary=:all: --python-version 3.12 --implementation cp \
#                        --platform manylinux2014_x86_64 --platform any -d .whl/hf "transformers>=5"
#                    then removing from .whl/hf what the machine has: numpy, tqdm, rich, click, pygments,
#                    markdown-it-py, mdurl, typing_extensions
#   sanitize         a pytest selection under compute-sanitizer's memcheck: SAN_SEED (FATUNE_RANDOM_SEED),
#                    SAN_TESTS (pytest args; default the GPU random calls), SAN_K (-k)
#   dense            fatune bench --suite dense, bf16 then fp16 (DENSE_DTYPES), DENSE_ARGS (default: D 64/128/256,
#                    L 1k/4k/16k, fatune against cuDNN, FlashAttention-2 and Flex)
#   masked           fatune bench --suite masked (MASKED_ARGS, e.g. --lengths 2048,8192,32768 --tokens 32768)
#   inference        fatune bench --suite inference (INFERENCE_ARGS)
#   overhead         fatune bench --suite overhead (OVERHEAD_ARGS, e.g. --rounds 15)
#   search-quality   fatune bench --suite search-quality, resumable: SQ_ARGS (default --part grid; e.g. --part
#                    search --shapes 0,1 --seeds 0,1,2), SQ_FROM (an earlier run's output folder to extend)
#   tuning-gain      fatune bench --suite tuning-gain, resumable: TG_ARGS (default --part gain; --part nearest|tie),
#                    TG_FROM (an earlier run's output folder to extend)
#   group-split      benchmarks/group_split.py: the Gluon backward's group split on GQA shapes (GS_ARGS)
#   compiled-step    benchmarks/compiled_step.py: a compiled training step, fatune (routes) / SDPA / fatune's
#                    kernels (CS_ARGS)
#   db-refresh       the shipped DB of this GPU (REFRESH_DB; default tuned_db/nvidia-h100.sqlite on an H100, else
#                    tuned_db/nvidia-h200.sqlite): its stale entries re-timed beside the heuristic (fatune db
#                    refresh; REFRESH_ARGS, REFRESH_TIMEOUT s, default 480); the DB comes back in $OUT: commit it
set -uo pipefail
if [ ! -e /tmp/site/.installed ]; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl
  # bytecode, as a normal pip install writes it: without it every process (the search's compile pool included)
  # compiles optuna's and SQLAlchemy's sources when it imports them (~5 s per process, profiled)
  python3 -m compileall -q -j 0 /tmp/site > /dev/null
  # likewise the machine's torch environment, found without bytecode (its first backward imports sympy: seconds
  # of source compiling inside the search's first shape, which a user's pip-installed torch never pays)
  site=$(python3 -c "import os, sympy; print(os.path.dirname(os.path.dirname(sympy.__file__)))")
  [ -d "$site/sympy/__pycache__" ] || echo "no bytecode in $site: compiling sympy, mpmath, torch" | tee /tmp/site/bytecode.txt
  python3 -m compileall -q -j 0 "$site/sympy" "$site/mpmath" "$site/torch" > /dev/null 2>&1
  touch /tmp/site/.installed
fi
export PYTHONPATH=$PWD:/tmp/site PYTHONUNBUFFERED=1
FINAL=${OUT:-/tmp/fatune-out}
TAG=${GPU_RUN_TAG:+-$GPU_RUN_TAG}
RUN=/tmp/fatune-run$TAG
mkdir -p "$RUN" "$FINAL"
nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.mem --format=csv | tee "$RUN/gpu.txt"
python3 -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__, 'cuda', torch.version.cuda, 'cudnn', torch.backends.cudnn.version())" | tee -a "$RUN/gpu.txt"

bench() {  # bench SUITE NAME ARGS...: one fatune bench run into $RUN/NAME, its log beside, its summary printed
  local suite=$1 name=$2
  shift 2
  python3 -m fatune.cli bench --suite "$suite" -o "$RUN/$name" "$@" > "$RUN/$name.log" 2>&1
  echo "$suite: rc $?"
  if [ -e "$RUN/$name/bench.md" ]; then head -n 40 "$RUN/$name/bench.md"; else tail -n 20 "$RUN/$name.log"; fi
}

resume_from() {  # resume_from FOLDER NAME: an earlier run's state.json into $RUN/NAME, to extend it
  [ -n "$1" ] || return 0
  mkdir -p "$RUN/$2" && cp "$1/state.json" "$RUN/$2/state.json"
}

pack_reports() {  # every xdist worker's accuracy report (gpu_report*.json.gwN) in one archive
  local reports
  reports=$(cd "$RUN" && ls gpu_report*.json* 2>/dev/null)
  [ -n "$reports" ] && (cd "$RUN" && tar -czf "$FINAL/gpu_report$TAG.tar.gz" $reports) \
    && echo "$(echo "$reports" | wc -l) accuracy reports in $FINAL/gpu_report$TAG.tar.gz"
}

for stage in "$@"; do
  echo "=== $stage $(date -u +%H:%M:%S)"
  case "$stage" in
    install) ;;  # the wheels only (done above)
    accuracy)
      FATUNE_GPU_REPORT="$RUN/gpu_report.json" python3 -m pytest -m "gpu and not serial" -n 16 -q -p no:cacheprovider \
        > "$RUN/accuracy.log" 2>&1; tail -n 30 "$RUN/accuracy.log"; pack_reports ;;
    core)
      python3 -m pytest tests/test_flash_attention.py -m "gpu and not serial" -n 16 -q -p no:cacheprovider \
        > "$RUN/core.log" 2>&1; tail -n 30 "$RUN/core.log" ;;
    paged-accuracy)
      FATUNE_GPU_REPORT="$RUN/gpu_report-paged.json" python3 -m pytest tests/test_paged.py tests/test_random_calls.py \
        -m gpu -n 16 -q -p no:cacheprovider > "$RUN/paged-accuracy.log" 2>&1; tail -n 5 "$RUN/paged-accuracy.log"
      pack_reports ;;
    compile)
      python3 -m pytest tests/test_custom_op.py -m gpu -n 6 -q -p no:cacheprovider > "$RUN/compile.log" 2>&1
      tail -n 30 "$RUN/compile.log" ;;
    serial)
      python3 -m pytest -m "gpu and serial" -q -s -p no:cacheprovider > "$RUN/serial.log" 2>&1; tail -n 30 "$RUN/serial.log" ;;
    pytest)
      python3 -m pytest ${PYTEST_ARGS:--m gpu tests/test_variants.py} -q -p no:cacheprovider > "$RUN/pytest.log" 2>&1
      tail -n 10 "$RUN/pytest.log" ;;
    transformers)
      [ -e /tmp/site-hf/.installed ] || { python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir \
        --target /tmp/site-hf .whl/hf/*.whl && touch /tmp/site-hf/.installed; }
      PYTHONPATH=$PWD:/tmp/site-hf:/tmp/site python3 -m pytest -m gpu tests/test_huggingface.py -q -p no:cacheprovider \
        > "$RUN/transformers.log" 2>&1; tail -n 10 "$RUN/transformers.log" ;;
    sanitize)  # compute-sanitizer runs on Firecracker machines only
      sanitizer=$(command -v compute-sanitizer || ls /usr/local/cuda*/bin/compute-sanitizer 2>/dev/null | head -n 1)
      env ${SAN_SEED:+FATUNE_RANDOM_SEED=$SAN_SEED} "$sanitizer" --tool memcheck --print-limit 20 python3 -m pytest \
        ${SAN_TESTS:-tests/test_random_calls.py} -m gpu -k "${SAN_K:-}" -x -q -p no:cacheprovider > "$RUN/sanitize.log" 2>&1
      grep -E "Invalid|ERROR SUMMARY|at 0x|passed|failed|by thread" "$RUN/sanitize.log" | head -n 40 ;;
    dense)
      for dtype in ${DENSE_DTYPES:-bf16 fp16}; do
        bench dense "dense-$dtype" --dtypes "$dtype" \
          ${DENSE_ARGS:---head-dims 64,128,256 --lengths 1024,4096,16384 --impls fatune,sdpa-cudnn,sdpa-flash,flex}
      done ;;
    masked)
      bench masked masked ${MASKED_ARGS:-} ;;
    inference)
      bench inference inference ${INFERENCE_ARGS:-} ;;
    overhead)
      bench overhead overhead ${OVERHEAD_ARGS:-} ;;
    search-quality)
      resume_from "${SQ_FROM:-}" search-quality
      bench search-quality search-quality ${SQ_ARGS:---part grid} ;;
    tuning-gain)
      resume_from "${TG_FROM:-}" tuning-gain
      bench tuning-gain tuning-gain ${TG_ARGS:---part gain} ;;
    group-split)
      python3 benchmarks/group_split.py --out "$RUN/group-split.csv" ${GS_ARGS:-} > "$RUN/group-split.log" 2>&1
      tail -n 40 "$RUN/group-split.log" ;;
    compiled-step)
      python3 benchmarks/compiled_step.py --out "$RUN/compiled-step.csv" ${CS_ARGS:-} > "$RUN/compiled-step.log" 2>&1
      tail -n 40 "$RUN/compiled-step.log" ;;
    db-refresh)  # it writes each entry as it finishes: cut at REFRESH_TIMEOUT it keeps what it wrote, and the DB
      # still comes back; run it again to go on (refreshed entries are current: not timed twice)
      case "$(nvidia-smi --query-gpu=name --format=csv,noheader | head -n 1)" in
        *H100*) db=${REFRESH_DB:-tuned_db/nvidia-h100.sqlite} ;;
        *) db=${REFRESH_DB:-tuned_db/nvidia-h200.sqlite} ;;
      esac
      timeout "${REFRESH_TIMEOUT:-480}" python3 -m fatune.cli db refresh --db "$db" ${REFRESH_ARGS:-} \
        > "$RUN/db-refresh.log" 2>&1; echo "rc $?" >> "$RUN/db-refresh.log"
      python3 -c "import sqlite3; sqlite3.connect('$db').execute('pragma journal_mode=delete').fetchall()"
      cp "$db" "$FINAL/"
      tail -n 3 "$RUN/db-refresh.log" ;;
    *)
      echo "unknown stage $stage" ;;
  esac
  tar -czf "$FINAL/run$TAG.tar.gz" -C "$RUN" .
done
echo "=== done $(date -u +%H:%M:%S)"
