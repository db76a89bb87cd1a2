"""
Did the long context work? Two cheap probes of a trained checkpoint (or a Hugging Face directory),
each printed as a table and drawn as a picture in out_dir:

    python eval.py --out_dir=out-tiny                 # train.py's checkpoint, with the run's keys
    python eval.py --init_from=path/to/hf_llama --dataset=mydata --seq_len=8192 --out_dir=out-hf

- positions.svg, loss by position: the val split's mean loss per position bucket (0, 1, 2-3, 4-7,
  ... up to seq_len; with doc_mask a token's position in its document). The val loss is one number
  over all positions; a model that uses its context keeps lowering its loss at later positions,
  one that lost track of it (past the length it trained at, a RoPE scaling gone wrong) flattens or
  rises. The buckets' token-weighted mean is train.py's evaluate() val loss: the same batches, the
  same targets (tests/test_eval.py checks it).
- passkey.svg, passkey retrieval: filler text with "The pass key is NNNNN. Remember it. NNNNN is
  the pass key." at a depth (a fraction of the filler before it), then the question "What is the
  pass key? The pass key is"; the digits are decoded greedily (sample.py's generate and its KV
  cache) and compared. Accuracy per (prompt length, depth), a heatmap. The idea is LongLoRA's
  passkey_retrivial.py (Chen et al. 2023, after Mohtashami & Jaggi's landmark attention);
  EasyContext's eval_needle.py (needle in a haystack) and RULER (Hsieh et al. 2024) are its larger
  cousins.

The keys are train.py's (seq_len, batch_size, dataset, doc_mask, eval_iters, seed, device, dtype
and the memory knobs mlp_chunks, loss_chunks, attention_chunks) and the four below. With a
checkpoint the run's own keys are the defaults, so the evaluation sees the data, batches and
chunking that training saw: a long evaluation fits where training did. Memory: the loss never
holds the [B, S, V] logits at once; each token's loss comes from the final hidden states, a chunk
of the sequence at a time (loss_chunks' chunks). A passkey prompt runs through sample.generate,
once whole (prefill: causal attention without a T x T mask, the last token's logits only), then a
token at a time against the KV cache: a prompt's keys and values, 4·L·n_kv_head·head_dim bytes a
token in bf16, are what it holds beyond the model.

(The run's own curves, loss, tokens/s and memory against the step, are train.py's curves.svg,
drawn at each evaluation by measure.write_curves.)
"""

import math
import random
import re
from pathlib import Path

import torch
import torch.nn.functional as F
from tqdm import tqdm

import checkpoint
import chunked
import measure
import train
from configurator import check, configure, die
from data.passkey.prompt import passkey_prompt
from data.tokenizer import check_tokenizer, get_tokenizer
from knobs import KNOBS, with_knobs
from model import Llama
from sample import generate

# -----------------------------------------------------------------------------
# our keys, beside train.py's: one command line sets both
EVAL_KEYS = dict(
    init_from='resume',  # 'resume' (out_dir's checkpoint) or a Hugging Face model directory
    passkey_lengths=[],  # prompt lengths in tokens; []: seq_len / 2 and seq_len
    passkey_depths=[0.0, 0.25, 0.5, 0.75, 1.0],  # where the key sits: a fraction of the filler
    passkey_trials=5,  # prompts per (length, depth), each with its own key; 0: no passkey test
)
EVAL_TYPES = {'passkey_lengths': list[int]}  # (an empty default says nothing of its elements)
EVAL_RULES = [  # configurator.check's rows, beside train.RULES
    ('passkey_trials', 'must be >= 0 (0: no passkey test)', lambda v: v >= 0),
    ('passkey_depths', 'at least one depth, each in [0, 1], a fraction of the filler',
     lambda v: v and all(0 <= d <= 1 for d in v)),
    ('passkey_lengths', 'each a positive number of tokens', lambda v: all(n >= 1 for n in v))]
# -----------------------------------------------------------------------------


