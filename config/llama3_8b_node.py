# Llama-3-8B's shape at 6,356,992 tokens on ONE node of 8 x 80 GB GPUs, the model states in host memory, attention
# one head group at a time (UPipe, arXiv 2602.21196: 5M tokens for Llama-3-8B on 8 x H100; ALST, Bekman et al. 2025:
# 3.7M on one 8 x H100 node; Memo: 1M for a 7B on 8 A800s):
#   torchrun --nproc_per_node=8 train.py config/llama3_8b_node.py
# Check the fit on a laptop first (memory.py's dry run: rank 0 of 8 on fake tensors, no GPU; 30 seconds on 2 cores):
#   python train.py config/llama3_8b_node.py --dry_run=True
#
# The budget per GPU, line by line (P = 8.03e9 parameters, S = 6,356,992 tokens, S/8 = 794,624 per GPU,
# h = 4096, 32 layers; dry run, 2026-11-27):
# - cp_size = 8, Ulysses: every activation holds S/8 tokens; around attention an all-to-all swaps sequence shards
#   for head shards, so each GPU runs attention on the whole sequence for its share of the heads. No tensor
#   parallelism: with the states on the host the weights need no splitting, and Ulysses moves less per block than
#   tp's 4 collectives of whole activations.
# - attention_chunks = 0: 4 head groups of 8 query heads (2 kv heads), one at a time, so each GPU runs attention on
#   1 query head of the whole sequence at a time instead of 4: its q, k, v, output and flash attention's backward
#   workspace a quarter of all heads' (chunked.py). Each group's forward runs again in backward.
# - model states: none stay on the GPU. zero = 3 shards the fp32 weights (the masters), gradients and AdamW's
#   moments over the 8 ranks (FSDP2, parallel.shard_states) and offload_states = True keeps each rank's share in
#   host memory: 16 bytes per parameter / 8 = 14.96 GiB per rank, 119.66 GiB for the node; AdamW steps on the CPU.
# - params 1.38 GiB on the GPU: what FSDP2 gathered in bf16, the embedding, final norm and LM head for the whole
#   step and one block at a time.
# - activations: recompute = 'full' keeps each block's input only, S/8 · h · 2 bytes = 6.06 GiB per block;
#   offload = 1.0 sends 30 of them to host memory, the last 2 stay on the GPU.
# - transient: one block's recompute and backward (the MLP in 11 mini-sequences, one head group's attention) on S/8
#   tokens. The dry run files what a recompute rebuilds under activations: activations and transient together are
#   53.90 GiB at the peak (block 31's backward).
# - workspace 6.09 GiB: flash attention's backward on 1 head of the whole sequence (its fp32 dq accumulator;
#   Ulysses' head-major output and its gradient copied).
# Dry run: 61.37 GiB (the formula's estimate: 59.46, -3.1%) + 2.10 GiB of CUDA context and NCCL buffers = 63.47
# GiB, under 80% of 80 GiB (64 GiB): it fits. The longest in steps of 65,536 (6,422,528: 61.97 + 2.10 does not).
# Host memory: 196.83 GiB per rank (the dry run, equal to the estimate; 14.96 of it model states), 1.54 TiB for the
# node's 8 ranks: a node with 2 TiB of RAM (pinned memory can be rounded up per tensor: keep headroom).
# What the peak is made of, and what would cut it next: at block 31's backward the two block inputs kept on the GPU
# (offload.KEEP_LAST, 12.1 GiB), the residual stream and its gradient, the recomputed block; the LM head's moment
# holds 59.13 GiB of tensors (its fp32 chunk of logits 11.86 GiB among them). Offloading the last two blocks' inputs
# too (their backward comes right after their forward: the copies would not overlap) is the next step.
out_dir = 'out-llama3-8b-node'
dataset = 'stdlib'  # byte-level; bring your own corpus with data/hf/prepare.py (Llama 3's tokenizer)
eval_interval = 50
eval_iters = 2
log_interval = 1

# Llama-3-8B (init_from='path/to/Meta-Llama-3-8B' loads the real weights, with its own tokenizer)
n_layer = 32
n_head = 32
n_kv_head = 8
n_embd = 4096
intermediate_size = 14336
vocab_size = 128256
rope_theta = 500000.0
norm_eps = 1e-5

seq_len = 6356992  # the longest that fits by dry run in steps of 65,536 (6,422,528: 61.97 + 2.10 GiB)
batch_size = 1
gradient_accumulation_steps = 1

cp_size = 8           # Ulysses: 794,624 tokens per GPU, 4 of the 32 heads each in attention (one at a time)
cp_impl = 'ulysses'

zero = 3              # FSDP2 (parallel.shard_states) over the 8 cp ranks
offload_states = True # fp32 weights, gradients and AdamW's moments in host memory; AdamW steps on the CPU
mlp_chunks = 0        # automatic: ceil(3I / h) = 11 mini-sequences (chunked.py)
loss_chunks = 0       # automatic: ceil(V / h) = 32 chunks of the LM head + loss
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
