#!/bin/bash
# What only a CUDA GPU can check, in one script of under 8 minutes:
#   bash bench/gpu_check.sh [OUT_DIR]     (default bench/gpu_check/; $OUT on the device tool's machine)
# 1. the tests marked for CUDA (tests/conftest.py's `cuda`; without a GPU they skip, as on CI): attention by head
#    groups and SDPA's flash kernel against the CPU's reference, offload's streams and pinned pool, stochastic
#    rounding, FSDP2's CPUOffloadPolicy on one rank;
# 2. train_tiny compiled in bf16;
# 3. a Llama-shaped ~1B model (16 blocks of 2048, GQA 16/8, I = 5632) at 32K and 128K tokens, chunked MLP and loss
#    with full recompute, then attention by head groups too: tokens/s, MFU, HFU and the allocator's peak beside
#    the estimate (memory.json). The dry runs are the same commands with --dry_run=True, on any CPU.
# Writes three files to OUT_DIR: gpu.txt, tests.txt, results.md (the runs' logs stay in /tmp/gpu_check).
set -u
out=${1:-${OUT:-bench/gpu_check}}
mkdir -p "$out" /tmp/gpu_check
export PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader | tee "$out/gpu.txt"
python3 -c "import torch; print('torch', torch.__version__)" | tee -a "$out/gpu.txt"
timeout 240 python3 -m pytest -q -rs -k "on_cuda or cuda_rank" tests/test_chunked.py tests/test_model.py \
    tests/test_offload.py tests/test_optim.py tests/test_parallel.py -p no:cacheprovider 2>&1 | tail -25 \
    | tee "$out/tests.txt"

# one run: its stdout in /tmp/gpu_check/NAME.log, stopped once three steps are logged
run() {
  local name=$1; shift
  local log=/tmp/gpu_check/$name.log
  python3 train.py "$@" --max_iters=100 --eval_interval=1000 --eval_iters=1 --log_interval=1 \
      --out_dir=/tmp/gpu_check/$name > "$log" 2>&1 &
  local pid=$! i
  for i in $(seq 1 150); do
    if [ "$(grep -c '^iter ' "$log")" -ge 3 ] || ! kill -0 $pid 2>/dev/null; then break; fi
    sleep 1
  done
  kill $pid 2>/dev/null; wait $pid 2>/dev/null
}

run tiny_compiled config/train_tiny.py --device=cuda --dtype=bfloat16 --compile=True
ONE_B="--n_layer=16 --n_head=16 --n_kv_head=8 --n_embd=2048 --intermediate_size=5632 --vocab_size=32000
       --batch_size=1 --dtype=bfloat16 --device=cuda --recompute=full --mlp_chunks=0 --loss_chunks=0"
for S in 32768 131072; do
  run "b1_${S}_chunks" $ONE_B --seq_len=$S
  run "b1_${S}_heads" $ONE_B --seq_len=$S --attention_chunks=0
done

python3 - "$out" <<'PY'
import json, os, sys
out = sys.argv[1]
rows = ['| run | tokens/s | MFU | HFU | peak allocated | estimate | last line |', '|---|---|---|---|---|---|---|']
for name in sorted(f[:-4] for f in os.listdir('/tmp/gpu_check') if f.endswith('.log')):
    lines = open(f'/tmp/gpu_check/{name}.log').read().splitlines()
    tail = (lines[-1] if lines else 'no output').replace('|', '/')[:160]
    try:
        log = [json.loads(line) for line in open(f'/tmp/gpu_check/{name}/log.jsonl')]
        est = json.load(open(f'/tmp/gpu_check/{name}/memory.json'))['ranks'][0]['estimate']['total']
        last = log[-1]
    except (OSError, ValueError, KeyError, IndexError):
        rows.append(f'| {name} | - | - | - | - | - | {tail} |')
        continue
    mfu, hfu = (f"{100 * last[k]:.1f}%" if last.get(k) else '-' for k in ('mfu', 'hfu'))
    rows.append(f"| {name} | {last['tokens_per_s']:,.0f} | {mfu} | {hfu} | {last['peak_mem_bytes'] / 2**30:.2f} GiB "
                f"| {est / 2**30:.2f} GiB | iter {last['iter']} |")
open(os.path.join(out, 'results.md'), 'w').write('\n'.join(rows) + '\n')
print('\n'.join(rows))
PY
