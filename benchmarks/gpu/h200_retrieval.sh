#!/usr/bin/env bash
# The retrieval block on the H200: a million generated facts, then every retriever on them at
# 10k / 100k / 1M (exact, faiss-gpu flat and IVF, Jasper over a grid, CAGRA, faiss-cpu flat and HNSW),
# and the synthetic sets beside them for comparison.
#   RUN=/tmp/run STEPS="jasper corpus libs table synthetic" bash benchmarks/gpu/h200_retrieval.sh
# Run from the repository root once /tmp/parts holds vLLM 0.26.0's site parts. The rest may arrive while
# it runs: the corpus model's GGUF pieces (q05.NN or q15.NN, closed by q05.done / q15.done, as for
# h200_tradeoff.sh) and the retrieval bundle's (benchmarks/gpu/build_retrieval_bundle.sh: faiss-gpu-site.tar.zst.NN,
# cuvs-site.tar.zst.NN, closed by /tmp/parts/retrieval.done). .gpu/ holds zstd, the gguf wheel,
# vendor/ (Jasper's sources, ../shared/vendor) and minilm/ (all-MiniLM-L6-v2, a sentence-transformers dir);
# benchmarks/gpu/stage.sh stages all of it.
#   jasper     build Jasper twice in the background: as shipped (build beam L = 64) and with L = 192
#              (the largest its construct config allows: L + 64 <= 256), to tell the build from the data
#   corpus     FACTS facts from PEOPLE people written by CORPUS_MODEL (q05, the 0.5B, or q15; fact_corpus.py),
#              embedded by MiniLM
#   libs       unpack faiss-gpu (CUDA 12 runtime and cuBLAS beside it) and cuVS; check both load
#   table      retrieval_latency.py on the corpus at SIZES for BACKENDS, Jasper's grid with each build (L = 192
#              first); with WAIT_FOR set, only once that file exists (another driver's done: no GPU work beside
#              the latencies)
#   synthetic  the same on the clustered and uniform sets (fewer backends), for comparison
# Results: $RUN/retrieval_*.json, then (here) python benchmarks/retrieval_table.py $RUN/retrieval_*.json.
# It may run beside h200_tradeoff.sh (its own RUN): they share the site's unpack and the 0.5B's conversion,
# the corpus takes CORPUS_GPU_MEMORY (0.3) of the GPU and the accuracy runs fixed KV caches.
set -uo pipefail
RUN=${RUN:-/tmp/run}
STEPS=${STEPS:-libs jasper corpus table synthetic}
FACTS=${FACTS:-1000000} PEOPLE=${PEOPLE:-1536} SIZES=${SIZES:-10000,100000,1000000}
BACKENDS=${BACKENDS:-exact,faiss-flat-gpu,faiss-ivf-gpu,faiss-ivf-gpu:nprobe=64,cagra,cagra:itopk=256,cagra:itopk=512,faiss-flat,faiss-hnsw}
JASPER_GRID=${JASPER_GRID:-jasper,jasper:beam=1024,jasper:entry=first,jasper:r=64,beam=1024}
CORPUS_MODEL=${CORPUS_MODEL:-q05}
source benchmarks/gpu/setup.sh
NOW=$SITE:$PWD
python3 -m pip install -q --no-index --no-deps --target "$SITE" .gpu/gguf-*.whl 2>/dev/null
IMAGE=$(cd / && PYTHONPATH= python3 -c 'import os, torch; print(os.path.dirname(os.path.dirname(torch.__file__)))')
LIBS=/tmp/faiss-gpu-site:/tmp/cuvs-site
# `import faiss` loads its CUDA 12 libraries by path from the site; libcuvs.so wants nvJitLink >= 13.3
# (preloaded, as torch may load the image's 13.0 first) and the image's other CUDA 13 libraries
export LD_LIBRARY_PATH=/tmp/cuvs-site/nvidia/cu13/lib:$IMAGE/nvidia/cu13/lib:$IMAGE/nvidia/nccl/lib${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}
JITLINK=/tmp/cuvs-site/nvidia/cu13/lib/libnvJitLink.so.13
source benchmarks/gpu/models.sh

if has jasper; then  # CPU work while the corpus is written
  stamp "building Jasper (L = 64 as shipped, and L = 192) in the background (logs: $RUN/jasper_build*.log)"
  source benchmarks/gpu/jasper.sh
  build_jasper /tmp/jb 64 8 > "$RUN/jasper_build.log" 2>&1 &
  build_jasper /tmp/jb192 192 8 > "$RUN/jasper_build192.log" 2>&1 &
