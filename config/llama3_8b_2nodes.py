# Llama-3-8B's shape at 13,107,200 tokens on TWO nodes of 8 x 80 GB GPUs (16 GPUs, 2 TB of host memory a node):
# context parallelism in two dimensions, Ulysses over pairs of neighbouring GPUs x the ring over the 8 pairs
# (parallel.py's c = u x r, cp_ring = r; USP, Fang & Zhao 2024; UPipe's 16-GPU runs reach 9M, ALST 15M on 32):
#   torchrun --nnodes=2 --nproc_per_node=8 --rdzv_backend=c10d --rdzv_endpoint=node0:29500 --rdzv_id=run2 \
#       train.py config/llama3_8b_2nodes.py
# Check the fit on a laptop first (rank 0 of 16 on fake tensors, no GPU; about 4 minutes on 2 cores):
#   WORLD_SIZE=16 python train.py config/llama3_8b_2nodes.py --dry_run=True --host_memory_budget_gb=256
#
# The budget per GPU, line by line (P = 8.03e9 parameters, S = 13,107,200 tokens, S/16 = 819,200 per GPU,
# h = 4096, 32 layers; dry run, 2026-12-03):
# - cp_size = 16, cp_ring = 8: every activation holds S/16 tokens. Around attention Ulysses' all-to-all between two
#   neighbouring GPUs (NVLink) turns a rank's S/16 tokens of every head into the pair's S/8 tokens of half the
#   heads; the ring then runs over the 8 pairs on those (zigzag chunks j and 15 - j of 16 for pair j), each step's
#   k, v sent while the step before computes. Ulysses 16 alone holds each rank's 2 heads of the whole S in
#   attention and crosses InfiniBand with every token's q, k, v twice a layer: its longest is 10,616,832 by
#   estimate, 9,961,472 by dry run.
# - attention_chunks = 0: 4 head groups of 8 query heads and 2 kv heads, one at a time: a rank's attention holds
#   4 query heads and 1 kv head of S/8 tokens at once (Ulysses 2 gives each rank one of a group's 2 kv heads: no
#   copies. Ulysses 8 x the ring 2, cp_ring = 2, copies each kv head to 4 ranks, whose fp32 gradient buffers in
#   the ring then are 4 times as large: its dry run here is 86.43 GiB against an estimate of 61.33, which does
#   not count those copies; plan.py's dry run refuses it).
# - ring attention's index plans (ring.py's ring_plan: int32, about 86 bytes a token of S/8 on rank 0) are shared
#   by every block and head group, held once (held per block and head group as before, 128 of them).
# - model states: none stay on the GPU. zero = 3 shards the fp32 masters, gradients and AdamW's moments over the
#   16 ranks and offload_states = True keeps each rank's share in host memory (16 bytes per parameter / 16 =
#   7.48 GiB); AdamW steps on the CPU. params 2.36 GiB: what FSDP2 gathered in bf16 (the embedding, final norm and
#   LM head for the step, one block at a time).
# - activations: recompute = 'full' keeps each block's input only, S/16 · h · 2 bytes = 6.25 GiB a block; offload =
#   1.0 sends 30 of them to host memory (the last 2 stay on the GPU).
# - transient: one block's recompute and backward on S/16 tokens (the MLP in 44 mini-sequences, one head group's
#   ring attention with its fp32 accumulators); workspace 3.14 GiB: flash's backward on S/8 tokens of 4 heads.
# Dry run: 56.31 GiB (the estimate: 58.16, +3.3%) + 2.60 GiB of CUDA context and NCCL buffers = 58.91 GiB, under
# 80% of 80 GiB (64 GiB): it fits. Host memory: 194.98 GiB a rank (estimate and dry run), 1,560 GiB a node.
# plan.py config/llama3_8b_node.py --gpus=16 --nodes=2 --gpu_gb=80 --host_gb=2048 ranks the ring alone over 16
# first (13,893,632 by estimate; its dry run there: 58.98 GiB, fits) and this split next (13,762,560); at these
# lengths a step is attention's compute (predicted 413 tokens/s here, 410 for the ring alone).
out_dir = 'out-llama3-8b-2nodes'
dataset = 'stdlib'  # byte-level; bring your own corpus with data/hf/prepare.py (Llama 3's tokenizer)
eval_interval = 50
eval_iters = 2
log_interval = 1
n_layer = 32
n_head = 32
n_kv_head = 8
n_embd = 4096
intermediate_size = 14336
vocab_size = 128256
rope_theta = 500000.0
norm_eps = 1e-5
seq_len = 13107200
batch_size = 1
gradient_accumulation_steps = 1
cp_size = 16          # 819,200 tokens per GPU
cp_ring = 8           # Ulysses 2 (neighbouring GPUs, NVLink) x the ring over the 8 pairs (both nodes)
zero = 3
offload_states = True
mlp_chunks = 44       # plan.py's: 4x the automatic 11
loss_chunks = 128     # plan.py's: 4x the automatic 32
attention_chunks = 0  # automatic: 4 head groups (chunked.py)
recompute = 'full'
offload = 1.0
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
