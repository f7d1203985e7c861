# Jasper, built on the GPU machine from .gpu/vendor (../shared/vendor's sources, no network): sourced by
# the drivers. `build_jasper DIR [L] [JOBS]` builds into DIR/jasper (its python/ folder is what goes on
# PYTHONPATH) and touches DIR/built; L is the graph construction's beam (64 as shipped, at most 192: its
# config wants L + 64 <= 256), compiled in (ffi/jasper_ffi_common.cuh). Run it in the background.
build_jasper() {
  local dir=$1 beam=${2:-64} jobs=${3:-12}
  (set -e; REPO=$PWD; export PYTHONPATH=$SITE; mkdir -p "$dir" && cd "$dir"
   for f in jasper gallatin argparse gpu_error; do tar xzf "$REPO/.gpu/vendor/$f-src.tar.gz"; done
   rmdir jasper/external/gpu_error; cp -r gpu_error jasper/external/gpu_error
   cp "$REPO/.gpu/vendor/CPM_0.42.1.cmake" "$dir/CPM.cmake"
   printf 'include(%s/CPM.cmake)\n' "$dir" > jasper/cmake/CPM.cmake
   if [[ $beam != 64 ]]; then
     sed -i "s/graph_construct_config<cfg_##id, 64, 4, R, 64>/graph_construct_config<cfg_##id, 64, 4, R, $beam>/" \
       jasper/ffi/jasper_ffi_common.cuh
     grep -q "R, $beam>" jasper/ffi/jasper_ffi_common.cuh
   fi
   cd jasper
   cmake -B build -DJASPER_BUILD_FFI=ON -DCMAKE_CUDA_ARCHITECTURES=90 \
     -DCPM_gallatin_SOURCE="$dir/gallatin" -DCPM_argparse_SOURCE="$dir/argparse" \
     -DThrust_DIR=/usr/local/cuda-13.0/targets/x86_64-linux/lib/cmake/thrust -DPython_EXECUTABLE="$(which python3)"
   nice cmake --build build -j"$jobs" && cmake --install build && touch "$dir/built")
}
