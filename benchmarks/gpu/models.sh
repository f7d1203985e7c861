# The Qwen2.5-Coder models on the GPU machine (sourced after setup.sh, with NOW set): each GGUF from
# its pieces (/tmp/parts/<q05|q15>.NN, closed by <q05|q15>.done), checked and converted to a bf16
# directory once per machine, however many drivers ask. `convert_model q05` returns when the 0.5B is
# ready (converting it, or waiting for the driver that is); its log is /tmp/convert-<q05|q15>.log.
Q05=/tmp/qwen2.5-coder-0.5b-instruct-bfloat16 Q15=/tmp/qwen2.5-coder-1.5b-instruct-bfloat16
declare -A MODEL_SHA=([q05]=1d9614638d18024d0fbb36575a15f1302a3adf044df10345688ec4f6e1c4ff32
                      [q15]=cc324af070c2ecbfd324a30884d2f951a7ff756aba85cb811a6ec436933bb046)
declare -A MODEL_DIR=([q05]=$Q05 [q15]=$Q15)
convert_model() {  # $1 = q05 | q15; status 1 if the pieces do not add up or the conversion failed
  local m=$1
  if mkdir /tmp/convert-$m.lock 2>/dev/null; then
    { until [[ -f /tmp/parts/$m.done ]]; do sleep 2; done
      cat /tmp/parts/$m.[0-9]* > /tmp/$m.gguf && echo "${MODEL_SHA[$m]}  /tmp/$m.gguf" | sha256sum -c - \
        && OMP_NUM_THREADS=4 PYTHONPATH=$NOW nice python3 -m inferscale.cli convert /tmp/$m.gguf \
             --out "${MODEL_DIR[$m]}" --dtype bfloat16 && touch /tmp/converted-$m
      touch /tmp/convert-$m.over; } > /tmp/convert-$m.log 2>&1
  fi
  until [[ -f /tmp/convert-$m.over ]]; do sleep 2; done
  [[ -f /tmp/converted-$m ]]
}
