#!/usr/bin/env bash
# The GPU runs of a session, as the device tool runs them (repo root, .whl carried):
#   bash benchmarks/gpu_run.sh STAGE [STAGE ...]
# Stages write their logs under $RUN and keep going after a failure; after each stage everything is packed
# into $OUT/run.tar.gz (the device tool returns at most 8 files from $OUT).
# Two GPUs at once: install first (`gpu_run.sh install`), then one tagged run per GPU in parallel, e.g.
#   GPU_RUN_TAG=a CUDA_VISIBLE_DEVICES=0 bash benchmarks/gpu_run.sh masked & GPU_RUN_TAG=b CUDA_VISIBLE_DEVICES=1 ...
# (a tagged run packs into $OUT/run-TAG.tar.gz, a second install is skipped).
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
OUT=/tmp/fatune-run$TAG
mkdir -p "$OUT" "$FINAL"
nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.mem --format=csv | tee "$OUT/gpu.txt"
python3 -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__, 'cuda', torch.version.cuda, 'cudnn', torch.backends.cudnn.version())" | tee -a "$OUT/gpu.txt"

for stage in "$@"; do
  echo "=== $stage $(date -u +%H:%M:%S)"
  case "$stage" in
    install) ;;  # the wheels only (done above)
    overhead)  # host cost per call: forward and training step, fatune vs SDPA
      python3 -m fatune.cli bench --overhead 2>&1 | tee "$OUT/overhead.txt" ;;
    host-parts)  # the pieces of a training step's host cost, real launches (tensor vs integer pointers); HP_ARGS=--profile
      # adds cProfiles of causal steps (is_causal, then a bool mask)
      python3 benchmarks/host_cost.py --gpu-parts ${HP_ARGS:-} 2>&1 | tee "$OUT/host-parts.txt" ;;
    compile)  # torch.compile modes from fresh processes, CUDA-graph capture
      python3 -m pytest tests/test_custom_op.py -m gpu -n 6 -q -p no:cacheprovider > "$OUT/compile.log" 2>&1; tail -n 30 "$OUT/compile.log" ;;
    accuracy)  # every gpu-marked test but the serial timing/memory ones
      FATUNE_GPU_REPORT="$OUT/gpu_report.json" python3 -m pytest -m "gpu and not serial" -n 16 -q -p no:cacheprovider \
        > "$OUT/accuracy.log" 2>&1; tail -n 30 "$OUT/accuracy.log" ;;
    core)  # the core accuracy tests only (forward and gradients of the plain and causal kernels)
      python3 -m pytest tests/test_flash_attention.py -m "gpu and not serial" -n 16 -q -p no:cacheprovider \
        > "$OUT/core.log" 2>&1; tail -n 30 "$OUT/core.log" ;;
    inference-accuracy)  # split-KV, GQA packing and the dispatched decode config against the accuracy rule
      python3 -m pytest tests/test_variants.py -k gpu_split_kv -m gpu -n 8 -q -p no:cacheprovider \
        > "$OUT/inference-accuracy.log" 2>&1; tail -n 5 "$OUT/inference-accuracy.log" ;;
    paged-accuracy)  # the paged KV cache and the random calls (plain and paged) against the accuracy rule
      FATUNE_GPU_REPORT="$OUT/gpu_report-paged.json" python3 -m pytest tests/test_paged.py tests/test_random_calls.py \
        -m gpu -n 16 -q -p no:cacheprovider > "$OUT/paged-accuracy.log" 2>&1; tail -n 5 "$OUT/paged-accuracy.log" ;;
    serial)  # timing and memory measurements, alone on the GPU
      python3 -m pytest -m "gpu and serial" -q -s -p no:cacheprovider > "$OUT/serial.log" 2>&1; tail -n 30 "$OUT/serial.log" ;;
    inference)  # decode and chunked prefill against a KV cache, forward only (issue 15's shapes)
      python3 -m fatune.cli bench --inference -o "$OUT/inference" > "$OUT/inference.log" 2>&1
      tail -n 12 "$OUT/inference.log" ;;
    gqa)  # GQA 8:1 causal, d128, L=8192: dispatched, heuristic, no structure, competitors
      python3 -m fatune.cli bench --head-dims 128 --lengths 8192 --causal yes --gqa 8 \
        --impls fatune,fatune-plain,sdpa-cudnn,sdpa-flash,flex -o "$OUT/gqa" > "$OUT/gqa.log" 2>&1
      head -n 8 "$OUT/gqa/bench.md" ;;
    grid4k)  # the plain grid at L=4096, bf16, d64/d128, causal and not
      python3 -m fatune.cli bench --lengths 4096 --impls fatune,sdpa-cudnn,sdpa-flash,flex \
        -o "$OUT/grid4k" > "$OUT/grid4k.log" 2>&1
      head -n 12 "$OUT/grid4k/bench.md" ;;
    grid4k-all)  # the training-step grid at L=4096, bf16, d64/d128/d256, causal and not (issue 11's table)
      python3 -m fatune.cli bench --lengths 4096 --head-dims 64,128,256 --impls fatune,sdpa-cudnn,sdpa-flash,flex \
        -o "$OUT/grid4k-all" > "$OUT/grid4k-all.log" 2>&1
      head -n 14 "$OUT/grid4k-all/bench.md" ;;
    grid-full)  # issue 11's whole training-step grid: D 64/128/256, L 1k/4k/16k, causal and not, bf16 then fp16
      for dtype in bf16 fp16; do
        python3 -m fatune.cli bench --head-dims 64,128,256 --lengths 1024,4096,16384 --dtypes $dtype \
          --impls fatune,sdpa-cudnn,sdpa-flash,flex -o "$OUT/grid-full-$dtype" > "$OUT/grid-full-$dtype.log" 2>&1
        grep -E "geometric" "$OUT/grid-full-$dtype/bench.md"
      done ;;
    grid-causal)  # the causal shapes of the grid at d64/d128 in bf16 (where the heuristic runs atomic dQ and its Delta pass)
      python3 -m fatune.cli bench --head-dims 64,128 --lengths 1024,4096,16384 --causal yes --dtypes bf16 \
        --impls fatune,sdpa-cudnn,flex -o "$OUT/grid-causal" > "$OUT/grid-causal.log" 2>&1
      head -n 14 "$OUT/grid-causal/bench.md" ;;
    grid-d256)  # issue 11's training-step grid at head dim 256: L = 1k/4k/16k, causal and not, bf16 and fp16 (D256_DTYPES)
      python3 -m fatune.cli bench --lengths 1024,4096,16384 --head-dims 256 --dtypes ${D256_DTYPES:-bf16,fp16} \
        --impls fatune,sdpa-cudnn,sdpa-flash,flex -o "$OUT/grid-d256" > "$OUT/grid-d256.log" 2>&1
      head -n 16 "$OUT/grid-d256/bench.md" ;;
    stream-probe)  # issue 11: the backward's dQ kernel beside its dK/dV kernel on a second stream (timing probe)
      python3 benchmarks/stream_probe.py "$OUT/stream-probe.json" ${STREAM_ARGS:---masked} > "$OUT/stream-probe.log" 2>&1
      tail -n 26 "$OUT/stream-probe.log" ;;
    split-accuracy)  # dK/dV's head-dim split and every head-dim case against the accuracy rule
      FATUNE_GPU_REPORT="$OUT/gpu_report-split.json" python3 -m pytest tests/test_variants.py \
        -k "gpu_split_d or gpu_variant" -m gpu -n 8 -q -p no:cacheprovider > "$OUT/split-accuracy.log" 2>&1
      tail -n 8 "$OUT/split-accuracy.log" ;;
    decode-sweep)  # forward configs on the decode shapes (evidence for the decode heuristic)
      python3 benchmarks/decode_sweep.py "$OUT/decode-sweep.json" > "$OUT/decode-sweep.log" 2>&1
      tail -n 20 "$OUT/decode-sweep.log" ;;
    precompile)  # the compile pool's binaries are Triton cache hits for the timed launches
      python3 -m pytest tests/test_precompile.py -m gpu -q -p no:cacheprovider > "$OUT/precompile.log" 2>&1
      tail -n 3 "$OUT/precompile.log" ;;
    search-time)  # wall time per shape (one shape, 30 trials per kernel) and where it goes (the breakdown table
      # at the end of each log); fresh DB, Optuna storage and Triton cache per run, so nothing is a cache hit.
      # SEARCH_TIME_CW: the --compile-workers values to run ("default" = fatune's own choice), ~30-60 s each.
      i=0
      for cw in ${SEARCH_TIME_CW:-default}; do
        i=$((i + 1)) dir=$(mktemp -d)
        flag=$([ "$cw" = default ] || echo "--compile-workers $cw")
        start=$(date +%s.%N)
        TRITON_CACHE_DIR=$dir/triton python3 -m fatune.cli search --head-dim 64 --dtype bf16 --lengths 4096 \
          --mask causal --trials 30 $flag --db "$dir/tuned.sqlite" > "$OUT/search-$i-cw$cw.log" 2>&1
        echo "compile-workers $cw: rc $? wall $(python3 -c "import time; print(round(time.time() - $start, 1))") s" \
          | tee -a "$OUT/search-time.txt"
        tail -n 8 "$OUT/search-$i-cw$cw.log"
      done ;;
    search-profile)  # cProfile of one search-time shape (fresh caches): where the owner process's time goes
      dir=$(mktemp -d)
      TRITON_CACHE_DIR=$dir/triton python3 -m cProfile -o "$OUT/search.prof" -m fatune.cli search --head-dim 64 \
        --dtype bf16 --lengths 4096 --mask causal --trials 30 --db "$dir/tuned.sqlite" > "$OUT/search-profile.log" 2>&1
      tail -n 3 "$OUT/search-profile.log"
      python3 -c "import pstats; s = pstats.Stats('$OUT/search.prof'); s.sort_stats('cumulative').print_stats(60); \
s.sort_stats('tottime').print_stats(30)" > "$OUT/search-profile.txt"; grep -A 12 "ncalls" "$OUT/search-profile.txt" ;;
    ship-db)  # issue 14's shipped H200 DB, built over several GPU commands (run it on the 2-GPU machine: --workers
      # defaults to one per GPU). Resumable: the DB (tuned_db/) and its Optuna storage (benchmarks/results/; commit both after each
      # run); searches listed in benchmarks/results/ship-db-h200-done.txt are skipped, an interrupted one resumes its
      # studies from the storage. SHIP_DEADLINE (s, default
      # 480): no new search starts after it. Build it once the templates stop changing: their hash keys every entry.
      # Trials per kernel per shape: SHIP_TRIALS (20); fp16 SHIP_TRIALS_FP16 (4: its studies start from the heuristic
      # and the bf16 winner of the same lengths; in the 147 fp16 studies of 16 trials stored by session 16, the
      # first 3 trials were within 1% of the final best in every one: benchmarks/trial_budget.py).
      # A window is searched only at lengths it does not cover (L_q + L_k > width: a wider one is dropped by the
      # call, leaving plain causal, which the "both" search has). L = 32768 (B = 1) is searched apart with a quarter
      # of the default heads (SHIP_LONG_HEADS_DIV, 4; at least 2, and a whole GQA group): its steps are the longest
      # by far (63% of a "both" search's wall time at d64 with 32 heads, session 10; a bf16 d80 GQA 4:1 search with
      # 32 heads there ran past 5.5 minutes, session 18), and a quarter of the heads still gives every kernel at
      # least 512 programs (~4 waves or more); the DB key has no head count. Key padding keeps its heads (a quarter
      # of the keys: most dK/dV programs have no work). The shorter lengths' part, once stored, is recorded as
      # "dtype dD mask short" and not searched again when a cut run resumes.
      db=tuned_db/nvidia-h200.sqlite storage=sqlite:///$PWD/benchmarks/results/ship-db-h200-optuna.sqlite
      # a killed earlier run's WAL files do not belong to the DBs the device tool copied in again
      rm -f "$db"-wal "$db"-shm benchmarks/results/ship-db-h200-optuna.sqlite-wal benchmarks/results/ship-db-h200-optuna.sqlite-shm
      stored=benchmarks/results/ship-db-h200-done.txt  # the searches whose winners are stored (commit it with the DB)
      deadline=$(( $(date +%s) + ${SHIP_DEADLINE:-480} ))
      save() {  # the DB and the Optuna storage (consistent copies, WAL included) and the logs to $FINAL at once: a
        # run cut by the device's time limit keeps them (a cut run's next run resumes its studies from the storage)
        for pair in "$db $FINAL/nvidia-h200.sqlite" "${storage#sqlite:///} $FINAL/ship-db-h200-optuna.sqlite"; do
          python3 -c "import sqlite3, sys; d = sqlite3.connect(sys.argv[2]); sqlite3.connect(sys.argv[1]).backup(d)
d.execute('pragma journal_mode=delete')" $pair
        done
        gzip -f "$FINAL/ship-db-h200-optuna.sqlite"  # 14 MB of SQLite pages: ~3 MB (at most 16 MiB a file comes back)
        cp "$stored" "$OUT/ship-db.txt" "$OUT/ship-db.log" "$FINAL/"
      }
      search() {  # search HEADS LENGTHS: one search of this grid cell (HEADS empty: the search's default)
        local heads_args=()
        [ -n "$1" ] && heads_args=(--heads "$1") && [ "$group" -gt 1 ] && heads_args+=(--kv-heads $(( $1 / group )))
        python3 -m fatune.cli search --head-dim "$d" --dtype "$dtype" --lengths "$2" $extra "${heads_args[@]}" \
          --trials "$trials" --db "$db" --storage "$storage" >> "$OUT/ship-db.log" 2>&1
      }
      while read -r dtype dims masks; do
        for d in ${dims//,/ }; do
          for mask in ${masks//,/ }; do
            [ "$(date +%s)" -ge "$deadline" ] && break 3
            group=1 heads=""
            case "$mask" in
              gqa4|gqa8) group=${mask#gqa} heads=32 extra="--mask both" ;;
              window?*) extra="--mask window --window ${mask#window}" ;;  # "window" alone: search's default, 256
              # cu_seqlens: 5 documents of unequal lengths cut from 5 x L tokens (mean length L; the DB key is the
              # longest): the default batch (16384 tokens) would pack the same documents at every L <= 8192
              packed) extra="--mask packed --documents 5 --batch 5" ;;
              *) extra="--mask $mask" ;;
            esac
            lengths=512,2048,8192,32768
            case "$mask" in window1024) lengths=2048,8192,32768 ;; window4096) lengths=8192,32768 ;; esac
            grep -qx "$dtype d$d $mask" "$stored" 2>/dev/null && continue  # stored by an earlier run
            # SHIP_ONLY: an extended regex over "dtype dD mask", the searches this run may start (e.g. "^fp16 d80 ")
            [[ -n "${SHIP_ONLY:-}" && ! "$dtype d$d $mask" =~ $SHIP_ONLY ]] && continue
            echo "--- $dtype d$d $mask $(date -u +%H:%M:%S)" | tee -a "$OUT/ship-db.txt"
            trials=${SHIP_TRIALS:-20}
            [ "$dtype" = fp16 ] && trials=${SHIP_TRIALS_FP16:-4}
            long=""
            [ "$mask" != padding ] && [ "${SHIP_LONG_HEADS_DIV:-4}" -gt 1 ] && long=32768 && lengths=${lengths%,32768}
            rc=0
            if ! grep -qx "$dtype d$d $mask short" "$stored" 2>/dev/null; then
              search "$heads" "$lengths"; rc=$?
              [ $rc = 0 ] && [ -n "$long" ] && echo "$dtype d$d $mask short" >> "$stored" && save
            fi
            if [ -n "$long" ] && [ $rc = 0 ]; then
              long_heads=$(( 2048 / d / ${SHIP_LONG_HEADS_DIV:-4} )); [ "$long_heads" -lt 2 ] && long_heads=2
              long_heads=$(( (long_heads + group - 1) / group * group ))  # a whole number of K/V heads
              search "$long_heads" "$long"; rc=$?
            fi
            echo "rc $rc" >> "$OUT/ship-db.txt"
            [ $rc = 0 ] && echo "$dtype d$d $mask" >> "$stored"
            save
          done
        done
      done <<'GRID'
