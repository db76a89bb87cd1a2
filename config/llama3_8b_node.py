# Llama-3-8B's shape at 3,407,872 tokens on ONE node of 8 x 80 GB GPUs, the model states in host memory (ALST,
# Bekman et al. 2025: 3.7M tokens for Llama-3.1-8B on one 8 x H100 node; Memo: 1M for a 7B on 8 A800s):
#   torchrun --nproc_per_node=8 train.py config/llama3_8b_node.py
# Check the fit on a laptop first (memory.py's dry run: rank 0 of 8 on fake tensors, no GPU; 15 seconds on 2 cores):
#   python train.py config/llama3_8b_node.py --dry_run=True
#
# The budget per GPU, line by line (P = 8.03e9 parameters, S = 3,407,872 tokens, S/8 = 425,984 per GPU,
# h = 4096, 32 layers; dry run, 2026-11-26):
# - cp_size = 8, Ulysses: every activation holds S/8 tokens; around attention an all-to-all swaps sequence shards
#   for head shards (32 heads / 8 = 4 per GPU, 8 kv heads / 8 = 1), so each GPU runs attention on the whole
#   sequence for its 4 heads. No tensor parallelism: with the states on the host the weights need no splitting,
#   and Ulysses moves less per block (2 all-to-alls of 4 heads) than tp's 4 collectives of whole activations.
# - model states: none stay on the GPU. zero = 3 shards the fp32 weights (the masters), gradients and AdamW's
#   moments over the 8 ranks (FSDP2, parallel.shard_states) and offload_states = True keeps each rank's share in
#   host memory: 16 bytes per parameter / 8 = 14.96 GiB per rank, 119.66 GiB for the node; AdamW steps on the CPU.
#   Replicated on the GPUs at Megatron's 18 bytes per parameter they would be 134.6 GiB per GPU; ZeRO-3 on the GPUs
#   (offload_states = False) fits up to 2,621,440 tokens (bench/RESULTS.md).
# - params 1.38 GiB on the GPU: what FSDP2 gathered in bf16, the embedding, final norm and LM head for the whole
#   step and one block at a time.
# - activations: recompute = 'full' keeps each block's input only, S/8 · h · 2 bytes per block; offload = 1.0
#   sends 30 of them to host memory, the last 2 stay on the GPU.
# - transient: one block's recompute and backward (the MLP in 11 mini-sequences, the loss in 32 chunks) on S/8
#   tokens, and Ulysses' whole-sequence q, k, v and output for 4 heads. The dry run files what a recompute
#   rebuilds under activations: activations and transient together are 40.81 GiB at the peak (block 31's backward).
# - workspace 19.55 GiB: flash attention's backward on 4 heads of the whole sequence (its fp32 dq accumulator; the kv
#   head expanded to the 4 query heads; Ulysses' head-major output and its gradient copied).
# Dry run: 61.75 GiB (the formula's estimate: 58.25) + 2.10 GiB of CUDA context and NCCL buffers = 63.85 GiB, under
# 80% of 80 GiB (64 GiB): it fits, just. (Until 2026-11-26 the dry run read its peak where the device and the host's
# tensors together were highest, not the device alone: 3,538,944 tokens looked like 61.39 GiB; they are 63.95.)
# Host memory: 112.46 GiB per rank (the dry run, equal to the estimate; 14.96 of it model states), 899.68 GiB for the
# node's 8 ranks: a node with 1.5 TiB of RAM or more (pinned memory can be rounded up per tensor: keep headroom).
# Why not 4,194,304 (ALST's 3.7M and more): its dry run is 74.96 GiB + 2.10 = 77.06 GiB, 96% of 80 GiB: workspace
# 24.06 GiB (4 heads of 4M tokens), activations and transient 49.51 GiB (2026-11-24). Per token, activations,
# transient and workspace grow with S: twice the length is about twice those 60 GiB.
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

cp_size = 8           # Ulysses: 425,984 tokens per GPU, 4 of the 32 heads each in attention
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
