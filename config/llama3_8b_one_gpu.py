# Llama-3-8B's shape at 131,072 tokens (the 128K context Llama 3.1 was extended to) on ONE 80 GB GPU:
#   python train.py config/llama3_8b_one_gpu.py
# Check the fit on a laptop first (memory.py's dry run on fake tensors, no GPU needed):
#   python train.py config/llama3_8b_one_gpu.py --dry_run=True
# (Llama-2-7B's shape at the same length: config/llama2_7b_one_gpu.py.)
#
# The budget, per the dry run (memory.py on fake tensors, CPU kernels standing in for CUDA's; 2026-11-23):
# - weights 14.96 GiB: 8.03e9 parameters in bf16, 2 bytes each.
# - optimizer 29.92 GiB: AdamW's two moments in bf16, 4 bytes per parameter. optimizer_in_backward=True (optim.py)
#   steps each parameter inside backward as soon as its gradient is whole and frees it: no fp32 gradients (4
#   bytes), no fp32 master weights (4) and fp32 moments (8): 6 bytes per parameter instead of 18 (134.6 GiB).
# - activations: recompute='full' keeps each block's input only, 1 GiB per block at 131K tokens, and offload=1.0
#   sends it to host memory (30 GiB of host memory; the last 2 blocks stay on the GPU).
# - transient: one block's recompute and backward (memory.py's header: the MLP's backward in 11 mini-sequences,
#   RMSNorm and RoPE in fp32 chunks), the LM head + loss in 32 chunks of fp32 logits; one parameter's
#   gradient at a time and its step's fp32 chunks.
# - workspace 4.02 GiB: flash attention's backward (fp32 dq accumulator, dk and dv expanded to 32 heads).
# Dry run: activations + transient 11.39 GiB at its peak (block 31's backward), 60.28 GiB in all (the formula's
# estimate: 62.69, +4.0%) + 0.60 GiB of CUDA context = 60.88 GiB: 76% of 80 GiB, under the 80% rule. It fits.
# Longest that fits by dry run (bench/RESULTS.md): 158,720 tokens; without offload 48,128.
out_dir = 'out-llama3-8b-one-gpu'
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

seq_len = 131072
batch_size = 1
gradient_accumulation_steps = 1  # the step in backward can't accumulate: 131K tokens per step

optimizer_in_backward = True  # optim.py: bf16 weights and AdamW moments, stochastic rounding, 6 bytes/parameter
grad_clip = 1.0               # per tensor: each clipped to its share of 1.0 (optim.py)
mlp_chunks = 0    # automatic: ceil(3I / h) = 11 mini-sequences (chunked.py)
loss_chunks = 0   # automatic: ceil(V / h) = 32 chunks of the LM head + loss
recompute = 'full'
offload = 1.0     # every block input to host memory (Memo's alpha; with 'full' only the input is kept)

learning_rate = 1e-5  # continued pre-training of a trained model at long context
min_lr = 1e-6
warmup_iters = 20
max_iters = 1000
weight_decay = 0.1
beta1 = 0.9
beta2 = 0.95
dtype = 'bfloat16'
device = 'cuda'