bf16 128,64 both,window,window1024,window4096,padding,gqa4,gqa8,packed
fp16 128,64 both,window,window1024,window4096,padding,gqa4,gqa8,packed
bf16 80,96,192,256 both,window,window1024,window4096,padding,gqa4,gqa8
fp16 80,96,192,256 both,window,window1024,window4096,padding,gqa4,gqa8
GRID
      # shipped in rollback-journal mode: a read-only site-packages cannot hold a WAL file's -wal/-shm companions
      python3 -c "import sqlite3; sqlite3.connect('$db').execute('pragma journal_mode=delete').fetchall()"
      cp "$db" benchmarks/results/ship-db-h200-optuna.sqlite "$stored" "$OUT/" 2>/dev/null
      python3 -m fatune.cli db list --db "$db" | tail -n 5 ;;
    db-refresh)  # the shipped H200 DB's stale entries (kernels changed since they were timed) re-timed beside the
      # heuristic with today's kernels, the faster kept (fatune db refresh; REFRESH_ARGS: e.g. --head-dim 64).
      # It writes each entry as it finishes: cut at REFRESH_TIMEOUT (s, default 480) it keeps what it wrote, and
      # the DB still comes back; run it again to go on (refreshed entries are current: not timed twice). Commit it.
      db=tuned_db/nvidia-h200.sqlite
      timeout "${REFRESH_TIMEOUT:-480}" python3 -m fatune.cli db refresh --db "$db" ${REFRESH_ARGS:-} \
        > "$OUT/db-refresh.log" 2>&1; echo "rc $?" >> "$OUT/db-refresh.log"
      python3 -c "import sqlite3; sqlite3.connect('$db').execute('pragma journal_mode=delete').fetchall()"
      cp "$db" "$OUT/"
      tail -n 3 "$OUT/db-refresh.log" ;;
    gqa-concurrent)  # session 13's heuristic change (causal GQA d65..128: the dQ kernel beside dK/dV): the shipped DB's
      # current entries of those keys re-timed beside the new heuristic (fatune db refresh --include-current), then GQA 4:1/8:1
      # causal d128 training steps against cuDNN and Flex, then the gpu tests of concurrent dQ and GQA
      db=tuned_db/nvidia-h200.sqlite
      for g in 4 8; do
        timeout 240 python3 -m fatune.cli db refresh --db "$db" --include-current --head-dim 128 --mask causal --group $g \
          >> "$OUT/gqa-refresh.log" 2>&1; echo "group $g: rc $?" >> "$OUT/gqa-refresh.log"
      done
      python3 -c "import sqlite3; sqlite3.connect('$db').execute('pragma journal_mode=delete').fetchall()"
      cp "$db" "$OUT/"; tail -n 12 "$OUT/gqa-refresh.log"
      for g in 4 8; do
        python3 -m fatune.cli bench --head-dims 128 --lengths 2048,8192 --causal yes --gqa $g --dtypes bf16,fp16 \
          --impls fatune,fatune-heuristic,sdpa-cudnn,flex -o "$OUT/gqa$g" > "$OUT/gqa$g.log" 2>&1
        grep -E "^\| (bfloat16|float16) \||geometric" "$OUT/gqa$g/bench.md"
      done
      FATUNE_GPU_REPORT="$OUT/gpu_report-gqa.json" python3 -m pytest -m gpu -k "concurrent or gqa" -n 16 -q \
        -p no:cacheprovider > "$OUT/gqa-accuracy.log" 2>&1; tail -n 3 "$OUT/gqa-accuracy.log" ;;
    sweep2)  # the default sweep (L = 512..16384, causal and not: 12 shapes) with --workers 1, then --workers 2
      # (run on the 2-GPU machine). Each run gets a fresh DB, Optuna storage and Triton cache (the second is not a
      # cache hit of the first; its two workers share one cache, as on any host). SWEEP_TRIALS per kernel per
      # shape (default 10: at <= 0.6 s per trial both runs take <= ~7.5 min); SWEEP_TIMEOUT cuts a run (s).
      trials=${SWEEP_TRIALS:-10}
      for workers in 1 2; do
        dir=$(mktemp -d)
        start=$(date +%s.%N)
        TRITON_CACHE_DIR=$dir/triton timeout "${SWEEP_TIMEOUT:-280}" python3 -m fatune.cli search --head-dim 64 \
          --dtype bf16 --trials "$trials" --workers $workers --db "$dir/tuned.sqlite" > "$OUT/sweep2-w$workers.log" 2>&1
        echo "workers $workers, trials $trials: rc $? wall $(python3 -c "import time; print(round(time.time() - $start, 1))") s" \
          | tee -a "$OUT/sweep2.txt"
        grep -E "shapes, .* trials in" "$OUT/sweep2-w$workers.log"
      done ;;
    bwd-variants)  # backward structure (separate dQ kernel vs atomic dQ) over dK/dV tiles, L=4096, d64/128/256
      python3 benchmarks/bwd_variants.py "$OUT/bwd-variants.json" --lengths ${BWD_LENGTHS:-4096} \
        > "$OUT/bwd-variants.log" 2>&1; tail -n 80 "$OUT/bwd-variants.log" ;;
    bwd-d256)  # dK/dV tiles (pointer and TMA loads) and dQ tiles at head dim 256, the weakest (BWD_LENGTHS)
      python3 benchmarks/bwd_variants.py "$OUT/bwd-d256.json" --head-dims 256 --lengths ${BWD_LENGTHS:-4096} \
        --kernels dkdv,dq --tma > "$OUT/bwd-d256.log" 2>&1; tail -n 40 "$OUT/bwd-d256.log" ;;
    bwd-split)  # dK/dV's head-dim split (split_d=2) vs not over SPLIT_TILES, TMA loads, atomic dQ by TMA reductions
      # or the dQ kernel, d128 and d256 at L=4096 (BWD_DIMS, BWD_LENGTHS)
      python3 benchmarks/bwd_variants.py "$OUT/bwd-split.json" --head-dims ${BWD_DIMS:-128,256} \
        --lengths ${BWD_LENGTHS:-4096} --split --atomic > "$OUT/bwd-split.log" 2>&1; tail -n 60 "$OUT/bwd-split.log" ;;
    maxnreg)  # the heuristic's kernels with registers per thread capped (LaunchConfig.maxnreg), one kernel at a time,
      # d64/d128/d256 at L=4096 (MAXNREG_ARGS: --caps, --head-dims, --lengths; issue 11)
      python3 benchmarks/maxnreg_sweep.py "$OUT/maxnreg.json" ${MAXNREG_ARGS:-} > "$OUT/maxnreg.log" 2>&1
      tail -n 90 "$OUT/maxnreg.log" ;;
    dkdv-split)  # d256 dK/dV with the head dim split over two programs vs not, a standalone probe (issue 11)
      python3 benchmarks/dkdv_split_probe.py "$OUT/dkdv-split.json" --lengths ${BWD_LENGTHS:-4096} \
        > "$OUT/dkdv-split.log" 2>&1; tail -n 14 "$OUT/dkdv-split.log" ;;
    persistent-probe)  # a causal forward launched per tile vs persistent (two tile orders), standalone (issue 11)
      python3 benchmarks/persistent_probe.py "$OUT/persistent-probe.json" > "$OUT/persistent-probe.log" 2>&1
      tail -n 20 "$OUT/persistent-probe.log" ;;
    bwd-tma-dq)  # dQ added by TMA reductions (atomic_dq=2) vs element atomics vs the separate dQ kernel, per dK/dV tile
      python3 benchmarks/bwd_variants.py "$OUT/bwd-tma-dq.json" --head-dims ${BWD_DIMS:-64,128} --lengths ${BWD_LENGTHS:-4096} \
        --kernels dkdv --atomic > "$OUT/bwd-tma-dq.log" 2>&1; tail -n 80 "$OUT/bwd-tma-dq.log" ;;
    bwd-tma)  # dK/dV with TMA query and dO loads vs pointer loads per tile (with atomic dQ kinds: BWD_ARGS=--atomic)
      python3 benchmarks/bwd_variants.py "$OUT/bwd-tma.json" --head-dims ${BWD_DIMS:-64,128} --lengths ${BWD_LENGTHS:-4096} \
        --kernels dkdv --tma ${BWD_ARGS:-} > "$OUT/bwd-tma.log" 2>&1; tail -n 80 "$OUT/bwd-tma.log" ;;
    fwd-variants)  # forward plain vs TMA variants per tile, d64/128/256 and GQA 8:1 (FWD_ARGS: --quick ...)
      python3 benchmarks/fwd_variants.py --out "$OUT/fwd-variants.json" --jobs 16 ${FWD_ARGS:-} > "$OUT/fwd-variants.log" 2>&1
      tail -n 60 "$OUT/fwd-variants.log" ;;
    masked)  # issue 12's cases: windows, GQA, key padding, packed documents vs Flex and SDPA (MASKED_ARGS: --quick)
      python3 benchmarks/masked_cases.py "$OUT/masked.json" ${MASKED_ARGS:-} > "$OUT/masked.log" 2>&1
      tail -n 20 "$OUT/masked.log" ;;
    mask-spans)  # mask tensors with spans: the gpu tests of fatune.mask_spans, then the mask-tensor cases (causal, prefix
      # LM, random) beside is_causal at d128 and d256 (MS_DIMS), L = 2048 and 8192 (MS_LENGTHS), against Flex (a block
      # mask per batch element) and SDPA's mask-tensor backends; MS_ARGS=--profile adds GPU time per kernel of a step
      python3 -m pytest tests/test_mask_spans.py -m gpu -n 16 -q -p no:cacheprovider > "$OUT/mask-spans-tests.log" 2>&1
      tail -n 3 "$OUT/mask-spans-tests.log"
      for d in ${MS_DIMS:-128 256}; do
        python3 benchmarks/masked_cases.py "$OUT/mask-tensor-d$d.json" --head-dim $d --lengths "${MS_LENGTHS:-2048,8192}" \
          --only "causal formula,mask tensor" ${MS_ARGS:-} > "$OUT/mask-tensor-d$d.log" 2>&1
        grep -E "mask tensor|causal formula|step kernels" "$OUT/mask-tensor-d$d.log"
      done ;;
    spans-probe)  # GPU time of the mask spans' scans per direction, grain and tile, beside torch's reductions
      python3 benchmarks/spans_probe.py "$OUT/spans-probe.json" > "$OUT/spans-probe.log" 2>&1
      grep -E "torch amax|both directions" "$OUT/spans-probe.log"; grep -c DIFFERENT "$OUT/spans-probe.log" ;;
    bench-masked)  # issue 12's cases through fatune bench at L = 2048, 8192, 32768 (BM_LENGTHS): windows 256/1024/4096,
      # key padding, packed documents 2/5/64 (Flex with a document mask), causal GQA 8:1; fatune vs Flex and SDPA
      for args in "--mask window --window 256" "--mask window --window 1024" "--mask window --window 4096" \
                  "--mask padding --valid-keys 0.5" "--mask packed --documents 2" "--mask packed --documents 5" \
                  "--mask packed --documents 64" "--mask none --gqa 8"; do
        case "$args" in *"${BM_ONLY:-}"*) ;; *) continue ;; esac  # BM_ONLY: e.g. "packed", the cases to run
        name=$(echo "$args" | tr -c 'a-z0-9\n' '-' | tr -s '-')
        # packed documents: one pack of L tokens per length (issue 12: 5 documents in 8192 tokens); a fixed
        # token count would pack the same documents at every length
        case "$args" in *packed*) runs=$(echo "${BM_LENGTHS:-2048,8192,32768}" | tr ',' ' ') ;; *) runs=all ;; esac
        for run in $runs; do
          if [ "$run" = all ]; then sizes=(--lengths "${BM_LENGTHS:-2048,8192,32768}" --tokens 32768); dir=bench$name
          else sizes=(--lengths "$run" --tokens "$run"); dir=bench$name-l$run; fi
          python3 -m fatune.cli bench --head-dims 128 "${sizes[@]}" --causal yes $args \
            --impls fatune,flex,sdpa-cudnn,sdpa-flash,sdpa-efficient -o "$OUT/$dir" > "$OUT/$dir.log" 2>&1
          grep -E "^\| |geometric" "$OUT/$dir/bench.md" | head -12
        done
      done ;;
    flex-anatomy)  # Flex's compiled kernels beside fatune's on issue 12's cases (FA_CASES; FA_LENGTH; FA_BATCH; FA_CONFIGS: fatune configs
      # to time too): step kernels' GPU time, tiles, warps, stages, registers, spills; Flex's sources kept
      for case in ${FA_CASES:-window1024}; do
        python3 benchmarks/flex_anatomy.py "$OUT/anatomy-$case" --case "$case" --length "${FA_LENGTH:-8192}" --batch "${FA_BATCH:-2}" \
          --configs "${FA_CONFIGS:-}" > "$OUT/anatomy-$case.log" 2>&1
        rm -rf "$OUT/anatomy-$case/triton-cache" "$OUT/anatomy-$case/inductor-cache"
        tail -n 40 "$OUT/anatomy-$case.log"
      done ;;
    sanitize)  # one pytest selection under compute-sanitizer's memcheck (Firecracker machines only), e.g. a random call
      # that faulted: SAN_SEED (FATUNE_RANDOM_SEED), SAN_TESTS (pytest args; default the GPU random calls), SAN_K (-k)
      sanitizer=$(command -v compute-sanitizer || ls /usr/local/cuda*/bin/compute-sanitizer 2>/dev/null | head -n 1)
      env ${SAN_SEED:+FATUNE_RANDOM_SEED=$SAN_SEED} "$sanitizer" --tool memcheck --print-limit 20 python3 -m pytest \
        ${SAN_TESTS:-tests/test_random_calls.py} -m gpu -k "${SAN_K:-}" -x -q -p no:cacheprovider > "$OUT/sanitize.log" 2>&1
      grep -E "Invalid|ERROR SUMMARY|at 0x|passed|failed|by thread" "$OUT/sanitize.log" | head -n 40 ;;
    ncu)  # Nsight Compute's counters (stall reasons, pipes, shared-memory conflicts, per-instruction SASS samples) for
      # every kernel of one warm training step of fatune and of Flex (NCU_CASE, NCU_LENGTH, NCU_BATCH, NCU_CONFIGS as
      # flex-anatomy's; NCU_KERNELS: a regex of kernel names); the clocks are left alone
      ncu_bin=$(command -v ncu || ls /opt/nvidia/nsight-compute/*/ncu 2>/dev/null | tail -n 1)
      rep=/tmp/ncu-${NCU_CASE:-causal}
      "$ncu_bin" --clock-control none --profile-from-start off --set full --import-source yes -f -o "$rep" \
        -k "regex:${NCU_KERNELS:-.}" python3 benchmarks/flex_anatomy.py /tmp/ncu-anatomy --case "${NCU_CASE:-causal}" \
        --length "${NCU_LENGTH:-2048}" --batch "${NCU_BATCH:-16}" --configs "${NCU_CONFIGS:-}" --profile \
        > "$OUT/ncu.log" 2>&1
      "$ncu_bin" -i "$rep.ncu-rep" --page details > "$OUT/ncu-details.txt" 2>&1
      "$ncu_bin" -i "$rep.ncu-rep" --page raw --csv > /tmp/ncu-raw.csv 2>&1 && gzip -c /tmp/ncu-raw.csv > "$OUT/ncu-raw.csv.gz"
      "$ncu_bin" -i "$rep.ncu-rep" --page source --csv --print-source sass > /tmp/ncu-sass.csv 2>&1
      gzip -c /tmp/ncu-sass.csv > "$OUT/ncu-sass.csv.gz"
      tail -n 5 "$OUT/ncu.log"; grep -E "^  [a-z_]|Duration|Registers Per|Achieved Occ|Stall|Issue Slots Busy|Pipe" "$OUT/ncu-details.txt" | head -n 80 ;;
    template-variants)  # template folders timed against each other on issue 12's cases (TV_VARIANTS: "name=dir ...",
      # TV_ARGS: e.g. --only window --configs "...")
      python3 benchmarks/template_variants.py "$OUT/template-variants.json" \
        $(for item in ${TV_VARIANTS:-current=templates}; do echo "--variant=$item"; done) ${TV_ARGS:-} \
        > "$OUT/template-variants.log" 2>&1
      tail -n 40 "$OUT/template-variants.log" ;;
    search-quality)  # issue 14's search-quality figure, resumable across runs (SQ_ARGS: --part grid|search|retime
      # [--shapes 0,1] [--seeds 0,1,2]; SQ_FROM: an earlier run's JSON to extend)
      [ -n "${SQ_FROM:-}" ] && cp "$SQ_FROM" "$OUT/search-quality.json"
      python3 benchmarks/search_quality.py "$OUT/search-quality.json" ${SQ_ARGS:---part grid} \
        > "$OUT/search-quality.log" 2>&1
      tail -n 20 "$OUT/search-quality.log" ;;
    tuning-gain)  # issue 14: tuned vs heuristic on odd shapes, nearest-bucket loss, tied buckets; resumable (TG_ARGS:
      # --part gain|nearest|tie [--shapes 0,1] [--trials 30]; TG_FROM: an earlier run's JSON to extend)
      [ -n "${TG_FROM:-}" ] && cp "$TG_FROM" "$OUT/tuning-gain.json"
      python3 benchmarks/tuning_gain.py "$OUT/tuning-gain.json" ${TG_ARGS:---part gain} > "$OUT/tuning-gain.log" 2>&1
      tail -n 20 "$OUT/tuning-gain.log" ;;
    accuracy-probe)  # the fp16 D=16 dQ failure: error ratios per dQ tile, end to end and from the golden's O and LSE
      python3 benchmarks/accuracy_probe.py "$OUT/accuracy-probe.json" > "$OUT/accuracy-probe.log" 2>&1
      tail -n 8 "$OUT/accuracy-probe.log" ;;
    atomic-accuracy)  # the backward's structures (atomic dQ: element atomics, TMA reductions; TMA dK/dV loads)
      python3 -m pytest tests/test_variants.py -k "gpu_atomic or gpu_tma_dkdv" -m gpu -n 8 -q -p no:cacheprovider \
        > "$OUT/atomic-accuracy.log" 2>&1; tail -n 8 "$OUT/atomic-accuracy.log" ;;
    *)
      echo "unknown stage $stage" ;;
  esac
  tar -czf "$FINAL/run$TAG.tar.gz" -C "$OUT" .
done
echo "=== done $(date -u +%H:%M:%S)"
