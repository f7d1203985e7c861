# What every GPU block driver starts with (sourced, after it sets RUN and STEPS): its log, the step
# helpers, a vLLM release's site unpacked from /tmp/parts once per machine, and the environment.
mkdir -p "$RUN"
exec > >(tee -a "$RUN/log") 2>&1
stamp() { echo "== $(date +%T) $*"; }
has() { [[ " $STEPS " == *" $1 "* ]]; }
# SITE and BUNDLE pick the vLLM release: vllm-0.26.0-site (default) into /tmp/site, or e.g.
# SITE=/tmp/site033 BUNDLE=vllm-0.33.0-site CUDA_LIBS="nccl cudnn": the CUDA libraries named (parts
# /tmp/parts/cuda-<lib>.tar.zst.NN, from benchmarks/gpu/build_vllm_033_bundle.sh) unpack into the site, where
# torch's RPATH finds them before the image's. ($SITE/.unpacked marks a whole unpack: a driver
# started beside another waits for it.)
SITE=${SITE:-/tmp/site} BUNDLE=${BUNDLE:-vllm-0.26.0-site} CUDA_LIBS=${CUDA_LIBS:-}
if mkdir "$SITE.lock" 2>/dev/null; then
  if [[ ! -f $SITE/.unpacked ]]; then
    stamp "unpacking $BUNDLE into $SITE"
    mkdir -p "$SITE" && chmod +x .gpu/zstd
    cat /tmp/parts/$BUNDLE.tar.zst.* | .gpu/zstd -d -q | tar -x -C "$SITE"
    for lib in $CUDA_LIBS; do
      stamp "unpacking CUDA library $lib into $SITE"
      cat /tmp/parts/cuda-$lib.tar.zst.* | .gpu/zstd -d -q | tar -x -C "$SITE"
    done
    touch "$SITE/.unpacked"
  fi
else
  until [[ -f $SITE/.unpacked ]]; do sleep 1; done
fi
export PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 TOKENIZERS_PARALLELISM=false
export INFERSCALE_CACHE=/tmp/isc VLLM_CACHE_ROOT=/tmp/isc/vllm NCCL_NVLS_ENABLE=0
PYTHONPATH=$SITE:$PWD python3 -c 'import vllm, torch; print("vllm", vllm.__version__, "torch", torch.__version__,
  torch.cuda.device_count(), "x", torch.cuda.get_device_name())'
