# Llama-2-7B's shape at a 1M-token context (1,048,576) on one node of 8 x 80 GB GPUs (H100 / A100 / A800):
#   torchrun --nproc_per_node=8 train.py config/llama7b_long.py
# Check the fit on a laptop first (memory.py's dry run: rank 0 of 8 on fake tensors, no GPU needed):
#   python train.py config/llama7b_long.py --dry_run=True
#
# The layout, and why (per rank; P = 6.74e9 parameters, S = 1,048,576 tokens, h = 4096, 32 layers):
# - tp_size = 4 (Megatron tensor + sequence parallelism over NVLink): model states are 18 bytes per
#   parameter (bf16 weights, fp32 grads, fp32 master + Adam m, v); tp = 4 leaves 18·P/4 = 30 GB, and
#   zero = 2 (FSDP2) splits the fp32 rows (weights, the masters; gradients; Adam m, v) over the 2 cp ranks,
#   16/2 bytes per parameter: 12.56 GiB, plus every block gathered in bf16 from its forward to its backward
#   (3.08 GiB). 7B can't be replicated: tp = 1 keeps 18·P = 121 GB of states on every rank.
# - cp_size = 2 with Ulysses (cp_impl = 'ulysses': an all-to-all turns sequence shards into head
#   shards around attention; 32 heads / tp 4 = 8 per rank, divisible by cp): each rank holds S/2 tokens,
#   so the whole-sequence tensors of sequence parallelism (the all-gathered input of the column-parallel
#   matmuls, the row-parallel outputs before their reduce-scatter) are S/2 · h, 4 GiB in bf16 each.
#   tp = 8, cp = 1 makes them S · h (8 GiB each).
# - recompute = 'full' keeps one bf16 tensor per layer, the block input on its shard: S/(cp·tp) · h ·
#   2 bytes = 1 GiB per layer, 32 GiB for 32 layers; offload = 1.0 (offload.py, Memo) sends it to host
#   memory while the next layer computes and brings it back one layer ahead of backward: 30 GiB of host
#   memory per rank (240 GiB for the node), the last 2 layers stay on the GPU. A layer's forward at S/8
#   tokens per rank takes far longer than its 1 GiB copy over PCIe (~40 ms at 25 GB/s): it hides.
# - the transient working set is one recomputed block in backward at S/2 tokens: the all-gathered input
#   and the row-parallel partial sums (4 GiB each), q, k, v for 8 heads, the MLP in mini-sequences and
#   the loss in vocabulary-parallel chunks (chunked.py, automatic).
# The dry run (memory.py, rank 0 of 8, CPU kernels standing in for CUDA's; 2026-11-24, zero = 2):
# params 6.22, grads 3.14, optimizer 6.28 GiB, activations and transient 27.25 GiB (peak in block 31's backward):
# 42.87 GiB on fake tensors, + 4.02 GiB of flash attention's workspace (the formula's: 4 heads of the whole
# sequence) = 46.89 GiB (the estimate's formula: 46.24, -1.4%) + 2.60 GiB overhead = 49.49 GiB, under 80%
# of 80 GiB: it fits (zero = 1 was 49.97 GiB).
# 512K tokens without offload: --seq_len=524288 --tp_size=8 --cp_size=1 --offload=0 (check it with --dry_run=True).
out_dir = 'out-llama7b-long'
dataset = 'stdlib'  # byte-level; bring your own corpus with data/hf/prepare.py (Llama-2's 32,000-token vocabulary)
eval_interval = 50
eval_iters = 2
log_interval = 1

# Llama-2-7B
n_layer = 32
n_head = 32
n_kv_head = 32
n_embd = 4096
intermediate_size = 11008
vocab_size = 32000
rope_theta = 10000.0
norm_eps = 1e-5

seq_len = 1048576
batch_size = 1
gradient_accumulation_steps = 4  # 4M tokens per step

tp_size = 4
cp_size = 2
cp_impl = 'ulysses'
zero = 2          # FSDP2 over the 2 cp ranks: half of every fp32 row (weights, gradients, AdamW's moments)

mlp_chunks = 0    # automatic: ceil(3I / h) mini-sequences
loss_chunks = 0   # automatic: ceil(V / h) chunks, vocabulary-parallel over the 4 tp ranks
recompute = 'full'
offload = 1.0    # every block input to host memory (Memo's alpha; with 'full' only the input is kept)

learning_rate = 3e-4
min_lr = 3e-5
warmup_iters = 20
max_iters = 1000
weight_decay = 0.1
beta1 = 0.9
beta2 = 0.95
grad_clip = 1.0
dtype = 'bfloat16'
device = 'cuda'
