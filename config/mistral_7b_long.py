# Mistral-7B-v0.1's shape at 6,619,136 tokens on ONE node of 8 x 80 GB GPUs: every layer's attention windowed to the
# last 4,096 keys (sliding_window), the model states in host memory, the sequence split 8 ways (Ulysses):
#   torchrun --nproc_per_node=8 train.py config/mistral_7b_long.py
# Check the fit on a laptop first (memory.py's dry run: rank 0 of 8 on fake tensors, no GPU; 30 seconds on 2 cores):
#   python train.py config/mistral_7b_long.py --dry_run=True
#
# The budget per GPU, line by line (P = 7.24e9 parameters, S = 6,619,136 tokens, S/8 = 827,392 per GPU, h = 4096,
# 32 layers, 8 kv heads for the 32 query heads; dry run, 2026-11-28):
# - a window makes attention O(S·W) in time, but not its tensors: q, k, v, the output and flash attention's
#   backward workspace hold every token all the same. What sets the length is what the layout holds per token, as
#   for Llama-3-8B's shape (config/llama3_8b_node.py: the same layout, Llama 3's 128,256-token vocabulary).
# - cp_size = 8, Ulysses: every activation holds S/8 tokens; around attention an all-to-all swaps sequence shards for
#   head shards, and each GPU runs varlen's windowed kernel on the whole sequence for 4 of the 32 heads (1 kv head).
# - attention_chunks = 0: 4 head groups of 8 query heads, one at a time: 1 query head of the whole sequence at a
#   time (chunked.py).
# - model states: none stay on the GPU. zero = 3 (FSDP2) over the 8 ranks and offload_states = True: the fp32
#   weights, gradients and AdamW's moments in host memory, 16 bytes per parameter / 8; AdamW steps on the CPU. On
#   the GPU 666 MiB (the dry run) of gathered bf16 weights: the embedding, final norm and LM head, one block at a time.
# - activations: recompute = 'full' keeps each block's input only, S/8 · h · 2 bytes = 6.31 GiB per block; offload =
#   1.0 sends 30 of them to host memory, the last 2 stay on the GPU.
# - transient: one block's recompute and backward on S/8 tokens (the MLP in mini-sequences, one head group's
#   attention). The dry run files what a recompute rebuilds under activations, the estimate under transient:
#   together 54.55 GiB (dry run) and 53.03 GiB (estimate) at the peak, block 31's backward.
# - workspace 6.34 GiB: flash attention's backward on 1 head of the whole sequence (the formula's).
# The dry run's table (estimate, dry run, error relative to the dry run's total):
#   params        916.02 MiB   666.02 MiB   +0.4%
#   grads           0.00 KiB     8.00 KiB   -0.0%
#   optimizer       0.00 KiB     0.00 KiB   +0.0%
#   activations    13.41 GiB    47.59 GiB  -55.5%
#   transient      39.62 GiB     6.96 GiB  +53.1%
#   workspace       6.34 GiB     6.34 GiB   +0.0%
#   total          60.27 GiB    61.54 GiB   -2.1%
#   + overhead      2.10 GiB   (CUDA context, NCCL buffers: not in tensors)
#   device         80.00 GiB   80% rule: 63.64 GiB of 64.00 GiB -> fits
# Dry run: 61.54 GiB (the estimate: 60.27, -2.1%) + 2.10 GiB of CUDA context and NCCL buffers = 63.64 GiB, under 80%
# of 80 GiB (64 GiB): it fits. The longest in steps of 65,536: 6,684,672 tokens does not (dry run 62.14 + 2.10 =
# 64.24 GiB; the estimate 60.84).
# Host memory: 202.86 GiB per rank (the dry run, equal to the estimate), 1.58 TiB for the node's 8 ranks (pinned
# memory can be rounded up per tensor: keep headroom).
# The ring instead (--cp_impl=ring: every head on S/8 tokens, of its 8 steps only 3 computing, the neighbours'
# last 4,095 keys moving, where Ulysses' all-to-alls move q, k, v and the output) fits one step more by its dry run
# (2026-11-28, after ring.py ran CUDA's kernel on the dry run's fake tensors): at 6,619,136 tokens 60.79 + 2.10 =
# 62.89 GiB (estimate 57.10, -6.1%); at 6,684,672 61.38 + 2.10 = 63.48 GiB, fits (estimate 57.64, -6.1%); at
# 6,750,208 61.97 + 2.10 = 64.07 GiB, does not. Its dry run's peak holds 61.14 GiB as activations where the
# estimate counts 13.55 + 40.00 GiB of activations and transient: the budget above is Ulysses', the layout kept here.
#   torchrun --nproc_per_node=8 train.py config/mistral_7b_long.py --cp_impl=ring --seq_len=6684672
out_dir = 'out-mistral-7b-long'
dataset = 'stdlib'  # byte-level; bring your own corpus with data/hf/prepare.py (Mistral's 32,000-token vocabulary)
eval_interval = 50
eval_iters = 2
log_interval = 1

# Mistral-7B-v0.1 (init_from='path/to/Mistral-7B-v0.1' loads the real weights)
n_layer = 32
n_head = 32
n_kv_head = 8
n_embd = 4096
intermediate_size = 14336
vocab_size = 32000
rope_theta = 10000.0
norm_eps = 1e-5
sliding_window = 4096  # every layer: a query sees the last 4,096 keys, itself included

seq_len = 6619136  # the longest that fits by dry run in steps of 65,536 (6,684,672: 62.14 + 2.10 GiB)
batch_size = 1
gradient_accumulation_steps = 1

cp_size = 8           # Ulysses: 827,392 tokens per GPU, 4 of the 32 heads each in attention (one at a time)
cp_impl = 'ulysses'
zero = 3              # FSDP2 (parallel.shard_states) over the 8 cp ranks
offload_states = True # fp32 weights, gradients and AdamW's moments in host memory; AdamW steps on the CPU
mlp_chunks = 0        # automatic: ceil(3I / h) = 11 mini-sequences (chunked.py)
loss_chunks = 0       # automatic: ceil(V / h) = 8 chunks of the LM head + loss
attention_chunks = 0  # automatic: one head group at a time (chunked.py)
recompute = 'full'
offload = 1.0         # every block input to host memory (Memo's alpha; with 'full' only the input is kept)

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
