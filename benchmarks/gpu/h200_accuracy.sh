#!/usr/bin/env bash
# The accuracy block on the H200: LoCoMo grid on the real Qwen2.5-Coder-0.5B-Instruct (bf16), then
# the TTFT of each recompute budget (Llama-3.1-8B shape, CUDA graphs). Run from the repository root
# on the GPU machine once /tmp/parts holds the bundle (vLLM 0.26.0 site parts, zstd, the gguf wheel and
# the model's GGUF, tarred and split into 60 MiB pieces; see "Running the H200 block again" in
# benchmarks/results/archive/diary.md).
#   RUN=/tmp/run bash benchmarks/gpu/h200_accuracy.sh        (writes $RUN/log and the result files)
set -euo pipefail
RUN=${RUN:-/tmp/run}
mkdir -p "$RUN"
exec > >(tee -a "$RUN/log") 2>&1
GGUF=/tmp/stage/qwen2.5-coder-0.5b-instruct-q4_k_m.gguf
MODEL=/tmp/qwen2.5-coder-0.5b-instruct-bfloat16
stamp() { echo "== $(date +%T) $*"; }

if [[ ! -d /tmp/site/vllm ]]; then
  stamp unpacking
  mkdir -p /tmp/stage /tmp/site
  cat /tmp/parts/bundle.* | tar -x -C /tmp/stage
  chmod +x /tmp/stage/zstd
  cat /tmp/stage/vllm-0.26.0-site.tar.zst.* | /tmp/stage/zstd -d -q | tar -x -C /tmp/site
  python3 -m pip install -q --no-index --no-deps --target /tmp/site /tmp/stage/gguf-*.whl
fi
export PYTHONPATH=/tmp/site:$PWD PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1
export VLLM_ENABLE_V1_MULTIPROCESSING=0 TOKENIZERS_PARALLELISM=false
python3 -c 'import vllm, torch; print("vllm", vllm.__version__, "torch", torch.__version__, torch.cuda.get_device_name())'
echo "1d9614638d18024d0fbb36575a15f1302a3adf044df10345688ec4f6e1c4ff32  $GGUF" | sha256sum -c -

if [[ ! -f $MODEL/config.json ]]; then
  stamp converting
  python3 -m inferscale.cli convert "$GGUF" --out "$MODEL" --dtype bfloat16
fi

stamp locomo grid
python3 benchmarks/locomo_accuracy.py --model "$MODEL" --methods "${METHODS:-grid}" --ks 5,10,20,50 \
  --retrieval benchmarks/results/locomo_retrieval_minilm.json --encode-batch 32 --time-limit "${GRID_S:-540}" \
  --out "$RUN/locomo_qwen05_h200.json"

stamp ttft
python3 benchmarks/ttft.py --cuda-graphs --kv-store hbm --ks 10,50 --recompute 0,128,256,512 --reps 20 \
  --out "$RUN/ttft_budget_h200.json"
stamp done
touch "$RUN/done"
