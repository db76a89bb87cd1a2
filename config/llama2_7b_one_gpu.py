# Llama-2-7B's shape at 131,072 tokens on ONE 80 GB GPU (the Mini-Sequence Transformer reached 84K):
#   python train.py config/llama2_7b_one_gpu.py
# Check the fit on a laptop first (memory.py's dry run on fake tensors, no GPU needed):
#   python train.py config/llama2_7b_one_gpu.py --dry_run=True
# (Llama-3-8B's shape at the same length: config/llama3_8b_one_gpu.py.)
#
# DRY_RUN_HEADER
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
grad_clip = 0.0               # no step-wide gradient to clip (optim.py)
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
