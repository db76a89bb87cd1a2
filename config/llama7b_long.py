# Llama-2-7B's shape at a 512K-token context on one node of 8 x 80 GB GPUs (H100 / A100 / A800):
#   torchrun --nproc_per_node=8 train.py config/llama7b_long.py
# Check the fit on a laptop first (memory.py's dry run: rank 0 of 8 on fake tensors, no GPU needed):
#   python train.py config/llama7b_long.py --dry_run=True
#
# The layout, and why (per rank; P = 6.74e9 parameters, S = 524,288 tokens, h = 4096, 32 layers):
# - tp_size = 8 (Megatron tensor + sequence parallelism over the node's NVLink): model states are
#   18 bytes/param (bf16 weights, fp32 grads, fp32 master + Adam m, v) / 8 = 15.2 GB per rank. 7B
#   can't be replicated: cp = 8 with tp = 1 keeps 18·P = 121 GB of states on every rank (ZeRO-1 over
#   the 8 cp ranks still leaves 10·P = 67 GB), so the GPUs go to tp first. 32 heads / 8 = 4 per rank;
#   Llama-2-7B has no GQA (32 kv heads), so kv heads split evenly too.
# - cp_size = 1: with tp = 8 there is no GPU left for it. On 16 GPUs (--nnodes=2), keep tp = 8 within
#   each node and add cp_size = 2 with cp_impl = 'ring' across nodes: the ring moves only k, v
#   (2·S·kv·2/cp bytes per hop), overlapped with attention, and doubles the context to 1M.
# - recompute = 'full' keeps one bf16 tensor per layer, the block input on its sequence shard:
#   S/8 · h · 2 bytes = 0.5 GiB per layer, 16 GiB for 32 layers.
# - the transient working set is one recomputed block in backward: under sequence parallelism its
#   input is all-gathered to the whole S · h (4 GiB in bf16) and the row-parallel outputs are whole
#   S · h partial sums until their reduce-scatter; q, k, v for 4 heads, the MLP in mini-sequences and
#   the loss in vocabulary-parallel chunks (chunked.py, automatic) stay small beside them.
# The dry run (memory.py, rank 0 of 8): params 1.57, grads 3.14, optimizer 9.42, activations 16.51,
# transient 24.24 GiB: 54.87 GiB measured on fake tensors (estimate 55.38) + 1.60 GiB overhead =
# 56.98 GiB, 71% of 80 GB: fits under the 80% rule.
# 1M tokens on these 8 GPUs: the same layout needs 96.6 GiB (the all-gathered S·h tensors grow with S);
# offload = 1.0 (offload.py) moves the block inputs to host memory, but its dry run under tp = 8 does not
# fit yet either (it keeps more than full recompute under sequence parallelism: an open issue).
# With 16 GPUs (two nodes: --nnodes=2 ... --cp_size=2 --seq_len=1048576, ring attention between the
# nodes, zero=1 splitting the AdamW moments over the 2 cp ranks) 1M tokens fit: the dry run measures
# 52.25 GiB (estimate 52.33) + 2.60 GiB overhead per rank.
out_dir = 'out-llama7b-long'
dataset = 'stdlib'  # byte-level; bring your own corpus with data/hf/prepare.py (Llama-2's 32,000-token vocabulary)
eval_interval = 50
eval_iters = 2
log_interval = 1

# Llama-2-7B
n_layer = 32
n_head = 32
n_kv_head = 32
n_embd = 4096
intermediate_size = 11008
vocab_size = 32000
rope_theta = 10000.0
norm_eps = 1e-5

seq_len = 524288
batch_size = 1
gradient_accumulation_steps = 8  # 4M tokens per step

tp_size = 8
cp_size = 1
cp_impl = 'ring'  # used when cp_size > 1 (see above); Ulysses needs heads/tp divisible by cp
zero = 1          # no effect with dp = cp = 1; shards the AdamW moments once cp or dp > 1

mlp_chunks = 0    # automatic: ceil(I / h) mini-sequences
loss_chunks = 0   # automatic: ceil(V / h) chunks, vocabulary-parallel over the 8 ranks
recompute = 'full'
offload = 0.0

learning_rate = 3e-4
min_lr = 3e-5
warmup_iters = 20
max_iters = 1000
weight_decay = 0.1
beta1 = 0.9
beta2 = 0.95
grad_clip = 1.0
dtype = 'bfloat16'
device = 'cuda'
