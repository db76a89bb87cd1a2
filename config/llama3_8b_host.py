# Llama-3-8B's shape at 901,120 tokens on ONE 80 GB GPU, the model states in host memory, attention one head group
# at a time (ALST, Bekman et al. 2025: 500K tokens for Llama-3.1-8B on one H100; its recipe for one H200: 1.2M):
#   python train.py config/llama3_8b_host.py
# Check the fit on a laptop first (memory.py's dry run on fake tensors, no GPU needed; 30 seconds on 2 cores):
#   python train.py config/llama3_8b_host.py --dry_run=True
# On one 141 GB H200: 1,556,480 tokens fit without the 128 loss chunks (111.31 + 0.60 GiB by dry run), and more with
# them, 1,638,400 (111.39 + 0.60; 1,654,784: 112.46 + 0.60 does not):
#   python train.py config/llama3_8b_host.py --dry_run=True --memory_budget_gb=141 --seq_len=1638400
#
# The budget, line by line (P = 8.03e9 parameters, S = 901,120 tokens, h = 4096, 32 layers; dry run, 2026-11-27):
# - model states: none stay on the GPU. zero = 3 with offload_states = True runs FSDP2 (parallel.shard_states)
#   over this one rank with CPUOffloadPolicy: the fp32 weights (the masters), the fp32 gradients and AdamW's two
#   fp32 moments live in host memory, 16 bytes per parameter = 119.66 GiB; AdamW steps there, on the CPU. Each
#   block's fp32 rows cross PCIe before its forward and again before its backward (cast to bf16 on the GPU), its
#   fp32 gradients back: 3 x 32 GB per step, seconds against minutes of compute at this length.
#   At Megatron's 18 bytes per parameter on the GPU the states alone would be 134.6 GiB.
# - params 1.38 GiB on the GPU (the dry run): what FSDP2 brought in and gathered in bf16, the embedding, the final
#   norm and the LM head for the whole step and one block at a time.
# - activations: recompute = 'full' keeps each block's input only, 6.88 GiB per block at 901,120 tokens; offload =
#   1.0 sends 30 of them to host memory (206 GiB), the last 2 stay on the GPU.
# - attention_chunks = 0: 8 head groups (a kv head and its 4 query heads), one at a time: q, k, v, the output and
#   flash attention's workspace an eighth of all heads' (chunked.py); each group's forward runs again in backward.
# - loss_chunks = 128: the LM head + loss in 128 chunks, 4x the automatic count. With 32 the LM head's moment set
#   the peak (its fp32 chunk of logits, 28,160 x 128,256, 13.45 GiB: --dry_run_anatomy); with 128 it is a quarter.
# - transient: one block's recompute and backward (the MLP in 11 mini-sequences, RMSNorm and RoPE in fp32 chunks,
#   one head group's attention). The dry run files what a recompute rebuilds under activations: activations and
#   transient together are 58.27 GiB at the peak, block 31's backward (the estimate: 57.61).
# - workspace 3.45 GiB: flash attention's backward on one group of 4 heads (its fp32 dq accumulator; the kv head
#   expanded to 4 query heads).
# Dry run: 63.11 GiB (the formula's estimate: 63.42, +0.5%) + 0.60 GiB of CUDA context = 63.71 GiB: 79.6% of
# 80 GiB, under the 80% rule. It fits; 909,312 tokens (63.65 + 0.60 GiB) do not: the longest in steps of 8,192.
# Host memory: 325.91 GiB per rank (the dry run, equal to the estimate): 119.66 of model states and 206.25 of
# block inputs. Pinned memory can be rounded up per tensor (up to about 2x), so plan on 512 GiB of RAM.
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

seq_len = 901120
batch_size = 1
gradient_accumulation_steps = 1

zero = 3              # FSDP2 (parallel.shard_states), here over one rank: what streams the weights in
offload_states = True # fp32 weights, gradients and AdamW's moments in host memory; AdamW steps on the CPU
mlp_chunks = 0        # automatic: ceil(3I / h) = 11 mini-sequences (chunked.py)
loss_chunks = 128     # 4x the automatic 32: the LM head's fp32 chunk of logits set the peak (--dry_run_anatomy)
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
