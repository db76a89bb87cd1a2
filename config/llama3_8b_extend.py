# Extend Llama-3-8B from its 8K context to 128K tokens (131,072) on one node of 8 x 80 GB GPUs, on your own
# long documents, packed with a per-document attention mask, the RoPE frequencies scaled as Llama 3.1's were:
#   python data/hf/prepare.py --data_files=my_docs.jsonl --tokenizer=path/to/Meta-Llama-3-8B --out_dir=data/mydocs
#   torchrun --nproc_per_node=8 train.py config/llama3_8b_extend.py --init_from=path/to/Meta-Llama-3-8B
#   python checkpoint.py export out-llama3-8b-extend path/to/Llama-3-8B-128K   # transformers loads it back
# Check the fit on a laptop first (memory.py's dry run: rank 0 of 8 on fake tensors, no GPU and no weights
# needed: it reads init_from's config.json where the directory exists, else the shape below; 15 seconds on 2 cores):
#   python train.py config/llama3_8b_extend.py --dry_run=True
#
# The layout, and why (per rank; P = 8.03e9 parameters, S = 131,072 tokens, h = 4096, 32 layers, 8 kv heads):
# - tp_size = 4 (tensor + sequence parallelism over NVLink) and cp_size = 2 (Ulysses: 32 heads / tp 4 = 8 per
#   rank, divisible by 2; 8 kv heads / 4 = 2 per rank, split over cp): a quarter of the parameters per rank, and
#   zero = 2 (FSDP2) splits their fp32 rows (weights, the masters; gradients; Adam m, v) over the 2 cp ranks:
#   16/2 bytes per parameter, 14.96 GiB, plus every block gathered in bf16 from forward to backward (3.49 GiB);
#   Megatron's 18 bytes per parameter, replicated (tp 1), would be 134.6 GiB.
# - recompute = 'selective': each block keeps its input and attention's output (S/8 tokens each per rank,
#   128 MiB each in bf16) and recomputes the MLP and the projections in backward, not attention. No offload:
#   at 128K there is room, and offload's copies are not free (offload.py).
# - doc_mask = True: attention stays inside each document and positions restart at each (one SDPA call per
#   document: flash on CUDA, no S x S mask); Ulysses sees whole documents, ring attention would not.
# - rope_scaling: Llama 3.1's recipe (factor 8 over the original 8,192 positions, high frequencies kept);
#   exported into config.json. A larger rope_theta alone, 'linear' or 'yarn' are the alternatives (README).
# The dry run (memory.py, rank 0 of 8, CPU kernels standing in for CUDA's; 2026-11-24, zero = 2):
# params 7.23, grads 3.82, optimizer 7.48, activations 9.18, transient 2.49 GiB (peak in block 31's backward):
# 30.22 GiB on fake tensors, + 0.75 GiB of flash attention's workspace (the formula's) = 30.97 GiB (the estimate's
# formula: 31.01) + 2.60 GiB overhead = 33.57 GiB, under 80% of 80 GiB: it fits (zero = 1 was 34.38 GiB).
# One 80 GB GPU at 18 bytes per parameter: no length fits. The states alone are 134.6 GiB (params 14.96, grads
# 29.92, optimizer 89.75 GiB); at 8K tokens the dry run is 140.06 GiB + 0.6 overhead against 64 GiB (with 6 bytes
# per parameter, optimizer_in_backward, 128K fits one GPU: config/llama3_8b_one_gpu.py):
#   python train.py config/llama3_8b_extend.py --dry_run=True --init_from=scratch --tp_size=1 --cp_size=1 \
#       --zero=0 --seq_len=8192 --recompute=full
out_dir = 'out-llama3-8b-extend'
init_from = 'path/to/Meta-Llama-3-8B'  # a local Hugging Face directory (config.json, safetensors, tokenizer.json)
dataset = 'mydocs'  # prepared with the checkpoint's own tokenizer: data/hf/prepare.py --tokenizer=<init_from>
doc_mask = True
eval_interval = 50
eval_iters = 2
log_interval = 1

# Llama-3-8B's shape (read from init_from's config.json when it loads; used as is by the dry run)
n_layer = 32
n_head = 32
n_kv_head = 8
n_embd = 4096
intermediate_size = 14336
vocab_size = 128256
rope_theta = 500000.0
norm_eps = 1e-5
rope_scaling = {'rope_type': 'llama3', 'factor': 8.0, 'low_freq_factor': 1.0, 'high_freq_factor': 4.0,
                'original_max_position_embeddings': 8192}

seq_len = 131072
batch_size = 1
gradient_accumulation_steps = 8  # 1M tokens per step

tp_size = 4
cp_size = 2
cp_impl = 'ulysses'
zero = 2          # FSDP2 over the 2 cp ranks: half of every fp32 row (weights, gradients, Adam m, v)

mlp_chunks = 0    # automatic: ceil(3I / h) mini-sequences
loss_chunks = 0   # automatic: ceil(V / h) chunks, vocabulary-parallel over the 4 tp ranks
recompute = 'selective'
offload = 0.0

learning_rate = 2e-5  # fine-tuning: a small step from the checkpoint's weights
min_lr = 2e-6
warmup_iters = 20
max_iters = 500
weight_decay = 0.1
beta1 = 0.9
beta2 = 0.95
grad_clip = 1.0
dtype = 'bfloat16'
device = 'cuda'
