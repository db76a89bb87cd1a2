# The laptop default: a 0.9M-parameter Llama learns to write Python, byte by byte, from the source of
# Python's own standard library (data/stdlib, prepared on first use). A few minutes on a 2-core CPU.
#   python train.py config/train_tiny.py
#   python sample.py --out_dir=out-tiny --start="def "
out_dir = 'out-tiny'
dataset = 'stdlib'
eval_interval = 100
eval_iters = 20
log_interval = 10

# 4 layers of width 128; n_head and n_kv_head divisible by 4 so every 2- and 4-rank layout runs it
n_layer = 4
n_head = 4
n_kv_head = 4
n_embd = 128
intermediate_size = 384
batch_size = 16
seq_len = 256
gradient_accumulation_steps = 1

learning_rate = 2e-3  # a small model tolerates a high learning rate
max_iters = 1000
warmup_iters = 50
min_lr = 2e-4
beta2 = 0.99
device = 'auto'
