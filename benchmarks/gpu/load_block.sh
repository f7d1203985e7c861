#!/usr/bin/env bash
# The load block on one GPU (random weights of a model's shape: only vLLM 0.26.0's site travels):
# the GPU tests of background loads and of fp8 at rest, then throughput under load for every store
# and read mode side by side, the adaptive default at 1/10/30/100 users, fp8 at rest, lone-request
# TTFT, and the 1,000-user tier run.
#   RUN=/tmp/run STEPS="tests host side default fp8 ttft users1000" bash benchmarks/gpu/load_block.sh
# Needs /tmp/parts/vllm-0.26.0-site.tar.zst.NN and .gpu/zstd. Each step writes under $RUN.
#   tests     pytest: background writer and loads (CUDA graphs), the fused write (fp8 decode), fp8 at rest
#             (TESTS: other files; TESTS_K: a pytest -k expression, e.g. TESTS_K="host_memory or in_place")
#   host      host_path.py from the pinned store at k = 50: the host time of a load's sources, facts
#             copied a run at a time against a copy per fact (a minute)
#   side      vllm_serve_load.py at 100 users, B = 0, 3 interleaved repeats of 20 s, the stores of SIDE side
#             by side in one run (a server each on the GPU, SIDE_GPU_UTIL each; a round runs every store's
#             rows back to back): hbm read before the forward pass and pinned beside the batch (its default,
#             async_loads auto) by default;
#             a spec may name pinned_reads and before_forward_tokens too (SIDE="pinned:never:overlap,pinned:never:copy",
#             SIDE="pinned:auto,pinned:auto:overlap:2064"), then any [tuning] field as :FIELD=VALUE
#             (SIDE="pinned:never:copy,pinned:never:overlap:pinned_copy_below_mib=0:pinned_copy_above_mib=0":
#             copies before the forward pass against reads in place pipelined by layer group, under load)
#   stores    the same, one run (and server start) per store:async_loads pair of SPECS, one after another
#   default   the adaptive tail at 1/10/30/100 users, 3 repeats, on the store STORE (pinned) and ASYNC
#   fp8       pinned, beside the batch, K/V at rest in fp8 (100 users, 3 repeats)
#   ttft      ttft.py, lone requests at k = 10/50: hbm, pinned:sync, pinned:auto (alone: before the
#             forward pass), pinned:async (always beside the batch); TTFT_STORES picks fewer
#   users1000 benchmarks/tier_users.py (its docstring's GPU command; USERS1000_ARGS: more options, e.g.
#             "--seconds 12" for shorter rounds)
#   reads     benchmarks/user_reads.py: users read from disk into pinned host memory, users/s by threads
#             (1/2/4/8) with the machine's CPUs and page-locked memory (about 2 minutes; no GPU work)
# PROFILE=1: the stores step also samples the server's processes with py-spy during every row
# (vllm_serve_load.py --profile; the static binary carried as .gpu/py-spy): where the engine's host time goes.
set -uo pipefail
RUN=${RUN:-/tmp/run}
STEPS=${STEPS:-tests host stores default fp8 ttft users1000}
STORE=${STORE:-pinned} ASYNC=${ASYNC:-auto} SECONDS_ROW=${SECONDS_ROW:-20} REPEATS=${REPEATS:-3}
# the stores step: which store:async_loads pairs, at which budgets (a short block: SPECS="pinned:auto
# hbm:never" STORE_BUDGETS=0,adaptive)
SPECS=${SPECS:-hbm:never pinned:never pinned:auto} STORE_BUDGETS=${STORE_BUDGETS:-0}
# the side step: the stores side by side (two 7B-shape servers fit an 80 GB GPU at 0.36 each, with room for
# what vLLM does not count; three only an H200, at 0.27: benchmarks/gpu/README.md)
SIDE=${SIDE:-hbm:never,pinned:auto} SIDE_GPU_UTIL=${SIDE_GPU_UTIL:-0.36}
# more vllm_serve_load.py options for every load step; 60 facts a user by default: 100 users' memory is
# written in ~20 s instead of 71 (200 facts), and a request reads 50 of them either way
LOAD_ARGS=${LOAD_ARGS-"--facts 60"}
source benchmarks/gpu/setup.sh
NOW=/tmp/site:$PWD
[[ -f .gpu/py-spy ]] && chmod +x .gpu/py-spy && export PY_SPY=$PWD/.gpu/py-spy
load=(python3 benchmarks/vllm_serve_load.py --shape qwen2.5-7b --cuda-graphs --gpu-memory-utilization 0.5
      --seconds "$SECONDS_ROW" $LOAD_ARGS)