fi

if has corpus; then
  if [[ ! -f /tmp/corpus/vectors.npy ]]; then
    convert_model $CORPUS_MODEL || { stamp "$CORPUS_MODEL did not convert:"; tail -3 /tmp/convert-$CORPUS_MODEL.log; exit 1; }
    stamp "a corpus of $FACTS facts from $PEOPLE people, written by $CORPUS_MODEL, embedded by MiniLM"
    PYTHONPATH=$NOW timeout 900 python3 benchmarks/fact_corpus.py --facts "$FACTS" --people "$PEOPLE" --model ${MODEL_DIR[$CORPUS_MODEL]} \
      --gpu-memory-utilization ${CORPUS_GPU_MEMORY:-0.3} --embedder-model .gpu/minilm --out /tmp/corpus 2>&1 | grep --line-buffered -v " INFO \| DEBUG \|it/s" | tail -8
  fi
  cp /tmp/corpus/corpus.json "$RUN/fact_corpus.json" && head -c 400000 /tmp/corpus/facts.txt > "$RUN/fact_corpus_head.txt"
fi

if has libs; then
  until [[ -f /tmp/parts/retrieval.done ]]; do sleep 2; done
  for lib in faiss-gpu cuvs; do
    stamp "unpacking $lib"
    mkdir -p /tmp/$lib-site && cat /tmp/parts/$lib-site.tar.zst.* | .gpu/zstd -d -q | tar -x -C /tmp/$lib-site
  done
  LD_PRELOAD=$JITLINK PYTHONPATH=$LIBS:$NOW python3 -c '
import torch, faiss
print("faiss", faiss.__version__, "GPUs seen by faiss:", faiss.get_num_gpus())
from cuvs.neighbors import cagra
x = torch.nn.functional.normalize(torch.randn(4096, 64, device="cuda"), dim=1)
index = cagra.build(cagra.IndexParams(build_algo="nn_descent"), x)
d, i = cagra.search(cagra.SearchParams(), index, x[:4], 4)
print("cagra: each row finds itself:", i.copy_to_host()[:, 0].tolist())'
fi

latency() {  # $1 = tag, $2 = Jasper's python folder or "", then retrieval_latency.py's arguments
  local tag=$1 jasper=$2; shift 2
  stamp "retrieval latency: $tag"
  LD_PRELOAD=$JITLINK PYTHONPATH=${jasper:+$jasper:}$LIBS:$NOW timeout 900 python3 benchmarks/retrieval_latency.py \
    --queries 100 --batch 64 --out "$RUN/retrieval_$tag.json" "$@" 2>&1 | grep --line-buffered -v "^\[\|progress"
}
wait_jasper() {  # $1 = folder
  for i in $(seq 1 300); do [[ -f $1/built ]] && return 0; sleep 2; done
  stamp "Jasper in $1 not built:"; tail -5 "$RUN"/jasper_build*.log; return 1
}

if has table; then
  if [[ -n ${WAIT_FOR:-} ]]; then stamp "waiting for $WAIT_FOR"; until [[ -f $WAIT_FOR ]]; do sleep 5; done; fi
  latency corpus "" --corpus /tmp/corpus/vectors.npy --sizes "$SIZES" --backends "$BACKENDS"
  wait_jasper /tmp/jb192 && latency corpus_jasper192 /tmp/jb192/jasper/python --corpus /tmp/corpus/vectors.npy \
    --sizes "$SIZES" --backends "$JASPER_GRID"
  wait_jasper /tmp/jb && latency corpus_jasper64 /tmp/jb/jasper/python --corpus /tmp/corpus/vectors.npy \
    --sizes "$SIZES" --backends "$JASPER_GRID"
fi

if has synthetic; then
  for data in clustered uniform; do
    latency ${data} /tmp/jb192/jasper/python --data $data --sizes 100000,1000000 \
      --backends exact,faiss-ivf-gpu,cagra,cagra:itopk=256,faiss-hnsw,jasper,jasper:entry=first,jasper:r=64,beam=1024
    [[ -f /tmp/jb/built ]] && latency ${data}_jasper64 /tmp/jb/jasper/python --data $data --sizes 100000,1000000 \
      --backends jasper,jasper:entry=first
  done
fi
stamp done
touch "$RUN/done"
