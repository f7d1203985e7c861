#!/usr/bin/env bash
# vLLM 0.33.0 beside 0.26.0 on the H200 (issue: the connector on the vLLM releases users install).
# Run from the repository root once /tmp/parts holds both sites' parts (0.26.0: ../shared/device;
# 0.33.0 and its cuda-* library parts: benchmarks/gpu/build_vllm_033_bundle.sh) and .gpu/zstd is carried:
#   RUN=/tmp/run bash benchmarks/gpu/h200_releases.sh
# On 0.33.0: what the release loaded (versions, the CUDA libraries and where they came from), the
# connector's GPU tests (both write paths, CUDA graphs), TTFT at k = 10/50/100 (hbm, pinned) and the
# load at 100 users; on 0.26.0 the same TTFT and load, one after the other on the same machine.
# RELEASES="033 026" (the order), STEPS033 / STEPS026 override each release's steps.
set -uo pipefail
RUN=${RUN:-/tmp/run}
mkdir -p "$RUN"
DEFAULT='kv[window=-5,closing=answer,recompute_tokens=256]=kv@256'

release_facts() {  # $1: the site; prints and writes what the interpreter loaded
  PYTHONPATH=$1:$PWD python3 - "$2" <<'EOF'
import json, sys
import torch, vllm
torch.cuda.init()
_ = torch.ones(1, device="cuda") @ torch.ones(1, device="cuda")
libs = sorted({line.split()[-1] for line in open("/proc/self/maps")
               if ".so" in line and any(s in line for s in ("nvidia", "libnccl", "libcudnn", "libcusparseLt", "libcublas"))})
facts = {"vllm": vllm.__version__, "torch": torch.__version__, "cuda": torch.version.cuda,
         "cudnn": torch.backends.cudnn.version(), "nccl": ".".join(map(str, torch.cuda.nccl.version())),
         "device": torch.cuda.get_device_name(), "libraries": libs}
print(json.dumps(facts, indent=1))
json.dump(facts, open(sys.argv[1], "w"), indent=1)
EOF
}

for rel in ${RELEASES:-033 026}; do
  if [[ $rel == 033 ]]; then site=/tmp/site033 bundle=vllm-0.33.0-site libs="nccl cudnn" steps=${STEPS033:-tests ttft load}
  else site=/tmp/site bundle=vllm-0.26.0-site libs= steps=${STEPS026:-ttft load}; fi
  mkdir -p "$RUN/v$rel"
  # setup.sh (sourced by h200_speed.sh) unpacks; a facts-only pass first, so a release whose torch
  # does not load is reported and skipped
  RUN=$RUN/v$rel SITE=$site BUNDLE=$bundle CUDA_LIBS=$libs STEPS=none bash benchmarks/gpu/h200_speed.sh > /dev/null 2>&1
  python3 -m pip list 2>/dev/null | grep -i -E "^(nvidia|cuda|torch |triton )" > "$RUN/v$rel/image_packages.txt"
  if ! release_facts "$site" "$RUN/v$rel/release.json" > "$RUN/v$rel/release.log" 2>&1; then
    echo "== vLLM $rel does not load:"; tail -30 "$RUN/v$rel/release.log"; continue
  fi
  cat "$RUN/v$rel/release.log"
  RUN=$RUN/v$rel SITE=$site BUNDLE=$bundle STEPS="$steps" TTFT_KS=${TTFT_KS:-10,50,100} \
    TTFT_ARGS="--reps ${TTFT_REPS:-10}" LOAD_ARGS="--users 100 --default $DEFAULT" bash benchmarks/gpu/h200_speed.sh
done
touch "$RUN/all.done"
