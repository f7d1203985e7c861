#!/usr/bin/env bash
# The accuracy-against-throughput block on the H200: one run gives every method its LoCoMo F1 on
# Qwen2.5-Coder-1.5B and 0.5B and the throughput of its recompute budget under load.
#   RUN=/tmp/run STEPS="load ttft accuracy" bash benchmarks/gpu/h200_tradeoff.sh
# Run from the repository root once /tmp/parts holds vLLM 0.26.0's site parts; the models' GGUF files
# arrive in pieces while it runs (/tmp/parts/q05.NN, q15.NN, each set closed by q05.done / q15.done;
# see benchmarks/gpu/README.md). .gpu/ holds zstd, the gguf wheel and .gpu/locomo (the data).
#   load      vllm_serve_load.py (Qwen2.5-7B shape, 100 users × 200 facts, k = 50, 32-token answers,
#             one API server, hbm store) at 100 users for every budget in BUDGETS
#   ttft      ttft.py at TTFT_KS (Llama-3.1-8B shape, CUDA graphs) for budgets TTFT_BUDGETS, stores TTFT_STORES
#   calibrate a fact corpus the 1.5B writes (fact_corpus.py), then kv_calibration.py's corrections for its
#             stored K/V, per head and per channel (benchmarks/results/kv_calibration{,_channel}_qwen15_h200.json,
#             which METHODS15=calibrated and offline read)
#   accuracy  locomo_accuracy.py: the 1.5B's grid (METHODS15) beside the 0.5B's (METHODS05), concurrently;
#             fixed KV caches (no memory profile), so other GPU work may run beside them
# The GGUFs are assembled, checked and converted in the background while "load" runs.
set -uo pipefail
RUN=${RUN:-/tmp/run}
STEPS=${STEPS:-load ttft accuracy}  # also: calibrate (before accuracy)
BUDGETS=${BUDGETS:-0,16,32,64,128,256}
TTFT_BUDGETS=${TTFT_BUDGETS:-0,64}
TTFT_STORES=${TTFT_STORES:-hbm,pinned}
TTFT_KS=${TTFT_KS:-50,100}
METHODS15=${METHODS15:-order}
METHODS05=${METHODS05-order05}  # "": no 0.5B run
# the product's default (a method of the grids) and the load system that serves it
DEFAULT=${DEFAULT:-kv[window=-5,closing=answer,recompute_tokens=256]}
DEFAULT_SYSTEM=${DEFAULT_SYSTEM:-kv@256}
source benchmarks/gpu/setup.sh
NOW=/tmp/site:$PWD
python3 -m pip install -q --no-index --no-deps --target /tmp/site .gpu/gguf-*.whl 2>/dev/null
mkdir -p ../shared/data && rm -rf ../shared/data/locomo && cp -r .gpu/locomo ../shared/data/locomo

source benchmarks/gpu/models.sh
# in the background: the 0.5B, then the 1.5B (a driver beside this one, e.g. h200_retrieval.sh, shares them)
( [[ -n $METHODS05 ]] && convert_model q05; convert_model q15 ) &  # METHODS05="": no 0.5B run (nor its pieces)

if has load; then
  stamp "load through vllm serve: 100 users, 200 facts each, k = 50, 32-token answers, budgets $BUDGETS"
  PYTHONPATH=$NOW timeout 900 python3 benchmarks/vllm_serve_load.py --shape qwen2.5-7b --cuda-graphs \
    --gpu-memory-utilization 0.5 --seconds 10 --users 100 --budgets "$BUDGETS" --default "$DEFAULT=$DEFAULT_SYSTEM" \
    --out "$RUN/vllm_serve_load_budgets_h200" 2>&1 | grep --line-buffered -v " INFO \| DEBUG "
fi

if has ttft; then
  stamp "TTFT at k = $TTFT_KS, budgets $TTFT_BUDGETS, stores $TTFT_STORES, CUDA graphs, multiprocess engine"
  PYTHONPATH=$NOW timeout 600 python3 benchmarks/ttft.py --cuda-graphs --shape llama-3.1-8b --kv-stores "$TTFT_STORES" \
    --ks "$TTFT_KS" --recompute "$TTFT_BUDGETS" --reps 30 --out "$RUN/ttft_budgets_h200.json" 2>&1 \
    | grep --line-buffered -v " INFO \| DEBUG "
