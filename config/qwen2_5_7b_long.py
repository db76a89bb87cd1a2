# Qwen2.5-7B's shape at 6,291,456 tokens on ONE node of 8 x 80 GB GPUs, the sequence around a ring of 8 (its 28
# query heads can't be split 8 ways by Ulysses), the model states in host memory (docs/models.md):
#   torchrun --nproc_per_node=8 train.py config/qwen2_5_7b_long.py
# Check the fit on a laptop first (memory.py's dry run: rank 0 of 8 on fake tensors, no GPU; 5 minutes on 2 cores):
#   python train.py config/qwen2_5_7b_long.py --dry_run=True
#
# Which layouts take 28 query heads over 4 kv heads (parallel.check_layout says each refusal in one line):
# - Ulysses spreads heads: cp_size must divide the heads a rank holds (28, or 28 / tp_size) and its kv heads must
#   divide cp_size or be divided by it. cp 2 and 4 work; cp 8 does not (28 / 8), nor cp 7 (4 kv heads over 7).
# - tensor parallelism shards heads and the MLP's 18,944: tp 2 and 4 work, tp 8 does not (28 / 8); and under tp 2
#   or 4 Ulysses must divide the 14 or 7 heads left a rank: neither 4 nor 2 does for 7, 4 does not for 14.
# - the ring (ring attention, ring.py) passes k, v around and never splits heads: any cp_size whose 2·cp zigzag
#   chunks divide the sequence. So one sequence over all 8 GPUs is the ring (cp 8), or tp 2 x ring 4, tp 4 x
#   ring 2; Ulysses 4 reaches 4 GPUs a sequence (dp 2 for the other 4: half this length).
#
# The budget per GPU, line by line (P = 7.62e9 parameters, S = 6,291,456 tokens, S/8 = 786,432 per GPU, h = 3584,
# 28 layers, 28 query heads of 128 over 4 kv heads, biases on q, k and v; dry run, 2026-12-03):
# - cp_size = 8, the ring: every activation holds S/8 tokens (zigzag chunks r and 15 - r of 16); each step a rank
#   attends its q to a neighbour's k, v and passes them on, every head on S/8 tokens.
# - attention_chunks = 0: 4 head groups (1 kv head and its 7 query heads each), one at a time.
# - model states: none stay on the GPU. zero = 3 (FSDP2) over the 8 ranks and offload_states = True: the fp32
#   weights, gradients and AdamW's moments in host memory, 16 bytes per parameter / 8; AdamW steps on the CPU. On
#   the GPU 2.46 GiB of gathered bf16 weights: the embedding, final norm and LM head (152,064 rows of 3,584 each)
#   for the whole step, one block at a time.
# - activations: recompute = 'full' keeps each block's input only, S/8 · h · 2 bytes = 5.25 GiB per block;
#   offload = 1.0 sends 26 of them to host memory, the last 2 stay on the GPU.
# - transient: one block's recompute and backward on S/8 tokens (the MLP in 16 mini-sequences, one head group's
#   attention with the ring's steps).
# - workspace 5.27 GiB: flash attention's backward on one head group, its 7 query heads on S/8 tokens (the
#   formula's).
# The dry run's table (estimate, dry run, error relative to the dry run's total):
#   params          2.46 GiB     2.46 GiB   +0.0%
#   grads           0.00 KiB     1.39 GiB   -2.3%
#   optimizer       0.00 KiB     0.00 KiB   +0.0%
#   activations    18.30 GiB    20.02 GiB   -2.8%
#   transient      33.25 GiB    32.59 GiB   +1.1%
#   workspace       5.27 GiB     5.27 GiB   +0.0%
#   total          59.29 GiB    61.73 GiB   -4.0%
#   + overhead      2.10 GiB   (CUDA context, NCCL buffers: not in tensors)
#   device         80.00 GiB   80% rule: 63.83 GiB of 64.00 GiB -> fits
# Dry run: 61.73 GiB (the estimate: 59.29, -4.0%) + 2.10 GiB of CUDA context and NCCL buffers = 63.83 GiB, under 80%
# of 80 GiB (64 GiB): it fits. The longest in steps of 65,536: 6,356,992 tokens does not (dry run 62.32 + 2.10 =
# 64.42 GiB; the estimate 59.86).
# Host memory: 150.69 GiB per rank (the dry run, equal to the estimate), 1.18 TiB for the node's 8 ranks (pinned
# memory can be rounded up per tensor: keep headroom).
# Since issue 53 ring.py holds one ring plan for every block and head group (they were one each): the dry run at
# this length is 54.74 GiB (estimate 52.30), and the longest that fits is now 7,143,424 tokens (61.45 + 2.10 GiB;
# 7,208,960: 61.96 + 2.10 does not). The figures above are the issue 52 run's. Ulysses 4 x the ring 2 (cp_ring=2:
# 7 of the 28 heads a rank, no head groups) reaches 3,145,728 (60.27 + 2.60 GiB; 3,211,264: 61.41 + 2.60 does not).
out_dir = 'out-qwen2.5-7b-long'
dataset = 'stdlib'  # byte-level; bring your own corpus with data/hf/prepare.py (Qwen's tokenizer.json)
eval_interval = 50
eval_iters = 2
log_interval = 1

# Qwen2.5-7B (init_from='path/to/Qwen2.5-7B' loads the real weights, with its own tokenizer)
n_layer = 28
n_head = 28
n_kv_head = 4
n_embd = 3584
head_dim = 128
attention_bias = True  # Qwen2: biases on q, k and v
intermediate_size = 18944
vocab_size = 152064
rope_theta = 1000000.0
norm_eps = 1e-6

seq_len = 6291456  # issue 52's longest by dry run in steps of 65,536 (7,143,424 fits now: the header's end)
batch_size = 1
gradient_accumulation_steps = 1

cp_size = 8           # the ring: 786,432 tokens per GPU, every head (Ulysses can't split 28 heads 8 ways)
cp_impl = 'ring'

zero = 3              # FSDP2 (parallel.shard_states) over the 8 cp ranks
offload_states = True # fp32 weights, gradients and AdamW's moments in host memory; AdamW steps on the CPU
mlp_chunks = 0        # automatic: ceil(3I / h) = 16 mini-sequences (chunked.py)
loss_chunks = 0       # automatic: ceil(V / h) = 43 chunks of the LM head + loss
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
