#!/usr/bin/env bash
# Build vllm-0.33.0-site.tar.zst.NN: vLLM 0.33.0 with torch 2.14.0 for the GPU machine (its image has
# torch 2.11.0+cu130, triton 3.6.0, transformers 5.17.0, Python 3.12, the CUDA 13 libraries of
# torch 2.11), slimmed like ../shared/device/build-vllm-bundle.sh does for 0.26, in 44 MiB parts (a call
# carries 64 MiB with the working tree), plus the CUDA libraries torch 2.14 pins newer than the image's,
# each its own tar (cudnn, nccl: the image's are too old for torch 2.14; its cuSPARSELt 0.8.0 loads).
# usage: ZSTD_LEVEL=19 bash benchmarks/gpu/build_vllm_033_bundle.sh [OUTDIR]
#
# Measured download sizes (PyPI simple JSON API / pip download --no-deps, 2026-12-03; cp312, x86_64):
#   vllm-0.33.0-cp38-abi3-manylinux_2_28_x86_64.whl          320.8 MiB (pip download: 336,361,138 B)
#     its dependencies the image lacks (metadata walk, no torch): 450.3 MiB of wheels, of which
#     tokenspeed-triton 90.5, nvidia-cutlass-dsl-libs 87.4, tilelang 48.2, PyNvVideoCodec 41.2,
#     z3-solver 27.9, nvidia-cudnn-frontend 11.1, torchcodec 9.5 are optional and skipped (as for 0.26),
#     leaving flashinfer-python 0.7.2.post1 (59.2), nccl-extensions 21.5, instanttensor 6.2, ~40 small ones
#     (0.26.0 for comparison: wheel 289.6 MiB, 657.6 MiB with its dependencies; its bundle is 101 MiB)
#   torch-2.14.0-cp312-cp312-manylinux_2_28_x86_64.whl        528.9 MiB   (vLLM pins torch==2.14.0)
#   triton-3.8.0 (torch 2.14 needs triton~=3.8; the image has 3.6)  236.5 MiB
#   torchvision-0.29.0 7.1 MiB, torchaudio-2.11.0 1.7 MiB (vLLM's pins; the image's torchaudio may do)
#   torch 2.14's CUDA pins, compared with the image's CUDA 13 libraries on the machine first:
#     cuda-toolkit 13.0.3 (cublas 13.1.1.3: 403.5, nvrtc 13.0.88: 86.0, cudart 13.0.96: 2.1,
#     cupti 13.0.85: 10.2, plus cufft/cusolver/cusparse/curand/nvjitlink/cufile: ~745 at their newest),
#     nvidia-cudnn-cu13 9.24.0.43: 527.5, nvidia-cusparselt-cu13 0.8.1: 162.3,
#     nvidia-nccl-cu13 2.30.7: 206.0, nvidia-nvshmem-cu13 3.4.5: 57.6, cuda-bindings 13.5.0: 8.0
#
# pip install --dry-run --ignore-installed of "vllm>=0.26,<0.34" (the gpu extra) for cp312 manylinux x86_64 in a
# fresh venv resolves 198 packages: vllm 0.33.0, torch 2.14.0, triton 3.8.0, transformers 5.20.2,
# flashinfer-python 0.7.2.post1, torchvision 0.29.0, cuda-toolkit 13.0.3, nvidia-cudnn-cu13 9.24.0.43.
#
# Measured (2026-12-04, zstd -12): the site is 3.5 GB unpacked, 828 MB in 18 parts of 44 MiB (torch
# 1.1 GB, triton 0.9, flashinfer 0.4, vLLM 0.3 unpacked); cuda-cudnn 11 parts, cuda-nccl 5.
# Plan (the carry limit is 64 MiB a call with the working tree, the machine is held at most 30 minutes):
#   1. The bundle carries vLLM 0.33.0 (slimmed), its missing dependencies, torch 2.14.0, triton 3.8.0
#      (its AMD backend removed) and torchvision 0.29.0, and reuses the image's other CUDA 13 libraries.
#   2. The image (read 2026-12-04) has cuDNN 9.19.0.56, NCCL 2.28.9, cuSPARSELt 0.8.0, NVSHMEM 3.4.5,
#      cuda-toolkit 13.0.2. torch 2.14 does not load on NCCL 2.28 (`libtorch_cuda.so: undefined symbol:
#      ncclCommResume`) and refuses cuDNN 9.19 at first use ("compiled against (9, 24, 0)"), so the
#      cuda-nccl (5 parts) and cuda-cudnn (11 parts) tars travel too; cuSPARSELt 0.8.0 loads.
#   3. The block: carry the parts back to back (≈ 3 s a call) into /tmp/parts with the 0.26 site's, then
#      `RUN=/tmp/run bash benchmarks/gpu/h200_releases.sh` (unpacks both, 0.33 into /tmp/site033 with the
#      cuda-* tars, and runs the tests, TTFT and load on 0.33, then TTFT and load on 0.26).
set -euo pipefail
OUT=${1:-$(pwd)/vllm-0.33.0-bundle}
SHARED=$(cd "$(dirname "$0")/../../../shared/device" && pwd)
WORK=$(mktemp -d)
trap 'rm -rf "$WORK"' EXIT
# vLLM 0.33.0 and its dependencies the image lacks (torch is on the image, so closure.py skips it)
python3 "$SHARED/closure.py" "$WORK/wheels" 0.33.0
fetch() {  # one cp312 manylinux wheel, no dependencies
  python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
    --platform manylinux_2_28_x86_64 --platform manylinux_2_27_x86_64 --platform manylinux_2_18_x86_64 \
    --platform manylinux2014_x86_64 -d "$WORK/wheels" "$1"
}
fetch torch==2.14.0
fetch 'triton~=3.8.0'
fetch torchvision==0.29.0
skip='tokenspeed_triton nvidia_cutlass_dsl tilelang pynvvideocodec z3_solver torchcodec nvidia_cudnn_frontend
      fastsafetensors quack_kernels tokenspeed_mla humming_kernels cuda_tile'
