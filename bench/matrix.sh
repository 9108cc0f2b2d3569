#!/usr/bin/env bash
# The standard matrix behind README's tables: bf16, head_dim 64 / 128 / 256, without a
# mask and causal, 512 / 2k / 8k / 16k tokens, forward, backward and deterministic
# backward, jax_fa4 next to cuDNN in one process per part. Parts run one per GPU at a
# time (round robin over the visible GPUs; one GPU runs them one after the other), so
# no two processes share a GPU.
#
#   bash bench/matrix.sh                # every part: 64 128 256:false 256:true
#   bash bench/matrix.sh 64 128         # some parts (a part is D or D:causal)
#
# Writes $OUT/matrix/<part>.jsonl and .txt (the printed table), then every line in
# $OUT/<date>-<gpu>.jsonl (gpu: h100, h200, ... from the device name), the file to
# commit as bench/results/<date>-h100.jsonl; `python -m bench.plot --tables` then
# prints README's tables.
set -euo pipefail
cd "$(dirname "$0")/.."
parts=("$@")
[ ${#parts[@]} -gt 0 ] || parts=(64 128 256:false 256:true)
for part in "${parts[@]}"; do
  [[ $part =~ ^[0-9]+(:(false|true))?$ ]] ||
    { echo "matrix.sh: a part is D or D:false / D:true, not '$part'" >&2; exit 2; }
done
out=${OUT:-build/matrix-out}
mkdir -p "$out/matrix"
gpus=${GPUS:-$(nvidia-smi -L | wc -l)}
[ "$gpus" -ge 1 ] || { echo "matrix.sh: no GPU visible" >&2; exit 1; }

run_part() {  # part, gpu
  local d=${1%%:*} causal=false,true
  [ "$1" = "$d" ] || causal=${1#*:}
  local name=${1/:/-}
  rm -f "$out/matrix/$name.jsonl"
  CUDA_VISIBLE_DEVICES=$2 python3 -m bench.run --hdims "$d" --causal "$causal" \
    --seqlens 512,2048,8192,16384 --passes fwd,bwd,bwd_det \
    --backends jax_fa4,jax_cudnn --out "$out/matrix/$name.jsonl" \
    > "$out/matrix/$name.txt" 2>&1
}

failed=0
for ((i = 0; i < ${#parts[@]}; i += gpus)); do
  pids=()
  for ((g = 0; g < gpus && i + g < ${#parts[@]}; g++)); do
    part=${parts[i + g]}
    echo "part $part on GPU $g"
    run_part "$part" "$g" & pids+=($!)
  done
  for pid in "${pids[@]}"; do wait "$pid" || failed=1; done
done
for part in "${parts[@]}"; do
  name=${part/:/-}
  cat "$out/matrix/$name.txt"
done
[ "$failed" = 0 ] || { echo "matrix.sh: a part failed (its .txt has the error)" >&2; exit 1; }

gpu=$(python3 -c 'import json, re, sys
line = open(sys.argv[1]).readline()
print(re.search(r"H\d+|[A-Z]\d+", json.loads(line)["device"]).group(0).lower())' \
  "$out/matrix/${parts[0]/:/-}.jsonl")
all="$out/$(date +%F)-$gpu.jsonl"
for part in "${parts[@]}"; do cat "$out/matrix/${part/:/-}.jsonl"; done > "$all"
echo "$(wc -l < "$all") lines in $all"
