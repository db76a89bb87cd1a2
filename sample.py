"""
Generate text from a trained checkpoint (or a Hugging Face directory) with a KV cache:

    python sample.py --out_dir=out-tiny --start="def " --num_samples=2 --max_new_tokens=300
    python sample.py --init_from=path/to/hf_llama --dataset=mydata --start=FILE:prompt.txt

The prompt is encoded with the tokenizer of the dataset the model was trained on (its meta.json;
without --dataset, a Hugging Face directory's tokenizer.json); the whole prompt runs through the
model once (prefill), then one token at a time reads the cached keys and values instead of
recomputing the prefix: O(S) work per new token, not O(S²).
"""

import json
from pathlib import Path

import torch

from configurator import check, configure, die, has_device, pick_device
from data.tokenizer import get_tokenizer
from model import Llama
import checkpoint

# -----------------------------------------------------------------------------
init_from = 'resume'  # 'resume' (out_dir's checkpoint) or a Hugging Face model directory
out_dir = 'out-tiny'
dataset = ''  # whose meta.json holds the tokenizer; '' = the checkpoint's dataset
start = '\n'  # the prompt, or FILE:path to read it from a file
num_samples = 3
max_new_tokens = 300
temperature = 0.8  # < 1 sharpens the distribution, > 1 flattens it
top_k = 50  # sample among the k most likely tokens only; 0 = all
seed = 1337
device = 'auto'  # 'auto' (the first of cuda, mps, cpu this machine has) | 'cpu' | 'cuda' | 'mps'
# -----------------------------------------------------------------------------
RULES = [  # configurator.check's rows: (keys, what they allow, the check of one value)
    ('temperature top_k max_new_tokens', 'must be >= 0', lambda v: v >= 0),
    ('num_samples', 'must be >= 1', lambda v: v >= 1),
    ('device', 'must be a device this machine has', lambda v: has_device(pick_device(v)))]

class KVCache:
    """Keys and values of one layer for sampling, preallocated to max_len: model.Attention.cached
    appends the new tokens' and attends over all of them (the last sliding_window of them in a
    windowed layer)."""

    def __init__(self, batch, n_kv_head, head_dim, max_len, device, dtype):
        self.k = torch.zeros(batch, n_kv_head, max_len, head_dim, device=device, dtype=dtype)
        self.v = torch.zeros_like(self.k)
        self.len = 0

    def update(self, k, v):
        end = self.len + k.shape[2]
        self.k[:, :, self.len:end], self.v[:, :, self.len:end] = k, v
        self.len = end
        return self.k[:, :, :end], self.v[:, :, :end]


@torch.no_grad()
def generate(model, idx, max_new_tokens, temperature=1.0, top_k=0):
    """Continue idx [B, T] by max_new_tokens tokens; returns [B, T + max_new_tokens]."""
    c = model.config
    p = next(model.parameters())
    B, T = idx.shape
    caches = [KVCache(B, c.n_kv_head, c.head_dim, T + max_new_tokens, p.device, p.dtype)
              for _ in range(c.n_layer)]
    out = [idx]
    positions = None  # the first pass: the whole prompt at once (prefill)
    for t in range(T, T + max_new_tokens):
        logits = model(out[-1], positions=positions, kv_caches=caches)[:, -1]
        if temperature == 0:
            nxt = logits.argmax(-1, keepdim=True)
        else:
            logits = logits.float() / temperature
            if top_k:  # (as nanoGPT's)
                v, _ = torch.topk(logits, min(top_k, logits.size(-1)))
                logits[logits < v[:, [-1]]] = -torch.inf
            nxt = torch.multinomial(torch.softmax(logits, -1), 1)
        out.append(nxt)
        positions = torch.tensor([t], device=p.device)  # the next pass: the new token alone
    return torch.cat(out, 1)

def main():
    configure(globals())
    # each mistake one line before the model loads
    check(globals(), RULES)
    prompt = start
    if start.startswith('FILE:'):
        try:
            prompt = Path(start[5:]).read_text(encoding='utf-8')
        except (OSError, UnicodeDecodeError) as e:
            die(f"--start={start}: cannot read it: {getattr(e, 'strerror', None) or e}")
    try:
        prompt.encode('utf-8')
    except UnicodeEncodeError:  # a lone surrogate: bytes the shell could not decode
        die(f"--start={start!r}: not valid text (a lone surrogate)")
    torch.manual_seed(seed)
    name = dataset
    if init_from == 'resume':
        path = checkpoint.latest(out_dir)  # the newest committed one
        if path is None:
            die(f"no checkpoint in {out_dir} (train one first: python train.py)")
        model, ckpt = checkpoint.load_model(path)  # saved by any layout, read whole
        name = name or ckpt['config']['dataset']
    else:
        model = Llama.from_pretrained(init_from)
    # data made by a Hugging Face tokenizer keeps a copy of its tokenizer.json beside meta.json
    if name:
        data_dir = Path(__file__).resolve().parent / 'data' / name
        if not (data_dir / 'meta.json').is_file():
            die(f"dataset={name}: no {data_dir / 'meta.json'} (prepare it: data/{name}/prepare.py)")
        meta = {**json.loads((data_dir / 'meta.json').read_text()), 'dir': data_dir}
    elif Path(init_from, 'tokenizer.json').is_file():
        meta = {'tokenizer': 'hf', 'dir': init_from}
    else:
        die("--dataset is needed to find the tokenizer (data/<dataset>/meta.json)")
    encode, decode = get_tokenizer(meta)
    dev = pick_device(device)  # 'auto': the first this machine has
    model.to(dev).eval()

    ids = encode(prompt)
    if not ids:
        die("the prompt encodes to no tokens")
    idx = torch.tensor([ids] * num_samples, device=dev)
    for row in generate(model, idx, max_new_tokens, temperature, top_k).tolist():
        print(decode(row), '-' * 60, sep='\n')


if __name__ == '__main__':
    try:
        main()
    except (checkpoint.Error, ValueError) as e:  # a damaged checkpoint, an HF directory without
        die(e)  # weights: one line, no traceback (model.py's ValueErrors name the file)
