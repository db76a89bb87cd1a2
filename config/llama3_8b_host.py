# Llama-3-8B's shape at 524,288 tokens on ONE 80 GB GPU, the model states in host memory (ALST, Bekman et al.
# 2025: 500K tokens for Llama-3.1-8B on one H100):
#   python train.py config/llama3_8b_host.py
# Check the fit on a laptop first (memory.py's dry run on fake tensors, no GPU needed; 15 seconds on 2 cores):
#   python train.py config/llama3_8b_host.py --dry_run=True
#
# The budget, line by line (P = 8.03e9 parameters, S = 524,288 tokens, h = 4096, 32 layers; dry run, 2026-11-26):
# - model states: none stay on the GPU. zero = 3 with offload_states = True runs FSDP2 (parallel.shard_states)
#   over this one rank with CPUOffloadPolicy: the fp32 weights (the masters), the fp32 gradients and AdamW's two
#   fp32 moments live in host memory, 16 bytes per parameter = 119.66 GiB; AdamW steps there, on the CPU. Each
#   block's fp32 rows cross PCIe before its forward and again before its backward (cast to bf16 on the GPU), its
#   fp32 gradients back: 3 x 32 GB per step, seconds against minutes of compute at this length.
#   At Megatron's 18 bytes per parameter on the GPU the states alone would be 134.6 GiB.
# - params 1.38 GiB on the GPU (the dry run): what FSDP2 brought in and gathered in bf16, the embedding, the final
#   norm and the LM head for the whole step and one block at a time.
# - activations: recompute = 'full' keeps each block's input only, 4 GiB per block at 524,288 tokens; offload = 1.0
#   sends 30 of them to host memory (120 GiB), the last 2 stay on the GPU.
# - transient: one block's recompute and backward (the MLP in 11 mini-sequences, RMSNorm and RoPE in fp32 chunks),
#   the LM head + loss in 32 chunks. The dry run files what a recompute rebuilds under activations: activations
#   and transient together are 45.10 GiB at the peak, block 31's backward (the estimate: 44.56).
# - workspace 16.06 GiB: flash attention's backward (its fp32 dq accumulator; dk and dv expanded to 32 heads).
# Dry run: 62.55 GiB (the formula's estimate: 62.99, +0.7%) + 0.60 GiB of CUDA context = 63.15 GiB: 79% of
# 80 GiB, under the 80% rule. It fits. (Until 2026-11-26 the dry run read its peak where the device and the host's
# tensors together were highest, not the device alone: it said 59.37 GiB.)
# Host memory: 239.66 GiB per rank (the dry run, equal to the estimate): 119.66 of model states and 120.00 of
# block inputs. A machine with 256 GiB of RAM is too tight for that and the OS; pinned memory can be rounded up
# per tensor (REFERENCES: up to ~2x), so plan on 384 GiB or more.
# Longest that fits by dry run, in steps of 8,192: 524,288 tokens, this one (532,480: 63.47 + 0.60 GiB does not).
out_dir = 'out-llama3-8b-host'
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

seq_len = 860160
batch_size = 1
gradient_accumulation_steps = 1

zero = 3              # FSDP2 (parallel.shard_states), here over one rank: what streams the weights in
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
