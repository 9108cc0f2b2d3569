#!/usr/bin/env bash
# The standard matrix behind README's tables: bf16, head_dim 64 / 128 / 256, without a
# mask and causal, 512 / 2k / 8k / 16k tokens, forward, backward and deterministic
# backward, jax_fa4 next to cuDNN in one process per part. Parts run one per GPU at a
# time (round robin over the visible GPUs; one GPU runs them one after the other), so
# no two processes share a GPU.
#
#   bash bench/matrix.sh                # every part: 64 128 256:false 256:true decode
#   bash bench/matrix.sh 64 128         # some parts (a part is D, D:causal or decode)
#
# decode: the anchors' decode steps, one query row, 32 / 8 heads of 128, batch 1 and
# 64 over 8k and 128k keys, forward.
# fa4: upstream FlashAttention-4 on the same cells as the D parts (bench.fa4_peer,
#   kernel time as bench.run's), in this session; part of the default list where
#   `flash_attn.cute` imports (../shared/anchors/README.md installs it), else skipped
#   with a note.
#
# GPUS=N uses the first N GPUs (default: every one nvidia-smi lists).
# Writes $OUT/matrix/<part>.jsonl and .txt (the printed table; OUT defaults to
# build/matrix-out), then every line in
# $OUT/<date>-<gpu>.jsonl (gpu: h100, h200, ... from the device name), the file to
# commit as bench/results/<date>-h100.jsonl; `python -m bench.plot --tables` then
# prints README's tables.
set -euo pipefail
cd "$(dirname "$0")/.."
parts=("$@")
if [ ${#parts[@]} -eq 0 ]; then
  parts=(64 128 256:false 256:true decode)
  if python3 -c 'import flash_attn.cute' 2> /dev/null; then parts+=(fa4)
  else echo "matrix.sh: flash_attn.cute does not import: no same-session FA4 cells"; fi
fi
for part in "${parts[@]}"; do
  [[ $part =~ ^[0-9]+(:(false|true))?$ || $part = decode || $part = fa4 ]] ||
    { echo "matrix.sh: a part is D, D:false / D:true, decode or fa4, not '$part'" >&2; exit 2; }
done
out=${OUT:-build/matrix-out}
mkdir -p "$out/matrix"
gpus=${GPUS:-$(nvidia-smi -L | wc -l)}
[ "$gpus" -ge 1 ] || { echo "matrix.sh: no GPU visible" >&2; exit 1; }

run_part() {  # part, gpu
  local name=${1/:/-}
  rm -f "$out/matrix/$name.jsonl" "$out/matrix/$name.txt"
  if [ "$1" = fa4 ]; then
    CUDA_VISIBLE_DEVICES=$2 python3 -m bench.fa4_peer --seqlens 512,2048,8192,16384 \
      --out "$out/matrix/$name.jsonl" > "$out/matrix/$name.txt" 2>&1
    return
  fi
  if [ "$1" = decode ]; then
    local batch
    for batch in 1 64; do
      CUDA_VISIBLE_DEVICES=$2 python3 -m bench.run --hdims 128 --heads 32 --heads-kv 8 \
        --seqlen-q 1 --causal false --batch "$batch" --seqlens 8192,131072 --passes fwd \
        --backends jax_fa4,jax_cudnn --out "$out/matrix/$name.jsonl" \
        >> "$out/matrix/$name.txt" 2>&1 || return 1
    done
    return 0
  fi
  local d=${1%%:*} causal=false,true
  [ "$1" = "$d" ] || causal=${1#*:}
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
