# Mixtral-8x7B's shape at 3,670,016 tokens on ONE node of 8 x 80 GB GPUs: 8 experts, 2 a token (moe.py), one expert
# a GPU, the sequence split 8 ways (Ulysses), the model states in host memory:
#   torchrun --nproc_per_node=8 train.py config/mixtral_8x7b_long.py
# Check the fit on a laptop first (memory.py's dry run: rank 0 of 8 on fake tensors, no GPU; 30 seconds on 2 cores):
#   python train.py config/mixtral_8x7b_long.py --dry_run=True
#
# The budget per GPU, line by line (P = 46.70e9 parameters, 12.88e9 of them a token's; S = 3,670,016 tokens, S/8 =
# 458,752 per GPU, each routed to k = 2 experts: 917,504 (token, expert) pairs; h = 4096, 32 layers; dry run,
# 2026-11-27):
# - cp_size = 8, Ulysses: every activation holds S/8 tokens; around attention an all-to-all swaps sequence shards for
#   head shards. Not tensor parallelism: under tp the experts take every tp rank's tokens (moe.py), so each GPU
#   would hold the routed copies of S·k tokens, not S·k/8.
# - ep_size = 8: the 8 ranks of a sequence share out the experts, one each (GShard). Each GPU sends each of its
#   917,504 pairs to its expert's GPU and gets the outputs back (two all-to-alls a layer), and runs its expert on
#   the 917,504 pairs the 8 GPUs send it (when the router balances them; the dry run assumes it does). Without ep
#   (ep_size = 1) every GPU gathers all 8 experts of a block in bf16 (2.63 GiB, not 0.33) and reduce-scatters their
#   fp32 gradients: at 3,276,800 tokens 61.99 + 2.10 GiB, where ep 8 needs 54.72 + 2.10.
# - model states: none stay on the GPU. zero = 3 (FSDP2, parallel.shard_states: the experts over the ranks holding the
#   same one, here each alone; the rest over the 8) and offload_states = True keep the fp32 weights, gradients and
#   AdamW's moments in host memory, 16 bytes per parameter / 8 = 86.99 GiB per rank; AdamW steps on the CPU. On the
#   GPU (the estimate) 0.89 GiB of gathered bf16 weights: the embedding, final norm and LM head for the whole step,
#   and one block with its one expert at a time.
# - activations: recompute = 'full' keeps each block's input only, S/8 · h · 2 bytes = 3.50 GiB per block; offload =
#   1.0 sends 30 of them to host memory, the last 2 stay on the GPU.
# - mlp_chunks = 0: each expert's SwiGLU in mini-sequences of its tokens (chunked.mlp_chunks of them: 11);
#   attention_chunks = 0: 4 head groups of 8 query heads, one at a time (chunked.py).
# - transient: block 31's backward, its recompute: what dominates is the MoE's copies of the 917,504 pairs,
#   [S·k/8, h] in bf16, 7.00 GiB each: the routed tokens, the regrouped ones its expert keeps, the outputs come
#   back and their weighted copies. Five at once at the peak (the dry run's anatomy, `--dry_run_anatomy=8`),
#   35 GiB; the estimate's transient, 49.04 GiB, holds them.
# - workspace 3.51 GiB: flash attention's backward on one head group (Ulysses: 1 query head of the whole sequence).
# Dry run: 61.15 GiB (the formula's estimate: 60.88, -0.4%) + 2.10 GiB of CUDA context and NCCL buffers = 63.25 GiB,
# under 80% of 80 GiB (64 GiB): it fits. The longest in steps of 65,536 (3,735,552: dry run 62.22 GiB, the estimate
# 61.95, -0.4%; + 2.10 = 64.32 GiB does not).
# Host memory: 191.99 GiB per rank (the dry run, equal to the estimate): 86.99 of model states, 105.0 of block inputs;
# 1.50 TiB for the node's 8 ranks (pinned memory can be rounded up per tensor: keep headroom).
# What would cut the peak next: the MoE's copies of the pairs in chunks of tokens (as chunked.py cuts the MLP), each
# dispatched, computed and combined before the next: the [S·k/8, h] copies would shrink with the chunk.
out_dir = 'out-mixtral-8x7b-long'
dataset = 'stdlib'  # byte-level; bring your own corpus with data/hf/prepare.py (Mixtral's 32,000-token vocabulary)
eval_interval = 50
eval_iters = 2
log_interval = 1

# Mixtral-8x7B (init_from='path/to/Mixtral-8x7B-v0.1' loads the real weights)
n_layer = 32
n_head = 32
n_kv_head = 8
n_embd = 4096
intermediate_size = 14336
vocab_size = 32000
rope_theta = 1000000.0
norm_eps = 1e-5
n_experts = 8
experts_per_token = 2

seq_len = 3670016  # the longest that fits by dry run in steps of 65,536 (3,735,552: 62.22 + 2.10 GiB)
batch_size = 1
gradient_accumulation_steps = 1

cp_size = 8           # Ulysses: 458,752 tokens per GPU, 4 of the 32 heads each in attention (one at a time)
cp_impl = 'ulysses'
ep_size = 8           # one expert a GPU: it runs on the 8 GPUs' pairs routed to it (moe.py)

zero = 3              # FSDP2 (parallel.shard_states) over the 8 ranks, each expert over the ranks holding it
offload_states = True # fp32 weights, gradients and AdamW's moments in host memory; AdamW steps on the CPU
mlp_chunks = 0        # automatic (chunked.py): an expert's 917,504 pairs in ceil(3I / h) = 11 mini-sequences
loss_chunks = 0       # automatic: ceil(V / h) = 8 chunks of the LM head + loss
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
