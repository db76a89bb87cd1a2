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
# 4. packed documents (doc_mask): attention alone, forward + backward, at 32K tokens with 1, 16 and 1,000 documents,
#    model.attention's one varlen_attn call against the per-document SDPA loop (ms a step); the ~1B model at 32K
#    with doc_mask on the corpus's own documents beside it without.
# 5. fp16 with loss scaling beside bf16 (train_tiny, three steps each).
# 6. (GPU_CHECK=peers only, issue 40) offload's overlap on the ~1B at 128K: offload=1.0 against none under the same
#    full recompute (Memo: no loss; the goal <= 5%); then bench/peers.py on the GPU: HF plain, checkpointed and with
#    liger-kernel (pip-installed here) against ours, the ~1B at 32K and 128K, and the longest each fits.
# Writes to OUT_DIR: gpu.txt, tests.txt, results.md, docs.md, peers.md (the runs' logs stay in /tmp/gpu_check).
# GPU_CHECK=docs runs the tests, parts 4 and 5 only; GPU_CHECK=peers part 6 only.
set -u
out=${1:-${OUT:-bench/gpu_check}}
parts=${GPU_CHECK:-all}
mkdir -p "$out" /tmp/gpu_check
export PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader | tee "$out/gpu.txt"
python3 -c "import torch; print('torch', torch.__version__)" | tee -a "$out/gpu.txt"
# torch < 2.12's varlen_attn takes no enable_gqa (its flash kernel reads fewer kv heads as they are; 2.12 added
# the argument and its check): where the device's torch is older than the project's 2.13, a shim for this check
mkdir -p /tmp/gpu_check/shim
cat > /tmp/gpu_check/shim/sitecustomize.py <<'PY'
import inspect
import torch.nn.attention.varlen as varlen
if 'enable_gqa' not in inspect.signature(varlen.varlen_attn).parameters:
    older = varlen.varlen_attn

    def varlen_attn(*args, enable_gqa=False, **kwargs):
        return older(*args, **kwargs)
    varlen.varlen_attn = varlen_attn
PY
export PYTHONPATH=/tmp/gpu_check/shim${PYTHONPATH:+:$PYTHONPATH}
python3 -c "import inspect, torch.nn.attention.varlen as v; print('varlen_attn', inspect.signature(v.varlen_attn))" \
    | tee -a "$out/gpu.txt"
if [ "$parts" != peers ]; then
  timeout 240 python3 -m pytest -q -rs -k "on_cuda or cuda_rank" tests/test_chunked.py tests/test_model.py \
      tests/test_offload.py tests/test_optim.py tests/test_parallel.py tests/test_ring.py -p no:cacheprovider 2>&1 \
      | tail -25 | tee "$out/tests.txt"
fi

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

ONE_B="--n_layer=16 --n_head=16 --n_kv_head=8 --n_embd=2048 --intermediate_size=5632 --vocab_size=32000
       --batch_size=1 --dtype=bfloat16 --device=cuda --recompute=full --mlp_chunks=0 --loss_chunks=0"
if [ "$parts" = all ]; then
  run tiny_compiled config/train_tiny.py --device=cuda --dtype=bfloat16 --compile=True
  for S in 32768 131072; do
    run "b1_${S}_chunks" $ONE_B --seq_len=$S
    run "b1_${S}_heads" $ONE_B --seq_len=$S --attention_chunks=0
  done
elif [ "$parts" = peers ]; then
  # the same blocks and recompute, activations kept on the GPU or sent to the host while compute runs
  run b1_131072_kept $ONE_B --seq_len=131072
  run b1_131072_offload $ONE_B --seq_len=131072 --offload=1.0
  pip install -q liger-kernel 2>&1 | tail -1
  timeout 400 python3 bench/peers.py --device=cuda --shape=1b --seq_lens=32768,131072 --rounds=1 --steps=2 \
      --mem_gb=100 --max_len=524288 --results="$out/peers.md" 2>&1 | tail -30
else
  run b1_32768_chunks $ONE_B --seq_len=32768
fi
if [ "$parts" != peers ]; then
run b1_32768_docs $ONE_B --seq_len=32768 --doc_mask=True
# 5. fp16 with dynamic loss scaling (GPUs without bf16) beside bf16: train_tiny's losses, the loss scale
run tiny_bf16 config/train_tiny.py --device=cuda --dtype=bfloat16
run tiny_fp16 config/train_tiny.py --device=cuda --dtype=float16

# attention alone: Llama-3-8B's heads (32 q, 8 kv, hd 128), bf16, one sequence of 32K tokens
python3 - "$out" <<'PY' 2>&1 | tail -12
import sys, time
import numpy as np
import torch
import model
S, H, K, hd = 32768, 32, 8, 128
g = torch.Generator(device='cuda').manual_seed(0)
q, k, v = (torch.randn(1, S, n, hd, device='cuda', dtype=torch.bfloat16, generator=g).transpose(1, 2)
           .requires_grad_() for n in (H, K, K))
rows = ['| documents | attention | ms (forward + backward) |', '|---|---|---|']
for n_docs in (0, 1, 16, 1000):
    docs = None if n_docs == 0 else np.linspace(0, S, n_docs, endpoint=False).astype(np.int64)
    for varlen in ((False,) if docs is None else (False, True)):
        times = []
        for i in range(6):  # the first a warm-up
            torch.cuda.synchronize()
            t = time.perf_counter()
            model.attention(q, k, v, docs, varlen).sum().backward()
            torch.cuda.synchronize()
            times.append(time.perf_counter() - t)
        name = 'SDPA, no mask' if docs is None else ('one varlen call' if varlen else 'per-document loop')
        rows.append(f'| {n_docs or "none"} | {name} | {1000 * float(np.median(times[1:])):.2f} |')
open(sys.argv[1] + '/docs.md', 'w').write('\n'.join(rows) + '\n')
print('\n'.join(rows))
PY
fi

python3 - "$out" <<'PY'
import json, os, sys
out = sys.argv[1]
rows = ['| run | tokens/s | MFU | HFU | peak allocated | estimate | losses (loss scale) |', '|---|---|---|---|---|---|---|']
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
    losses = ' '.join(f"{r['loss']:.4f}" for r in log)
    rows.append(f"| {name} | {last['tokens_per_s']:,.0f} | {mfu} | {hfu} | {last['peak_mem_bytes'] / 2**30:.2f} GiB "
                f"| {est / 2**30:.2f} GiB | {losses} ({last.get('loss_scale')}) |")
open(os.path.join(out, 'results.md'), 'w').write('\n'.join(rows) + '\n')
print('\n'.join(rows))
PY