def read_config(argv=None):
    """The config as a dict: train.py's defaults and ours, then (init_from='resume') the run's own
    config from its checkpoint, then the command line over all of it. It lives in train.py's
    globals: its get_batch, evaluate and device_and_dtype read them there."""
    g = vars(train)
    g.update(EVAL_KEYS, __annotations__={**g.get('__annotations__', {}), **EVAL_TYPES})
    cfg = configure(g, argv)
    if cfg['init_from'] == 'resume':
        path = checkpoint.latest(cfg['out_dir'])
        if path is None:
            die(f"no checkpoint in {cfg['out_dir']} (train one first: python train.py)")
        # the run's keys, but it is this checkpoint we evaluate, wherever it was written
        g.update(checkpoint.meta(path)['config'], init_from='resume', out_dir=cfg['out_dir'])
        cfg = configure(g, argv)
        cfg['path'] = path
    # before the loss pass: a mistake here would else come after minutes of it
    check(cfg, train.RULES + EVAL_RULES)
    return cfg


def load_model(cfg, meta):
    """The checkpoint's model, or the Hugging Face directory's (refused unless the data was made
    by its tokenizer), run under the config's memory knobs."""
    if cfg['init_from'] == 'resume':
        model = checkpoint.load_model(cfg['path'])[0]
    else:
        check_tokenizer(meta, cfg['init_from'])
        model = Llama.from_pretrained(cfg['init_from'])
    # the knobs' modules, as train.py applies them in one process (the chunked loss among them)
    return chunked.apply(model, with_knobs(model.config, **{k: cfg[k] for k in KNOBS}))


# ----------------------------------------------------------------------------- loss by position
@torch.no_grad()
def loss_by_position(model, meta, autocast, dev):
    """(sums, counts): the losses of the real targets in each position bucket, added, and their
    number, over evaluate()'s batches (from its seed: the same ones). Bucket k holds positions
    2^(k-1) to 2^k - 1 (position 0 alone in bucket 0): log-spaced, a position's bit length. With
    doc_mask a target's position is its input's place in its document: what of it the model saw.
    Each target's loss comes from the final hidden states, the LM head on a chunk of the B·S
    tokens at a time: only a chunk's fp32 logits exist at once, never [B, S, V]."""
    generator = torch.Generator().manual_seed(train.seed + 1)
    buckets, losses = [], []  # of every real target
    for _ in range(train.eval_iters):
        x, y, positions, docs = train.get_batch(meta, 'val', train.batch_size, generator, dev)
        # tokens a chunk: loss_chunks' chunks of all B·S, at most MIN_CHUNK_TOKENS (with
        # loss_chunks = 1 too: a long sequence's [B, S, V] fp32 logits never exist at once)
        knobs = with_knobs(model.config, loss_chunks=train.loss_chunks)
        per_chunk = math.ceil(y.numel() / chunked.loss_chunks(knobs, y.numel()))
        per_chunk = min(per_chunk, chunked.MIN_CHUNK_TOKENS)
        loss = []  # [per_chunk] each
        with autocast:
            # the final norm's output, the hidden states the LM head reads: the head runs here
            # alone, once a chunk (the model's own loss would run it a second time)
            hidden = model(x, positions=positions, docs=docs, head=False).flatten(0, 1)
            for h, targets in zip(hidden.split(per_chunk), y.flatten().split(per_chunk)):
                # this chunk's logits [per_chunk, V], the only ones that exist at a time (the
                # head's weight, not its module: a technique may swap in a head that takes targets)
                logits = F.linear(h, model.output.weight).float()
                loss.append(F.cross_entropy(logits, targets, reduction='none'))
                # freed before the next chunk's are made
                del logits
        if positions is None:
            positions = torch.arange(train.seq_len, device=dev).expand_as(y)
        real = y != -100
        losses.append(torch.cat(loss).view_as(y)[real].double().cpu())
        # the bit length of each position: frexp's exponent (p = m 2^e, m in [0.5, 1); 0 for 0)
        buckets.append(torch.frexp(positions[real].double()).exponent.cpu())
    buckets = torch.cat(buckets)
    return torch.bincount(buckets, torch.cat(losses)), torch.bincount(buckets)