quiet() { grep --line-buffered -v " INFO \| DEBUG "; }

if has tests; then
  stamp "GPU tests: background loads, fused write, fp8 at rest"
  PYTHONPATH=$NOW:$PWD/tests INFERSCALE_TEST_CUDA_GRAPHS=1 timeout "${TESTS_TIMEOUT:-900}" python3 -m pytest -q \
    -p no:cacheprovider ${TESTS:-tests/test_background_writer.py tests/test_background_loads.py tests/test_fused_write.py \
    tests/test_kv_at_rest.py} ${TESTS_K:+-k "$TESTS_K"} 2>&1 | tail -15 | tee "$RUN/gpu_tests.log"
fi
if has host; then
  stamp "host path: the pinned store's sources at k = 50, a run of facts per copy against a copy per fact"
  PYTHONPATH=$NOW timeout 600 python3 benchmarks/host_path.py --kv-store pinned --ks 50 --reps 100 \
    --out "$RUN/host_path_pinned.json" 2>&1 | quiet | tail -6
fi
# one load run at 100 users of SPEC (vllm_serve_load.py's --kv-store: a store, or stores side by side) into
# $RUN/load_NAME (and $RUN/profile_NAME with PROFILE), more options after: stores_run NAME SPEC TIMEOUT [OPTION...]
stores_run() {
  local name=$1 spec=$2 limit=$3 show=${PROFILE:+64}; shift 3
  show=${show:-16}  # lines of its output kept in the log (a profile adds 3 a row)
  stamp "load: $spec, 100 users, B = $STORE_BUDGETS, $REPEATS repeats"
  PYTHONPATH=$NOW timeout "$limit" "${load[@]}" "$@" --users 100 --budgets "$STORE_BUDGETS" --repeats "$REPEATS" \
    --kv-store "$spec" --out "$RUN/load_$name" ${PROFILE:+--profile "$RUN/profile_$name"} 2>&1 \
    | tee "$RUN/load_$name.out" | quiet | tail -n "$show"  # .out: every row as it ends (a run cut short keeps them)
  rm -rf /tmp/vllm_serve_load_* 2>/dev/null
}
has side && stores_run side "$SIDE" 1500 --gpu-memory-utilization "$SIDE_GPU_UTIL"
if has stores; then
  for spec in $SPECS; do stores_run "${spec//:/_}" "$spec" 900; done
fi
if has default; then
  stamp "load: the adaptive default ($STORE, async_loads $ASYNC) at 1/10/30/100 users, 3 repeats"
  PYTHONPATH=$NOW timeout 1200 "${load[@]}" --users 1,10,30,100 --budgets adaptive --repeats 3 --kv-store "$STORE" \
    --async-loads "$ASYNC" --out "$RUN/load_default" 2>&1 | quiet | tail -16
fi
if has fp8; then
  stamp "load: fp8 at rest ($STORE, async_loads $ASYNC), 100 users, B = 0, 3 repeats"
  PYTHONPATH=$NOW timeout 900 "${load[@]}" --users 100 --budgets 0 --repeats 3 --kv-store "$STORE" \
    --async-loads "$ASYNC" --kv-dtype-at-rest fp8_e4m3 --out "$RUN/load_fp8" 2>&1 | quiet | tail -12
fi
if has ttft; then
  stamp "TTFT, lone requests, k = 10/50: ${TTFT_STORES:-hbm,pinned:sync,pinned:auto,pinned:async}"
  PYTHONPATH=$NOW timeout 900 python3 benchmarks/ttft.py --cuda-graphs --shape llama-3.1-8b --ks 10,50 --reps 20 \
    --kv-stores "${TTFT_STORES:-hbm,pinned:sync,pinned:auto,pinned:async}" --out "$RUN/ttft_stores.json" 2>&1 | quiet | tail -16
fi
if has reads; then
  stamp "users read into pinned memory, by threads"
  PYTHONPATH=$NOW timeout 600 python3 benchmarks/user_reads.py --users 40 --threads 1,2,4,8 --repeats 3 --warm \
    --out "$RUN/user_reads" 2>&1 | grep -v "user/s\]" | tail -14
fi
if has users1000 && [[ -f benchmarks/tier_users.py ]]; then
  stamp "the 1,000-user tier run"
  PYTHONPATH=$NOW timeout 1200 python3 benchmarks/tier_users.py --gpu ${USERS1000_ARGS:-} --out "$RUN/tier_users" 2>&1 \
    | quiet | tail -20
fi
stamp done
touch "$RUN/done"