fi

if has calibrate; then  # scales for the stored K/V, fitted on facts the 1.5B writes (not LoCoMo's)
  convert_model q15 || { stamp "the 1.5B did not convert:"; tail -3 /tmp/convert-q15.log; }
  stamp "a fact corpus written by the 1.5B, then the K/V calibration against prompt injection"
  if [[ -n ${CAL_FACTS:-} ]]; then  # a corpus brought along (e.g. fact_corpus.py --templates-only), no engine start
    mkdir -p /tmp/cal-corpus && cp "$CAL_FACTS" /tmp/cal-corpus/facts.txt
  else
    PYTHONPATH=$NOW timeout 600 python3 benchmarks/fact_corpus.py --facts 3000 --people 256 --model $Q15 --no-embed \
      --gpu-memory-utilization ${CORPUS_GPU_MEMORY:-0.3} \
      --out /tmp/cal-corpus 2>&1 | grep --line-buffered -v " INFO \| DEBUG " | tail -5
  fi
  for form in head channel; do  # side by side; the calibrated set reads both (locomo_accuracy.CALIBRATION*)
    out=benchmarks/results/kv_calibration$([ $form = head ] || echo _$form)_qwen15_h200.json
    PYTHONPATH=$NOW timeout 600 python3 benchmarks/kv_calibration.py --model $Q15 --facts /tmp/cal-corpus/facts.txt \
      --window 10 --k 5,10,20,50 --samples ${CAL_SAMPLES:-160} --steps ${CAL_STEPS:-480} --form $form \
      --locomo ../shared/data/locomo --locomo-questions ${CAL_LOCOMO:-64} \
      --locomo-retrieval benchmarks/results/locomo_retrieval_minilm.json --out $out > "$RUN/fit_$form.log" 2>&1 &
  done
  wait
  for form in head channel; do grep -v "Warning\|Loading" "$RUN/fit_$form.log" | tail -4; done
  cp benchmarks/results/kv_calibration*_qwen15_h200.json "$RUN/" 2>/dev/null
  cp /tmp/cal-corpus/facts.txt "$RUN/" 2>/dev/null
fi

if has accuracy; then  # the 0.5B starts once converted, while the 1.5B's pieces still arrive
  export VLLM_ENABLE_V1_MULTIPROCESSING=0
  common=(--ks 5,10,20,50 --retrieval benchmarks/results/locomo_retrieval_minilm.json
          --related benchmarks/results/locomo_related_minilm.json --encode-batch 64
          --default "$DEFAULT" --baseline "prompt[closing=answer]" --time-limit "${TIME_LIMIT:-0}")
  A05=
  if [[ -n $METHODS05 ]]; then
    convert_model q05; tail -3 /tmp/convert-q05.log
    stamp "LoCoMo, every question: 0.5B ($METHODS05), in the background ($RUN/acc05.log)"
    PYTHONPATH=$NOW python3 benchmarks/locomo_accuracy.py --model $Q05 --methods "$METHODS05" "${common[@]}" \
      --gpu-memory-utilization 0.1 --kv-cache-gib 8 --out "$RUN/locomo_qwen05_h200.json" > "$RUN/acc05.log" 2>&1 &
    A05=$!
  fi
  convert_model q15; tail -3 /tmp/convert-q15.log
  stamp "LoCoMo, every question: 1.5B ($METHODS15)"
  PYTHONPATH=$NOW python3 benchmarks/locomo_accuracy.py --model $Q15 --methods "$METHODS15" "${common[@]}" \
    --gpu-memory-utilization 0.1 --kv-cache-gib 16 --out "$RUN/locomo_qwen15_h200.json" 2>&1 | grep --line-buffered -v " INFO \| DEBUG "
  if [[ -n $A05 ]]; then
    wait $A05
    grep --line-buffered -v " INFO \| DEBUG " "$RUN/acc05.log" | tail -40
  fi
fi
stamp done
touch "$RUN/done"
