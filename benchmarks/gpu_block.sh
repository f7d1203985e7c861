# What every GPU block driver starts with (sourced, after it sets RUN and STEPS): its log, the step
# helpers, vLLM 0.26.0's site unpacked from /tmp/parts once per machine, and the environment.
mkdir -p "$RUN"
exec > >(tee -a "$RUN/log") 2>&1
stamp() { echo "== $(date +%T) $*"; }
has() { [[ " $STEPS " == *" $1 "* ]]; }
# (/tmp/site/.unpacked marks a whole unpack: a driver started beside another waits for it)
if mkdir /tmp/site.lock 2>/dev/null; then
  if [[ ! -f /tmp/site/.unpacked ]]; then
    stamp unpacking
    mkdir -p /tmp/site && chmod +x .gpu/zstd
    cat /tmp/parts/vllm-0.26.0-site.tar.zst.* | .gpu/zstd -d -q | tar -x -C /tmp/site && touch /tmp/site/.unpacked
  fi
else
  until [[ -f /tmp/site/.unpacked ]]; do sleep 1; done
fi
export PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 TOKENIZERS_PARALLELISM=false
export INFERSCALE_CACHE=/tmp/isc VLLM_CACHE_ROOT=/tmp/isc/vllm NCCL_NVLS_ENABLE=0
PYTHONPATH=/tmp/site:$PWD python3 -c 'import vllm, torch; print("vllm", vllm.__version__, "torch", torch.__version__,
  torch.cuda.device_count(), "x", torch.cuda.get_device_name())'