mkdir -p "$WORK/site"
for whl in "$WORK"/wheels/*.whl; do
  name=$(basename "$whl" | cut -d- -f1 | tr 'A-Z' 'a-z')
  for s in $skip; do [[ $name == $s* ]] && continue 2; done
  unzip -q -o "$whl" -d "$WORK/site"
done
du -sh "$WORK/wheels" "$WORK/site"
cd "$WORK/site"
# as for 0.26: FA2 (Ampere), MoE, MLA, FP4 kernels and the Rust front end are not needed for dense
# models on sm90; triton's AMD backend is not needed on an NVIDIA GPU
rm -f vllm/vllm_flash_attn/_vllm_fa2_C.abi3.so vllm/_moe_C_stable_libtorch.abi3.so vllm/vllm-rs \
      vllm/_flashmla*.so vllm/_qutlass_C.abi3.so
rm -rf vllm/third_party/deep_gemm vllm/third_party/fmha_sm100 triton/backends/amd
# triton 3.8 finds its backends through entry points: without this line `import triton.backends` fails
sed -i '/amd/d' triton-*.dist-info/entry_points.txt
mkdir -p "$OUT"
tar -cf - . | zstd -"${ZSTD_LEVEL:-19}" -T0 -q -o "$OUT/vllm-0.33.0-site.tar.zst"
ls -la "$OUT/vllm-0.33.0-site.tar.zst"
cd "$OUT" && split -b 44M -d vllm-0.33.0-site.tar.zst vllm-0.33.0-site.tar.zst. && rm vllm-0.33.0-site.tar.zst
# torch 2.14's CUDA pins (the twenty-first block carried NCCL 2.32.6, same soname, before this list had
# manylinux_2_18, the tag of 2.30.7's wheel), as separate tars of their nvidia/<lib>/lib trees (PYTHONPATH order decides)
for pin in nvidia-cudnn-cu13==9.24.0.43 nvidia-nccl-cu13==2.30.7; do
  lib=$(echo "${pin%%==*}" | cut -d- -f2)
  mkdir -p "$WORK/cuda-$lib" && fetch "$pin"
  unzip -q -o "$WORK"/wheels/nvidia_${lib}_cu13-*.whl -d "$WORK/cuda-$lib"
  (cd "$WORK/cuda-$lib" && tar -cf - nvidia | zstd -"${ZSTD_LEVEL:-19}" -T0 -q -o "$OUT/cuda-$lib.tar.zst")
  split -b 44M -d "cuda-$lib.tar.zst" "cuda-$lib.tar.zst." && rm "cuda-$lib.tar.zst"
done
cp "$SHARED/zstd" "$OUT/zstd"
sha256sum vllm-0.33.0-site.tar.zst.* > SHA256SUMS
ls -la "$OUT"
