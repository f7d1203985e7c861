#!/usr/bin/env bash
# Tensor parallelism 2 on nvidia-h200-x2 (issue: TP = 2 on two H200s). Run from the repository root
# once /tmp/parts holds vLLM 0.26.0's site parts (carried as in benchmarks/gpu/README.md).
#   RUN=/tmp/run STEPS="check ttft serve" bash benchmarks/gpu/h200x2_tp.sh
set -uo pipefail
RUN=${RUN:-/tmp/run}
STEPS=${STEPS:-check ttft serve}
source benchmarks/gpu/setup.sh
export PYTHONPATH=/tmp/site:$PWD
nvidia-smi topo -m || true

if has check; then
  stamp "KV injection vs plain prefill at TP = 1 and 2 (tiny Llama, 8 and 1 KV heads, bf16, CUDA graphs)"
  INFERSCALE_TEST_CUDA_GRAPHS=1 timeout 600 python3 benchmarks/tp_check.py --tp 1,2 --out "$RUN/tp_check_h200x2.json" \
    2>&1 | grep -v " INFO \| DEBUG "
fi
if has ttft; then
  for tp in 1 2; do
    stamp "TTFT at TP = $tp, Llama-3.1-8B shape, hbm, k = 10, 50, 100"
    timeout 500 python3 benchmarks/ttft.py --cuda-graphs --shape llama-3.1-8b --kv-stores hbm --ks 10,50,100 \
      --reps 20 --tp $tp --out "$RUN/ttft_llama8b_tp${tp}_h200x2.json" 2>&1 | grep -v " INFO \| DEBUG "
  done
fi
if has serve; then
  stamp "inferscale serve at TP = 2: memory, one chat"
  mkdir -p "$RUN/serve" && OUT=$RUN/serve SMOKE_VLLM_ARGS="--tensor-parallel-size 2" timeout 600 python3 benchmarks/serve_smoke.py
fi
stamp done
touch "$RUN/done"
