# Llama-3-8B's shape at 221,184 tokens on ONE 24 GB consumer GPU (an RTX 4090, an L4), a full fine-tune: the model
# states and every block input but the last two in host memory, attention one head group at a time. (The long
# contexts quoted for single cards are mostly QLoRA: frozen 4-bit weights, a few adapters trained.)
#   python train.py config/llama3_8b_24gb.py
# Check the fit on a laptop first (memory.py's dry run on fake tensors, no GPU needed; 20 seconds on 2 cores):
#   python train.py config/llama3_8b_24gb.py --dry_run=True
#
# The budget, line by line (P = 8.03e9 parameters, S = 221,184 tokens, h = 4096, 32 layers; dry run, 2026-11-27):
# - model states: none stay on the GPU (zero = 3 with offload_states = True: FSDP2 over this one rank with
#   CPUOffloadPolicy; 16 bytes per parameter = 119.66 GiB in host memory, AdamW on the CPU). params 1.38 GiB on the
#   GPU: the embedding, final norm and LM head gathered in bf16 for the whole step, and one block at a time.
# - activations: recompute = 'full' keeps each block's input, 1.69 GiB each; offload = 1.0 sends 30 of them to host
#   memory (50.6 GiB).
# - attention_chunks = 0: 8 head groups (a kv head and its 4 query heads), one at a time (chunked.py);
#   loss_chunks = 128: the LM head's fp32 chunk of logits a quarter of the automatic count's.
# - activations + transient 16.36 GiB at the peak (block 31's backward; the estimate: 15.47), workspace 0.85 GiB
#   (flash attention's backward on one group of 4 heads).
# Dry run: 18.59 GiB (the formula's estimate: 18.67, +0.4%) + 0.60 GiB of CUDA context = 19.19 GiB of the 80% rule's
# 19.20: it fits, just; 229,376 tokens (19.13 + 0.60 GiB) do not: the longest in steps of 8,192.
# Host memory: 170.29 GiB (the dry run, equal to the estimate): 119.66 of model states, 50.63 of block inputs. A
# desktop with 256 GiB of RAM (pinned memory can be rounded up per tensor: keep headroom). The GPU waits on PCIe:
# each block's fp32 rows cross it twice a step and its gradients once (3 x 32 GB), and 30 block inputs each way.
# memory_budget_gb = 24.0 below makes the dry run (and a real run's check) count a 24 GB card.
out_dir = 'out-llama3-8b-24gb'
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

seq_len = 221184
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
memory_budget_gb = 24.0  # an RTX 4090 or L4 (the dry run's device)
