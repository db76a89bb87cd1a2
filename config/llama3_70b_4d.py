# Llama-3-70B's shape at 131,072 tokens per sequence on 64 x 80 GB GPUs (8 nodes of 8), in all four dimensions:
#   torchrun --nnodes=8 --nproc_per_node=8 --rdzv_backend=c10d --rdzv_endpoint=node0:29500 --rdzv_id=run70 \
#       train.py config/llama3_70b_4d.py
# Check the fit on a laptop first (memory.py's dry run on fake tensors, no GPU: rank 0's stage, then the last
# stage's in a second process; 35 seconds on 2 cores). WORLD_SIZE gives the 64 ranks: without it a dry run stands
# for tp x cp x pp = 32 (dp 1), where FSDP2 shards over half as many ranks and rank 0 does not fit (71.77 GiB):
#   WORLD_SIZE=64 python train.py config/llama3_70b_4d.py --dry_run=True
#
# The layout, rank = ((dp·4 + pp)·2 + cp)·4 + tp: a node's 8 GPUs are tp 4 x cp 2, the 8 nodes pp 4 x dp 2.
# - tp = 4 and cp = 2 (Ulysses) inside a node: their collectives run in every block (4 of whole activations for tp
#   with sp, 2 all-to-alls of 16 heads for cp), so they stay on NVLink. Each GPU holds S/8 = 16,384 of the tokens
#   between the matmuls and 64/4/2 = 8 heads of the whole sequence in attention.
# - pp = 4 across nodes: 20 of the 80 blocks per stage (the embedding on the first, final norm and LM head + loss on
#   the last); between stages only a micro-batch's activations, 16,384 x 8192 in bf16 = 256 MiB per GPU, and their
#   gradient back, point to point. It divides the model states by 4 with no collective inside a layer.
# - dp = 2 across nodes, with zero = 2 (FSDP2) over the d = dp x cp = 4 ranks holding the same weights: 16 bytes per
#   parameter / 4, plus the stage's 20 blocks gathered in bf16 from forward to backward. zero = 3 gathers each block
#   twice and saves 7.57 GiB (estimate: 46.77 GiB on rank 0): room this layout doesn't need.
# - gradient_accumulation_steps = 16 micro-batches of one sequence: 1F1B needs >= 4; the bubble is (4 - 1)/(16 + 4 - 1)
#   = 16% of a step; the global batch is 16 x 2 x 131,072 = 4,194,304 tokens.
# Rank 0's budget (the first stage: the most in flight), line by line (P = 70.55e9 parameters; dry run, 2026-11-24):
# - params 12.29 GiB: 4.54e9 parameters on this rank (20 blocks and the embedding, / tp 4): their fp32 rows / 4
#   (4.23 GiB, the masters) and the stage gathered in bf16 (8.46 GiB). grads 4.23, optimizer (AdamW's m, v) 8.46.
# - activations 24.07 GiB: recompute = 'full' keeps each block's input, 256 MiB; 1F1B keeps 4 micro-batches in flight
#   on the first stage: 80 block inputs, as many as one rank without pp keeps for one micro-batch.
# - transient 4.30 GiB (one block's recompute and backward, the MLP in 11 mini-sequences) and workspace 1.50 GiB
#   (flash attention's backward on 8 heads of 131,072 tokens).
# Dry run: 54.86 GiB (the formula's estimate: 54.34) + 3.60 GiB of CUDA context and NCCL buffers = 58.46 GiB, under
# 80% of 80 GiB (64 GiB): it fits. The last stage (rank 63: blocks 60-79, the LM head and loss in 16 chunks) holds one
# micro-batch in flight: 39.40 GiB (estimate 38.15) + 3.60.
# Why not GPipe: every stage keeps all 16 micro-batches, 118.09 GiB on rank 0 and 151.27 on the last (estimates).
# Why pp at all, when tp 8 x cp 2 x dp 4 with zero = 3 holds rank 0 at 33.04 GiB (estimate): its FSDP2 gathers each
# block twice (bf16) and reduce-scatters its gradients (fp32) over ranks on other nodes, (2 + 2 + 4) x P / 8 bytes =
# 66 GiB per GPU per micro-batch; here FSDP2 moves (2 + 4) x P / 16 = 25 GiB (half of its ranks on the node) and pp
# 256 MiB each way. Pipeline parallelism cuts the states, not the activations: the length comes from cp and tp.
# Packed documents (doc_mask = True), as Llama 3 trained its long context: every layout takes them, here tp, Ulysses
# and pp at once. Each micro-batch's documents ride through torch's pipeline schedule with its tokens; Ulysses gives
# each rank whole documents of its 8 heads; on CUDA a window's documents are one varlen flash call per block. The
# dry run is the same with and without (varlen saves what flash saves): 54.85 GiB on rank 0, 39.40 on rank 63
# (WORLD_SIZE=64 python train.py config/llama3_70b_4d.py --dry_run=True, 2026-11-27).
out_dir = 'out-llama3-70b-4d'
dataset = 'stdlib'  # byte-level; bring your own corpus with data/hf/prepare.py (Llama 3's tokenizer)
eval_interval = 50
eval_iters = 2
log_interval = 1

# Llama-3-70B (init_from='path/to/Meta-Llama-3-70B' loads the real weights, with its own tokenizer)
n_layer = 80
n_head = 64
n_kv_head = 8
n_embd = 8192
intermediate_size = 28672
vocab_size = 128256
rope_theta = 500000.0
norm_eps = 1e-5

seq_len = 131072
doc_mask = True       # each document attends to itself (the dataset's *.docs.npy); positions restart at each
batch_size = 1
gradient_accumulation_steps = 16  # micro-batches: the pipeline's

tp_size = 4           # inside a node, with sequence parallelism
cp_size = 2           # inside a node: Ulysses, 8 heads of the whole sequence per GPU in attention
cp_impl = 'ulysses'
pp_size = 4           # across nodes: 20 blocks per stage
pp_schedule = '1f1b'  # 4, 3, 2, 1 micro-batches in flight on stages 0..3

zero = 2              # FSDP2 over dp x cp = 4 ranks per stage and tp shard
mlp_chunks = 0        # automatic: ceil(3I / h) mini-sequences (chunked.py)
loss_chunks = 0       # automatic: ceil(V / h) chunks of the LM head + loss
recompute = 'full'

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
