#!/usr/bin/env bash
# The speed block on the H200 (issue: GPU serving speed). Run from the repository root on the GPU
# machine once /tmp/parts holds vLLM 0.26.0's site parts (../shared/device: three zstd parts and the
# zstd binary, carried as .gpu/) and .gpu/before holds the code to compare against
# (`git archive <commit> inferscale tests benchmarks/ttft.py | tar -x -C .gpu/before`).
#   RUN=/tmp/run STEPS="jasper tests profile ttft load retrieval encode shapes" bash benchmarks/gpu/h200_speed.sh
# Each step appends to $RUN/log and writes its result files into $RUN. Carried beside the checkout
# (git-ignored, see benchmarks/gpu/README.md): .gpu/minilm (MiniLM, fp16), .gpu/tokenizer,
# .gpu/locomo, .gpu/vendor (Jasper's sources), .gpu/wheels (faiss-cpu).
set -uo pipefail
RUN=${RUN:-/tmp/run}
STEPS=${STEPS:-kernel tests load-short ttft load}  # also: hostpath profile shapes jasper retrieval encode serve start
# the connector's cache write in steps ttft, load, shapes: "" (Config's default, the fused kernel),
# --layerwise-write or --fused-write
FUSED=${FUSED:-}
# more arguments of the load steps, e.g. LOAD_ARGS="--users 100 -- --api-server-count 4"; of the ttft step,
# e.g. TTFT_STORES=pinned,pinned:overlap (both ways of reading the pinned store, in the same run);
# of the profile step, PROFILE_STORE=pinned:graphs (a store as in TTFT_STORES; default hbm) and
# PROFILE_TAG (appended to its file names); of the tests step, TEST_KV_STORE=hbm, PINNED_READS,
# PINNED_READ_PROGRAMS=n, PINNED_READ_GRAPHS=0/1 (default: Config's), TEST_BLOCK_SIZE=n,
# PINNED_COPY_BELOW_MIB=x (default 0: the tiny test model's reads go in place; Config's 96 would copy them all),
# ASYNC_LOADS=always/never/auto (Config.tuning.async_loads; default: Config's)
source benchmarks/gpu/setup.sh
NOW=$SITE:$PWD BEFORE=$SITE:$PWD/.gpu/before
if [[ -d .gpu/wheels ]] && ! PYTHONPATH=$NOW python3 -c 'import faiss' 2>/dev/null; then
  python3 -m pip install -q --no-index --no-deps --target "$SITE" .gpu/wheels/*.whl
fi

if has jasper; then  # CPU work: built beside the correctness tests, ready for step "retrieval"
  stamp "building Jasper in the background (log: $RUN/jasper_build.log)"
  source benchmarks/gpu/jasper.sh
  build_jasper /tmp/jb > "$RUN/jasper_build.log" 2>&1 &
  JASPER_PID=$!
fi

# wait for a command; after $2 seconds SIGABRT every process of it (faulthandler prints their stacks).
# (Patterns below are written so they never match this script's own command line.)
watch() {
  local pid=$1 limit=$2 waited=0
  while kill -0 "$pid" 2>/dev/null && (( waited < limit )); do sleep 2; waited=$((waited + 2)); done
  if kill -0 "$pid" 2>/dev/null; then
    stamp "still running after ${limit}s: SIGABRT to its processes"
    pkill -ABRT -f 'engine_start_prob[e]'; pkill -ABRT -f 'VLLM:[:]'; sleep 5
    pkill -KILL -f 'engine_start_prob[e]'; pkill -KILL -f 'VLLM:[:]'
  fi
  wait "$pid"; echo "exit status $?"
}

if has start; then
  stamp "engine start after torch work, vLLM's default start method, code before"
  rm -rf /tmp/probe-before && mkdir -p /tmp/probe-before
  (unset VLLM_WORKER_MULTIPROC_METHOD VLLM_ENABLE_V1_MULTIPROCESSING; PYTHONFAULTHANDLER=1 PYTHONPATH=$BEFORE \
    PROBE_TIMEOUT=170 python3 tests/engine_start_probe.py "$(PYTHONPATH=$NOW python3 -c 'import sys; sys.path.insert(0, "tests"); import tiny_models; print(tiny_models.tiny_model_dir("qwen2", "bfloat16"))')" \
    /tmp/probe-before bfloat16) > "$RUN/engine_start_before.log" 2>&1 &
  watch $! 180
  grep -v "INFO\|DEBUG" "$RUN/engine_start_before.log" | tail -60
  stamp "engine start after torch work, code now"
  rm -rf /tmp/probe-now && mkdir -p /tmp/probe-now
  (unset VLLM_WORKER_MULTIPROC_METHOD VLLM_ENABLE_V1_MULTIPROCESSING; PYTHONFAULTHANDLER=1 PYTHONPATH=$NOW \
    python3 -m pytest -q -p no:cacheprovider tests/test_connector_engines.py -k torch_work) > "$RUN/engine_start_now.log" 2>&1 &
  watch $! 240
  tail -5 "$RUN/engine_start_now.log"
fi

if has tests; then
  for fused in ${TEST_WRITES:-0 1}; do  # 1: the fused write (the default), 0: per layer
    stamp "connector tests on the GPU (tiny Llama, bf16, CUDA graphs, fused write $fused)"
    log="$RUN/tests_fused$fused${ASYNC_LOADS:+_async$ASYNC_LOADS}${PINNED_READS:+_$PINNED_READS}${PINNED_READ_PROGRAMS:+_p$PINNED_READ_PROGRAMS}${PINNED_READ_GRAPHS:+_graphs$PINNED_READ_GRAPHS}${PINNED_COPY_BELOW_MIB:+_copybelow$PINNED_COPY_BELOW_MIB}${TEST_KV_STORE:+_$TEST_KV_STORE}${TEST_BLOCK_SIZE:+_bs$TEST_BLOCK_SIZE}.log"
    PYTHONPATH=$NOW INFERSCALE_TEST_MODELS=llama:bfloat16 INFERSCALE_REPLAY_MODELS=llama:bfloat16 \
      INFERSCALE_TEST_CUDA_GRAPHS=1 INFERSCALE_TEST_FUSED_WRITE=$fused INFERSCALE_TEST_PINNED_READS=${PINNED_READS:-overlap} \
      INFERSCALE_TEST_KV_STORE=${TEST_KV_STORE:-pinned} INFERSCALE_TEST_BLOCK_SIZE=${TEST_BLOCK_SIZE:-} \
      INFERSCALE_TEST_PINNED_READ_PROGRAMS=${PINNED_READ_PROGRAMS:-} INFERSCALE_TEST_PINNED_READ_GRAPHS=${PINNED_READ_GRAPHS:-} \
      INFERSCALE_TEST_PINNED_COPY_BELOW_MIB=${PINNED_COPY_BELOW_MIB:-0} INFERSCALE_TEST_ASYNC_LOADS=${ASYNC_LOADS:-} \
      timeout 420 python3 -m pytest \
      tests/test_connector.py tests/test_sources.py tests/test_cache_layout.py tests/test_connector_layout.py \
      tests/test_background_writer.py $(has kernel || echo tests/test_fused_write.py) -q -p no:cacheprovider -k "not fuzz" > "$log" 2>&1
    status=$?
    grep -v " INFO \| DEBUG " "$log" | tail -30
    echo "exit status $status"
  done
fi

if has hostpath; then  # the connector's host work per request outside the engine, hot and cold (quick)
  stamp "connector host path per request (hot and cold CPU caches)"
  PYTHONPATH=$NOW timeout 300 python3 benchmarks/host_path.py --out "$RUN/host_path_h200.json" 2>&1 | tail -6
fi

if has kernel; then  # the fused write alone: against the reference, then its speed by where the facts lie (quick)
  stamp "fused cache write on the GPU"
  PYTHONPATH=$NOW timeout 300 python3 -m pytest tests/test_fused_write.py -q -p no:cacheprovider 2>&1 | tail -5
  PYTHONPATH=$NOW timeout 300 python3 benchmarks/fused_write_speed.py --out "$RUN/fused_write_speed_h200.json" 2>&1 | tail -40
fi

if has profile; then
  for which in ${PROFILES:-fused layerwise}; do  # before: the code in .gpu/before
    for k in ${PROFILE_KS:-50}; do
      stamp "profile of one injected request ($which, k = $k, ${PROFILE_STORE:-hbm})"
      path=$NOW flag=; [[ $which == before ]] && path=$BEFORE; [[ $which == fused ]] && flag=--fused-write
      [[ $which == layerwise ]] && flag=--layerwise-write
      PYTHONPATH=$path timeout 420 python3 benchmarks/inject_profile.py --cuda-graphs --k "$k" --kv-store "${PROFILE_STORE:-hbm}" \
        $flag --label "$which" --out "$RUN/inject_profile_${which}_k$k${PROFILE_TAG:-}.json" \
        --trace "$RUN/inject_trace_${which}_k$k${PROFILE_TAG:-}" 2>&1 \
        | grep -v " INFO \| DEBUG "
    done
  done
fi

if has ttft; then
  stamp "TTFT vs k, Llama-3.1-8B shape, multiprocess engine, CUDA graphs, hbm + pinned, query-to-first-token ($FUSED)"
  PYTHONPATH=$NOW timeout ${TTFT_TIMEOUT:-900} python3 benchmarks/ttft.py --cuda-graphs --shape llama-3.1-8b --kv-stores "${TTFT_STORES:-hbm,pinned}" \
    --ks "${TTFT_KS:-1,5,10,25,50,100}" --reps 20 $FUSED ${TTFT_ARGS:-} $([[ -d .gpu/minilm ]] && echo --embedder .gpu/minilm) --out "$RUN/ttft_llama8b_h200${TTFT_TAG:-}.json" 2>&1 \
    | grep -v " INFO \| DEBUG "
fi

if has load; then
  stamp "load through vllm serve: 1/10/50/100 users, 200 facts each, k = 50, Qwen2.5-7B shape ($FUSED)"
  PYTHONPATH=$NOW timeout 900 python3 benchmarks/vllm_serve_load.py --shape qwen2.5-7b --cuda-graphs \
    --gpu-memory-utilization 0.5 --seconds 10 $FUSED --out "$RUN/vllm_serve_load_h200" ${LOAD_ARGS:-} 2>&1 \
    | grep -v " INFO \| DEBUG "
fi

if has load-short; then  # the prefill-bound case: answers of 2 tokens
  stamp "load through vllm serve with 2-token answers: 1/10/50/100 users, k = 50, Qwen2.5-7B shape ($FUSED)"
  PYTHONPATH=$NOW timeout 900 python3 benchmarks/vllm_serve_load.py --shape qwen2.5-7b --cuda-graphs \
    --gpu-memory-utilization 0.5 --seconds 10 --max-tokens 2 --budgets 0 $FUSED \
    --out "$RUN/vllm_serve_load_short_h200" ${LOAD_ARGS:-} 2>&1 | grep -v " INFO \| DEBUG "
fi

if has retrieval; then
  for i in $(seq 1 90); do [[ -f /tmp/jb/built ]] && break; kill -0 "${JASPER_PID:-0}" 2>/dev/null || break; sleep 2; done
  [[ -f /tmp/jb/built ]] && stamp "Jasper built" || { stamp "Jasper not built:"; tail -20 "$RUN/jasper_build.log"; }
  for data in clustered uniform; do
    stamp "retrieval latency at 3k, 100k, 1M facts ($data vectors)"
    PYTHONPATH=/tmp/jb/jasper/python:$NOW timeout 420 python3 benchmarks/retrieval_latency.py --sizes 3000,100000,1000000 \
      --data $data --backends exact,faiss-flat,jasper,jasper-wide --queries 100 \
      --out "$RUN/retrieval_latency_${data}_h200.json" 2>&1 | grep -v "^\[\|progress" | tail -20
  done
fi

if has encode; then
  stamp "offline encoding speed, Llama-3.1-8B shape, all LoCoMo conversations"
  PYTHONPATH=$NOW timeout 600 python3 benchmarks/encode_speed.py --config llama-3.1-8b --tokenizer .gpu/tokenizer \
    --data .gpu/locomo --out "$RUN/encode_speed_h200.json" 2>&1 | tail -20
fi

if has serve; then
  stamp "vllm serve start with and without the connector (smoke shape, CUDA graphs)"
  SERVE_LOG_DIR=$RUN PYTHONPATH=$NOW timeout 600 python3 benchmarks/serve_start.py --shape smoke --cuda-graphs \
    --timeout 240 --out "$RUN/serve_start_h200.json" 2>&1 | grep -v " INFO \| DEBUG "
fi

if has shapes; then
  for shape in qwen2.5-7b qwen3-14b; do
    stamp "TTFT vs k, $shape shape"
    PYTHONPATH=$NOW timeout 500 python3 benchmarks/ttft.py --cuda-graphs --shape $shape --kv-stores hbm,pinned \
      --ks 1,10,50,100 --reps 20 $FUSED --out "$RUN/ttft_${shape}_h200.json" 2>&1 | grep -v " INFO \| DEBUG "
  done
fi
stamp done
touch "$RUN/done"
