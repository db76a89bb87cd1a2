# Llama-2-7B's shape at 131,072 tokens on ONE 80 GB GPU (the Mini-Sequence Transformer reached 84K):
#   python train.py config/llama2_7b_one_gpu.py
# Check the fit on a laptop first (memory.py's dry run on fake tensors, no GPU needed):
#   python train.py config/llama2_7b_one_gpu.py --dry_run=True
# (Llama-3-8B's shape at the same length: config/llama3_8b_one_gpu.py.)
#
# The budget, per the dry run (memory.py on fake tensors, CPU kernels standing in for CUDA's; 2026-11-23):
# - weights 12.55 GiB: 6.74e9 parameters in bf16, 2 bytes each.
# - optimizer 25.10 GiB: AdamW's two moments in bf16, 4 bytes per parameter. optimizer_in_backward=True (optim.py)
#   steps each parameter inside backward as soon as its gradient is whole and frees it: no fp32 gradients (4
#   bytes), no fp32 master weights (4) and fp32 moments (8): 6 bytes per parameter instead of 18 (113 GiB).
# - activations: recompute='full' keeps each block's input only, 1 GiB per block at 131K tokens, and offload=1.0
#   sends it to host memory (30 GiB of host memory; the last 2 blocks stay on the GPU).
# - transient: one block's recompute and backward (memory.py's header: the MLP's backward in 9 mini-sequences,
#   RMSNorm and RoPE in fp32 chunks), the LM head + loss in 8 chunks of fp32 logits; one parameter's gradient
#   at a time and its step's fp32 chunks.
# - workspace 2.02 GiB: flash attention's backward (fp32 dq accumulator; 32 kv heads: nothing to expand).
# Dry run: activations + transient 12.89 GiB at its peak (block 1's backward), 52.56 GiB in all (the formula's
# estimate: 54.37, +3.4%) + 0.60 GiB of CUDA context = 53.16 GiB: 66% of 80 GiB, under the 80% rule. It fits.
# Longest that fits by dry run (bench/RESULTS.md): 234,496 tokens; without offload 72,704 (MST's paper: 84K).
out_dir = 'out-llama2-7b-one-gpu'
dataset = 'stdlib'  # byte-level; bring your own corpus with data/hf/prepare.py (Llama 2's tokenizer)
eval_interval = 50
eval_iters = 2
log_interval = 1

# Llama-2-7B (init_from='path/to/Llama-2-7b-hf' loads the real weights, with its own tokenizer)
n_layer = 32
n_head = 32
n_kv_head = 32
n_embd = 4096
intermediate_size = 11008
vocab_size = 32000
rope_theta = 10000.0
norm_eps = 1e-5

seq_len = 131072
batch_size = 1
gradient_accumulation_steps = 1  # the step in backward can't accumulate: 131K tokens per step

optimizer_in_backward = True  # optim.py: bf16 weights and AdamW moments, stochastic rounding, 6 bytes/parameter
grad_clip = 1.0               # per tensor: each clipped to its share of 1.0 (optim.py)
mlp_chunks = 0    # automatic: ceil(3I / h) = 9 mini-sequences (chunked.py)
loss_chunks = 0   # automatic: ceil(V / h) = 8 chunks of the LM head + loss
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
