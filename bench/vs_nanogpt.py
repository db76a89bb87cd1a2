"""
nanolong's training step against nanoGPT's at nanoGPT's CPU recipe (issue 2): char-level text, 4 layers,
4 heads, width 128, batch 12, seq_len 64, no dropout, AdamW lr 1e-3, beta2 0.99, weight decay 0.1, clip 1.

  nanoGPT   its GPT-2 block (copied below: LayerNorm without bias, GELU MLP 4x, learned positions,
            tied embeddings; 809,984 parameters) and its loop: a batch from a fresh memmap, forward,
            backward, clip, AdamW as nanoGPT configures it on a CPU (not fused), zero_grad, loss.item()
  nanolong  model.Llama (RoPE, SwiGLU with intermediate 344, RMSNorm, tied embeddings; 805,888
            parameters) through train.py's own get_batch, forward_backward and make_optimizer (fused
            AdamW), then clip, step, zero_grad, loss.item()

--hf=True adds a third: transformers' LlamaForCausalLM (SDPA) on our Llama's weights, in nanoGPT's
loop (its own loss from labels, torch's AdamW, clip): HF's step over nanoGPT's is what the Llama
block costs in a plain implementation, ours over HF's is what nanolong's code adds or saves.

The steps alternate, one each, and each one's time is summed: a shared VM's speed drifts by tens of
percent over minutes, and alternating single steps puts both under the same drift. --compile=both
compiles both models (nanoGPT's default; its CPU recipe turns it off), --compile=nanolong ours only (our
train.py with --compile=True against nanoGPT's CPU recipe as its README gives it). Prints ms per step and
tokens/s.

    python data/char/prepare.py input.txt --out_dir=data/mychar
    python bench/vs_nanogpt.py --dataset=mychar [--compile=both|nanolong] [--steps=300]
"""
import math
import os
import sys
import time
from contextlib import nullcontext

import numpy as np
import torch
import torch.nn as nn
import torch.nn.functional as F

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
from configurator import check, configure, die  # noqa: E402

# -----------------------------------------------------------------------------
dataset = 'char'   # a folder of data/ (or any path) with train.bin, val.bin, meta.json
steps = 300        # timed steps of each trainer
warmup = 10        # untimed steps of each first (with compile=True, the compilation)
compile = 'none'   # 'none' | 'both' | 'nanolong'
hf = False         # also time transformers' LlamaForCausalLM on our weights (not compiled)
threads = 0        # torch.set_num_threads; 0 = torch's default
seed = 1337
# -----------------------------------------------------------------------------
configure(globals())
B, S, LAYERS, HEADS, WIDTH = 12, 64, 4, 4, 128
data_dir = os.path.join(ROOT, 'data', dataset)  # an absolute path stays as it is
# what each key allows, checked before any model is built (a bad value would be a traceback, or
# a run of no steps): configurator.check's rows (keys, what they allow, the check of one value),
# the dataset last: a mistake in a number is named even where no data is prepared yet
RULES = [
    ('compile', "must be 'none', 'both' or 'nanolong'",
     lambda v: v in ('none', 'both', 'nanolong')),
    ('steps', 'must be >= 1', lambda v: v >= 1),
    ('warmup threads', 'must be >= 0', lambda v: v >= 0),
    # torch's generators take 64 bits, and no sign
    ('seed', 'must be in [0, 2**63)', lambda v: 0 <= v < 2 ** 63),
    ('dataset', 'not prepared (no meta.json): run python data/char/prepare.py input.txt '
     f'--out_dir={data_dir}', lambda v: os.path.isfile(os.path.join(data_dir, 'meta.json')))]
check(globals(), RULES)
# (imported after the table: a refused key is said without the seconds train.py's import takes)
import optim  # noqa: E402
import train  # noqa: E402
import chunked  # noqa: E402
from knobs import Knobs  # noqa: E402
from model import Llama, LlamaConfig  # noqa: E402
from data.tokenizer import read_meta  # noqa: E402
try:
    # meta.json against its .bin files, and enough tokens for a batch's windows (as train.py's)
    meta = {**read_meta(data_dir, S + 2), 'dir': data_dir}
except ValueError as e:
    die(f"dataset={dataset!r}: {e}")
if threads:
    torch.set_num_threads(threads)
V = meta['vocab_size']
torch.manual_seed(seed)


