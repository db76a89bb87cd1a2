# Qwen3-8B's shape at 6,356,992 tokens on ONE node of 8 x 80 GB GPUs, the model states in host memory, attention
# one head group at a time: the layout of config/llama3_8b_node.py on Qwen3's block (docs/models.md):
#   torchrun --nproc_per_node=8 train.py config/qwen3_8b_long.py
# Check the fit on a laptop first (memory.py's dry run: rank 0 of 8 on fake tensors, no GPU; a minute on 2 cores):
#   python train.py config/qwen3_8b_long.py --dry_run=True
#
# The budget per GPU, line by line (P = 8.19e9 parameters, S = 6,356,992 tokens, S/8 = 794,624 per GPU, h = 4096,
# 36 layers, 32 query heads of 128 over 8 kv heads, a 151,936-token vocabulary; dry run, 2026-12-03):
# - Qwen3 against Llama-3-8B: an RMSNorm over each head's q and k before RoPE (qk_norm), 4 more layers, a narrower
#   MLP (12,288 against 14,336), a larger vocabulary. Its head_dim is n_embd / n_head here (128); the 0.6B and
#   the MoE models decouple it. The norms keep q and k before them for backward, which recompute = 'full' drops
#   with the rest of a block.
# - cp_size = 8, Ulysses: every activation holds S/8 tokens; around attention an all-to-all swaps sequence shards
#   for head shards, so each GPU runs attention on the whole sequence for 4 of the 32 heads (1 kv head).
# - attention_chunks = 0: 4 head groups of 8 query heads, one at a time: 1 query head of the whole sequence at a
#   time (chunked.py); each group's forward runs again in backward.
# - model states: none stay on the GPU. zero = 3 (FSDP2) over the 8 ranks and offload_states = True: the fp32
#   weights, gradients and AdamW's moments in host memory, 16 bytes per parameter / 8; AdamW steps on the CPU. On
#   the GPU 2.68 GiB of gathered bf16 weights: the embedding, final norm and LM head (151,936 rows of 4,096 each)
#   for the whole step, one block at a time.
# - activations: recompute = 'full' keeps each block's input only, S/8 · h · 2 bytes = 6.06 GiB per block;
#   offload = 1.0 sends 34 of them to host memory, the last 2 stay on the GPU.
# - transient: one block's recompute and backward on S/8 tokens (the MLP in 9 mini-sequences, one head group's
#   attention). The dry run files what a recompute rebuilds under activations, the estimate under transient.
# - workspace 6.09 GiB: flash attention's backward on 1 head of the whole sequence (the formula's).
# The dry run's table (estimate, dry run, error relative to the dry run's total):
#   params          2.68 GiB     2.68 GiB   +0.0%
#   grads           0.00 KiB     1.16 GiB   -1.9%
#   optimizer       0.00 KiB     0.00 KiB   +0.0%
#   activations    12.88 GiB    45.47 GiB  -52.7%
#   transient      38.12 GiB     6.42 GiB  +51.3%
#   workspace       6.09 GiB     6.09 GiB   +0.0%
#   total          59.77 GiB    61.82 GiB   -3.3%
#   + overhead      2.10 GiB   (CUDA context, NCCL buffers: not in tensors)
#   device         80.00 GiB   80% rule: 63.92 GiB of 64.00 GiB -> fits
# Dry run: 61.82 GiB (the estimate: 59.77, -3.3%) + 2.10 GiB of CUDA context and NCCL buffers = 63.92 GiB, under 80%
# of 80 GiB (64 GiB): it fits. The longest in steps of 65,536: 6,422,528 tokens does not (dry run 62.41 + 2.10 =
# 64.51 GiB; the estimate 60.34). The same length as Llama-3-8B's on this layout: Qwen3's 4 more blocks cost
# host memory (each block's input goes there), not GPU memory, and its peak is one block's backward as Llama's.
# Host memory: 221.38 GiB per rank (the dry run, equal to the estimate), 1.73 TiB for the node's 8 ranks (pinned
# memory can be rounded up per tensor: keep headroom).
out_dir = 'out-qwen3-8b-long'
dataset = 'stdlib'  # byte-level; bring your own corpus with data/hf/prepare.py (Qwen's tokenizer.json)
eval_interval = 50
eval_iters = 2
log_interval = 1

# Qwen3-8B (init_from='path/to/Qwen3-8B' loads the real weights, with its own tokenizer)
n_layer = 36
n_head = 32
n_kv_head = 8
n_embd = 4096
head_dim = 128
qk_norm = True         # Qwen3: RMSNorm over each head's q and k before RoPE
intermediate_size = 12288
vocab_size = 151936
rope_theta = 1000000.0
norm_eps = 1e-6

seq_len = 6356992  # the longest that fits by dry run in steps of 65,536 (6,422,528: 62.41 + 2.10 GiB)
batch_size = 1
gradient_accumulation_steps = 1

cp_size = 8           # Ulysses: 794,624 tokens per GPU, 4 of the 32 heads each in attention (one at a time)
cp_impl = 'ulysses'

zero = 3              # FSDP2 (parallel.shard_states) over the 8 cp ranks
offload_states = True # fp32 weights, gradients and AdamW's moments in host memory; AdamW steps on the CPU
mlp_chunks = 0        # automatic: ceil(3I / h) = 9 mini-sequences (chunked.py)
loss_chunks = 0       # automatic: ceil(V / h) = 38 chunks of the LM head + loss
attention_chunks = 0  # automatic: one head group at a time (chunked.py)
recompute = 'full'
offload = 1.0         # every block input to host memory (Memo's alpha; with 'full' only the input is kept)

learning_rate = 1e-5  # continued pre-training of a trained model at long context
min_lr = 1e-6
warmup_iters = 20
max_iters = 1000
weight_decay = 0.1
beta1 = 0.9
beta2 = 0.95
grad_clip = 1.0
dtype = 'bfloat16'
device = 'cuda'
