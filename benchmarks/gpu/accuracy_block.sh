#!/usr/bin/env bash
# The accuracy block on one GPU: fact wrappers for Qwen2.5-Coder-1.5B (and the 0.5B, whose wrappers the
# CPU gate reads) trained on facts each model writes itself, then the LoCoMo screen (KL from prompt
# injection, gold NLL) and LoCoMo F1 on every question, for prompt injection (relevance and stored
# order), the facts window of 10 at B = 0 and B = 256, and with each wrapper variant.
#   RUN=/tmp/run bash benchmarks/gpu/accuracy_block.sh      # from the repository root, detached
# Needs /tmp/parts: vLLM 0.26.0's site pieces, q15.NN (+ q15.done), with WITH_Q05=1 q05.NN (+ q05.done); .gpu/ holds zstd,
# the gguf wheel, locomo/ and facts05.txt (the 0.5B's own facts, benchmarks/fact_corpus.py on a CPU).
#   corpus    fact_corpus.py: facts the 1.5B writes (/tmp/corpus15)
#   wrappers  train_wrappers.py: trailer 4 (t4) and header 2 + trailer 4 (h2t4) for the 1.5B, t4 for the 0.5B
#   screen    locomo_screen.py on every question at k = 5/10/20/50 (beside accuracy)
#   accuracy  locomo_accuracy.py on every question at k = 5/10/20/50
set -uo pipefail
RUN=${RUN:-/tmp/run}
STEPS=${STEPS:-corpus wrappers screen accuracy}
TRAIN_STEPS=${TRAIN_STEPS:-1200}
source benchmarks/gpu/setup.sh
NOW=/tmp/site:$PWD
python3 -m pip install -q --no-index --no-deps --target /tmp/site .gpu/gguf-*.whl 2>/dev/null
mkdir -p ../shared/data && rm -rf ../shared/data/locomo && cp -r .gpu/locomo ../shared/data/locomo
source benchmarks/gpu/models.sh
[[ -n ${WITH_Q05:-} ]] && convert_model q05 &
convert_model q15 || { stamp "the 1.5B did not convert"; tail -5 /tmp/convert-q15.log; exit 1; }
wait
grep -v " INFO \| DEBUG " /tmp/convert-q15.log | tail -2

CORPUS=${CORPUS:-/tmp/corpus15/facts.txt}  # another corpus (e.g. .gpu/facts05.txt): no corpus step
if has corpus && [[ $CORPUS == /tmp/corpus15/facts.txt ]]; then
  stamp "facts the 1.5B writes (fact_corpus.py)"
  PYTHONPATH=$NOW timeout 600 python3 benchmarks/fact_corpus.py --facts 2400 --people 256 --model $Q15 --no-embed \
    --gpu-memory-utilization 0.3 --out /tmp/corpus15 2>&1 | grep --line-buffered -v " INFO \| DEBUG " | tail -3
  cp /tmp/corpus15/facts.txt "$RUN/facts_qwen15.txt"
fi

T15=$RUN/wrappers_t4_qwen15.safetensors H15=$RUN/wrappers_h2t4_qwen15.safetensors T05=$RUN/wrappers_t4_qwen05.safetensors
if has wrappers; then
  stamp "fact wrappers: 1.5B t4 and h2t4, 0.5B t4, side by side"
  train=(--users ${USERS:-120} --held-out ${HELD_OUT:-16} --facts-per-user 16 --samples-per-user ${SAMPLES:-8} --k 5,10,20 --encode-batch 32 --max-minutes ${TRAIN_MINUTES:-7}
         --steps $TRAIN_STEPS ${WRAPPER_ARGS:-})  # WRAPPER_ARGS: e.g. "--questions recall --eval-every 100"
  PYTHONPATH=$NOW python3 benchmarks/train_wrappers.py --model $Q15 --facts $CORPUS "${train[@]}" \
    --trailer 4 --out $T15 > "$RUN/train_t4_qwen15.log" 2>&1 &
  PYTHONPATH=$NOW python3 benchmarks/train_wrappers.py --model $Q15 --facts $CORPUS "${train[@]}" \
    --header 2 --trailer 4 --out $H15 > "$RUN/train_h2t4_qwen15.log" 2>&1 &
  [[ -n ${WITH_Q05:-} ]] && PYTHONPATH=$NOW python3 benchmarks/train_wrappers.py --model $Q05 --facts .gpu/facts05.txt --users 32 --held-out 4 \
    --facts-per-user 16 --samples-per-user 16 --k 5,10,20 --encode-batch 32 --steps $TRAIN_STEPS --max-minutes ${TRAIN_MINUTES:-7} \
    --trailer 4 --out $T05 > "$RUN/train_t4_qwen05.log" 2>&1 &
  wait
  for f in "$RUN"/train_*.log; do echo "-- $f"; grep -v "Warning\|Loading\|warn\|curve.append" "$f" | tail -4; done
fi

F10="kv[window=-10,closing=answer]"
methods="prompt[closing=answer];$F10"  # the most telling first: a run cut short keeps them
for w in $T15 $H15; do [[ -f $w ]] && methods="$methods;kv[window=-10,closing=answer,wrappers=$w]"; done
methods="$methods;kv[window=-10,closing=answer,recompute_tokens=256];prompt[closing=answer,order=stored]"
export VLLM_ENABLE_V1_MULTIPROCESSING=0
if has screen; then
  stamp "LoCoMo screen, every question, k = 5/10/20/50 (in the background: $RUN/screen15.log)"
  PYTHONPATH=$NOW python3 benchmarks/locomo_screen.py --model $Q15 --ks 5,10,20,50 --methods "$methods" \
    --reference "$F10" --retrieval benchmarks/results/locomo_retrieval_minilm.json --encode-batch 64 \
    --out "$RUN/locomo_screen_qwen15.json" > "$RUN/screen15.log" 2>&1 &
fi
if has accuracy; then
  stamp "LoCoMo F1, every question, k = 5/10/20/50"
  PYTHONPATH=$NOW python3 benchmarks/locomo_accuracy.py --model $Q15 --methods "$methods" --ks 5,10,20,50 \
    --retrieval benchmarks/results/locomo_retrieval_minilm.json --encode-batch 64 --default "$F10" \
    --baseline "prompt[closing=answer]" --gpu-memory-utilization 0.1 --kv-cache-gib 16 \
    --out "$RUN/locomo_decide_qwen15.json" 2>&1 | grep --line-buffered -v " INFO \| DEBUG "
fi
wait
tail -30 "$RUN/screen15.log" 2>/dev/null
stamp done
touch "$RUN/done"