class GPTBlock(nn.Module):  # nanoGPT's Block with bias=False, dropout=0
    def __init__(self, h, n_head):
        super().__init__()
        self.ln_1, self.ln_2, self.n_head = nn.LayerNorm(h, bias=False), nn.LayerNorm(h, bias=False), n_head
        self.c_attn, self.c_proj = nn.Linear(h, 3 * h, bias=False), nn.Linear(h, h, bias=False)
        self.c_fc, self.mlp_proj = nn.Linear(h, 4 * h, bias=False), nn.Linear(4 * h, h, bias=False)

    def forward(self, x):
        b, t, c = x.shape
        q, k, v = self.c_attn(self.ln_1(x)).split(c, 2)
        q, k, v = (z.view(b, t, self.n_head, c // self.n_head).transpose(1, 2) for z in (q, k, v))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True).transpose(1, 2).reshape(b, t, c)
        x = x + self.c_proj(y)
        return x + self.mlp_proj(F.gelu(self.c_fc(self.ln_2(x))))


class GPT(nn.Module):  # nanoGPT's GPT: learned positions, tied embeddings, N(0, 0.02) init
    def __init__(self):
        super().__init__()
        self.wte, self.wpe = nn.Embedding(V, WIDTH), nn.Embedding(S, WIDTH)
        self.h = nn.ModuleList(GPTBlock(WIDTH, HEADS) for _ in range(LAYERS))
        self.ln_f, self.lm_head = nn.LayerNorm(WIDTH, bias=False), nn.Linear(WIDTH, V, bias=False)
        self.wte.weight = self.lm_head.weight
        for m in self.modules():
            if isinstance(m, (nn.Linear, nn.Embedding)):
                nn.init.normal_(m.weight, 0.0, 0.02)
        for name, p in self.named_parameters():
            if name.endswith('c_proj.weight') or name.endswith('mlp_proj.weight'):
                nn.init.normal_(p, 0.0, 0.02 / math.sqrt(2 * LAYERS))

    def forward(self, idx, targets):
        x = self.wte(idx) + self.wpe(torch.arange(idx.shape[1]))
        for block in self.h:
            x = block(x)
        return F.cross_entropy(self.lm_head(self.ln_f(x)).flatten(0, 1), targets.flatten())


gpt = GPT()
gpt_run = torch.compile(gpt) if compile == 'both' else gpt
decay = [p for p in gpt.parameters() if p.dim() >= 2]
no_decay = [p for p in gpt.parameters() if p.dim() < 2]
gpt_opt = torch.optim.AdamW([{'params': decay, 'weight_decay': 0.1}, {'params': no_decay, 'weight_decay': 0.0}],
                            lr=1e-3, betas=(0.9, 0.99))


def nanogpt_step():
    data = np.memmap(os.path.join(data_dir, 'train.bin'), dtype=meta['dtype'], mode='r')
    ix = torch.randint(len(data) - S, (B,))
    x = torch.stack([torch.from_numpy(data[i:i + S].astype(np.int64)) for i in ix])
    y = torch.stack([torch.from_numpy(data[i + 1:i + 1 + S].astype(np.int64)) for i in ix])
    loss = gpt_run(x, y)
    loss.backward()
    torch.nn.utils.clip_grad_norm_(gpt.parameters(), 1.0)
    gpt_opt.step()
    gpt_opt.zero_grad(set_to_none=True)
    return loss.item()


train.seq_len, train.learning_rate, train.weight_decay, train.beta1, train.beta2, train.zero = S, 1e-3, 0.1, 0.9, 0.99, 0
# chunked.apply: the chunked LM head + loss, as train.py applies it to every run
llama_config = LlamaConfig(n_layer=LAYERS, n_head=HEADS, n_kv_head=HEADS, n_embd=WIDTH,
                           intermediate_size=344, vocab_size=V, tie_embeddings=True)
llama = chunked.apply(Llama(llama_config), Knobs(**vars(llama_config)))
llama_run = torch.compile(llama) if compile != 'none' else llama
masters = optim.make_master_weights(llama)
llama_opt = train.make_optimizer(llama, masters, 'cpu')
gen = torch.Generator().manual_seed(seed)
cpu = torch.device('cpu')


def nanolong_step():
    batch = train.get_batch(meta, 'train', B, gen, cpu)
    loss = train.forward_backward(llama_run, [batch], nullcontext())
    torch.nn.utils.clip_grad_norm_(masters, 1.0)
    llama_opt.step()
    llama_opt.zero_grad(set_to_none=True)
    return loss.item()


trainers = {'nanoGPT, GPT-2 block': nanogpt_step, 'nanolong, Llama': nanolong_step}
if hf:
    import tempfile
    from transformers import LlamaForCausalLM
    with tempfile.TemporaryDirectory() as d:
        llama.save_pretrained(d)
        hf_llama = LlamaForCausalLM.from_pretrained(d, attn_implementation='sdpa', dtype=torch.float32)
    hf_decay = [p for p in hf_llama.parameters() if p.dim() >= 2]
    hf_no_decay = [p for p in hf_llama.parameters() if p.dim() < 2]
    hf_opt = torch.optim.AdamW([{'params': hf_decay, 'weight_decay': 0.1},
                                {'params': hf_no_decay, 'weight_decay': 0.0}],
                               lr=1e-3, betas=(0.9, 0.99), fused=True)

    def hf_step():
        # nanoGPT's loop on the batch our get_batch draws (labels already shifted)
        x, y = train.get_batch(meta, 'train', B, gen, cpu)[:2]
        loss = hf_llama(input_ids=x, labels=y, shift_labels=y.contiguous()).loss
        loss.backward()
        torch.nn.utils.clip_grad_norm_(hf_llama.parameters(), 1.0)
        hf_opt.step()
        hf_opt.zero_grad(set_to_none=True)
        return loss.item()

    trainers['transformers, Llama'] = hf_step
print(f"parameters: nanoGPT {sum(p.numel() for p in gpt.parameters()):,}, "
      f"nanolong {sum(p.numel() for p in llama.parameters()):,}; compile={compile}, "
      f"{torch.get_num_threads()} threads", flush=True)
for _ in range(warmup):
    for run in trainers.values():
        run()
spent = dict.fromkeys(trainers, 0.0)
for _ in range(steps):
    for name, run in trainers.items():
        t0 = time.perf_counter()
        run()
        spent[name] += time.perf_counter() - t0
for name, t in spent.items():
    print(f"{name:22s} {1e3 * t / steps:6.1f} ms/step  {B * S * steps / t:8,.0f} tokens/s")
t_gpt, t_llama = spent['nanoGPT, GPT-2 block'], spent['nanolong, Llama']
print(f"nanolong / nanoGPT step time: {t_llama / t_gpt:.3f}")
if hf:
    t_hf = spent['transformers, Llama']
    print(f"transformers' Llama / nanoGPT: {t_hf / t_gpt:.3f} (the Llama block's work); "
          f"nanolong / transformers' Llama: {t_llama / t_hf:.3f} (ours)")