# ----------------------------------------------------------------------------- passkey retrieval
@torch.no_grad()
def passkey(model, encode, decode, lengths, depths, trials, dev):
    """Accuracy [depths, lengths]: the share of `trials` prompts, each with its own key, whose
    greedy answer's first number is the key."""
    rng = random.Random(train.seed)
    right = torch.zeros(len(depths), len(lengths))
    for j, length in enumerate(tqdm(lengths, 'passkey, by length')):
        for i, depth in enumerate(depths):
            for _ in range(trials):
                key = rng.randint(10000, 99999)
                ids = passkey_prompt(encode, length, depth, key)
                # ' NNNNN.' is at most 7 tokens: 8 leave the model room to say something else
                out = generate(model, torch.tensor([ids], device=dev), 8, temperature=0)
                answer = decode(out[0, len(ids):].tolist())
                if re.findall(r'\d+', answer)[:1] == [str(key)]:
                    right[i, j] += 1
    return right / trials


# ----------------------------------------------------------------------------- the heatmap
def write_heatmap(path, accuracy, lengths, depths):
    """passkey.svg: a cell per (depth, length), red at 0% to green at 100%, its figure in it.
    Hand-written SVG, as measure.py's pictures: any browser shows it."""
    out = [f'<svg xmlns="http://www.w3.org/2000/svg" width="{max(60 * len(lengths) + 80, 340)}" '
           f'height="{60 * len(depths) + 50}" font-family="sans-serif" font-size="12">',
           '<text x="4" y="14">passkey accuracy: depth down, length (tokens) across</text>']
    for j, length in enumerate(lengths):
        out.append(f'<text x="{60 * j + 70}" y="{60 * len(depths) + 45}">{length}</text>')
    for i, depth in enumerate(depths):
        out.append(f'<text x="4" y="{60 * i + 55}">{depth:g}</text>')
        for j, a in enumerate(accuracy[i].tolist()):
            out.append(f'<rect x="{60 * j + 60}" y="{60 * i + 25}" width="60" height="60" '
                       f'fill="hsl({120 * a:.0f},70%,60%)"/>')
            out.append(f'<text x="{60 * j + 75}" y="{60 * i + 55}">{a:.0%}</text>')
    Path(path).write_text('\n'.join(out + ['</svg>']) + '\n')


# -----------------------------------------------------------------------------
def main():
    cfg = read_config()
    dev, ptdtype, autocast = train.device_and_dtype()
    meta = train.read_dataset(1, 0)
    encode, decode = get_tokenizer(meta)
    lengths = cfg['passkey_lengths'] or [train.seq_len // 2, train.seq_len]
    for length in lengths:  # too short for the needle and question: said before the loss pass
        passkey_prompt(encode, length, 0.0, 10000)
    model = load_model(cfg, meta).to(dev, ptdtype).eval()
    out = Path(train.out_dir)
    out.mkdir(parents=True, exist_ok=True)

    sums, counts = loss_by_position(model, meta, autocast, dev)
    print(f"val loss {sums.sum() / counts.sum():.4f} (evaluate()'s), by position:")
    # (no bucket is empty: a real target at position p has its document's 0..p - 1 before it)
    means = (sums / counts).tolist()
    for k, mean in enumerate(means):
        print(f'{2 ** k // 2:>9} to {2 ** k - 1:<9} {mean:.4f}')
    measure.write_lines(out / 'positions.svg',
                        [('val loss by bit length of the position', [list(enumerate(means))])])

    if cfg['passkey_trials']:
        depths = cfg['passkey_depths']
        accuracy = passkey(model, encode, decode, lengths, depths, cfg['passkey_trials'], dev)
        print('passkey accuracy', 'depth \\ length', *lengths, sep='\t')
        for depth, row in zip(depths, accuracy.tolist()):
            print('', depth, *[f'{a:.0%}' for a in row], sep='\t')
        write_heatmap(out / 'passkey.svg', accuracy, lengths, depths)


if __name__ == '__main__':
    try:
        main()
    # a damaged checkpoint, a Hugging Face directory's bad files, data made by another
    # tokenizer, a passkey prompt too short: the user's, one line
    except (checkpoint.Error, ValueError) as e:
        die(e)
