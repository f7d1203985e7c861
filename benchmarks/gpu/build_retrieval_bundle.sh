#!/usr/bin/env bash
# Build the GPU retrieval libraries for the H200 (no network there) as two zstd tars in 44 MiB parts:
#   faiss-gpu-site.tar.zst.NN   faiss-gpu 1.15.1 (built for CUDA 12) with the CUDA 12 runtime, cuBLAS and
#                               cuRAND wheels its __init__ preloads from nvidia/<lib>/lib (it refuses to
#                               import without any of them): the driver runs CUDA 12 user-space
#                               libraries beside the image's CUDA 13 ones
#   cuvs-site.tar.zst.NN        cuVS 26.10 for CUDA 13 (CAGRA): cuvs, libcuvs, libraft, pylibraft, rmm,
#                               librmm, libkvikio, rapids-logger, cuda-bindings, cuda-pathfinder, and
#                               nvJitLink 13.5 (libcuvs wants >= 13.3; the image's cuda-toolkit is 13.0.2);
#                               its other CUDA 13 libraries (cuBLAS 13, cuSOLVER, cuSPARSE, cuRAND, NVRTC,
#                               NCCL) are the image's
# usage: ZSTD_LEVEL=12 bash benchmarks/gpu/build_retrieval_bundle.sh [OUTDIR]
#
# On the machine (benchmarks/gpu/h200_retrieval.sh does it): unpack each into its own folder, put it first on
# PYTHONPATH, and before Python starts put on LD_LIBRARY_PATH the folders libcuvs.so resolves its CUDA
# libraries from (printed at the end). faiss needs nothing more: `import faiss` loads its CUDA 12
# libraries by path (checked on a CPU machine: faiss 1.15.1 imports and sees 0 GPUs).
#
# Wheel sizes (pip download, 2026-12-04): faiss_gpu-1.15.1 135.3 MB, nvidia_cublas_cu12-12.9.3.13 581.2 MB,
# nvidia_cuda_runtime_cu12-12.9.79 3.5 MB, nvidia_curand_cu12-10.3.10.19 68.3 MB, libcuvs_cu13-26.10.0 241.2 MB, libraft 20.6,
# nvidia_nvjitlink 13.5.37 46.6, librmm 4.8, libkvikio 3.2, cuda_bindings 13.5.0 8.4, the rest < 2 MB.
set -euo pipefail
OUT=${1:-$(pwd)/retrieval-bundle}
WORK=$(mktemp -d)
trap 'rm -rf "$WORK"' EXIT
fetch() {  # cp312 manylinux wheels, no dependencies, into $WORK/$1
  local into=$WORK/$1; shift
  python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
    --platform manylinux_2_28_x86_64 --platform manylinux_2_27_x86_64 --platform manylinux_2_24_x86_64 \
    --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 -d "$into" "$@"
}
fetch faiss faiss-gpu==1.15.1 'nvidia-cuda-runtime-cu12>=12.6,<13' 'nvidia-cublas-cu12>=12.6,<13' \
  'nvidia-curand-cu12>=10.3.7,<11'
fetch cuvs 'cuvs-cu13==26.10.*' 'libcuvs-cu13==26.10.*' 'libraft-cu13==26.10.*' 'pylibraft-cu13==26.10.*' \
  'rmm-cu13==26.10.*' 'librmm-cu13==26.10.*' 'libkvikio-cu13==26.10.*' 'rapids-logger==0.3.*' \
  'cuda-bindings>=13.0.1,<14' cuda-pathfinder 'nvidia-nvjitlink>=13.3,<14'
mkdir -p "$OUT"
for part in faiss cuvs; do
  site=$WORK/$part-site
  mkdir -p "$site"
  for whl in "$WORK/$part"/*.whl; do unzip -q -o "$whl" -d "$site"; done
  # headers and static libraries are for building against the libraries, not for running them
  find "$site" \( -name include -type d -o -name '*.a' \) -prune -exec rm -rf {} +
  du -sh "$site"
  name=$([ "$part" = faiss ] && echo faiss-gpu-site || echo cuvs-site)
  tar -C "$site" -cf - . | zstd -"${ZSTD_LEVEL:-12}" -T0 -q -o "$OUT/$name.tar.zst"
  ls -la "$OUT/$name.tar.zst"
  (cd "$OUT" && split -b 44M -d "$name.tar.zst" "$name.tar.zst." && rm "$name.tar.zst")
done
(cd "$OUT" && sha256sum faiss-gpu-site.tar.zst.* cuvs-site.tar.zst.* > RETRIEVAL_SHA256SUMS)
ls "$OUT" | sed -n '1,200p' | tr '\n' ' '; echo
echo "LD_LIBRARY_PATH on the machine: <cuvs-site>/nvidia/cu13/lib:<image site-packages>/nvidia/cu13/lib:<image site-packages>/nvidia/nccl/lib"
