"""
A corpus of the passkey task, so a small model can learn retrieval (and eval.py can measure it):
each document is one of prompt.py's passkey prompts (filler, "The pass key is NNNNN. Remember it.
NNNNN is the pass key." at a random depth, more filler, "What is the pass key? The pass key is")
followed by its answer, " NNNNN.\n". Lengths are drawn uniformly up to --seq_len tokens, the depth
uniformly in [0, 1], the key uniformly from 10000-99999: the only tokens that can't be predicted
from the filler are the key's: random in the needle's first sentence, then copied twice, a few
tokens later in its second sentence and from far back in the answer (what the model must learn).

Why the needle says its key twice (LongLoRA's needle does too): the near copy teaches the
mechanism (an induction head: find the earlier place whose tokens match mine, copy what came next)
at a short distance, where it is found early; the answer then needs that same mechanism at any
distance. With the key said once, train_tiny's Llama retrieved nothing at step 1,000 (0%) and its
val loss was still flat at step 1,500; with it twice, it retrieves by step 1,250 (README, "Extend
the context on a laptop").

The prompts are prompt.py's (passkey_prompt), eval.py's too: the model trains on the very format
it is tested on. Byte-level by default (vocab 256: a tiny model on a CPU), or any tiktoken
encoding. Documents are packed one after the other with their starts in {split}.docs.npy: train
with --doc_mask=True, so each document attends to itself only and its positions start at 0, as a
prompt's do in eval.py.

    python data/passkey/prepare.py --seq_len=256                  # 10.8M tokens in 5 seconds
    python train.py --dataset=passkey --seq_len=256 --doc_mask=True ...
    python eval.py --out_dir=... --passkey_lengths=[256,512,1024]
    python data/passkey/prepare.py --seq_len=512 --needles=4      # multi-key: 1 to 4 needles

With --needles=K > 1 each document is prompt.py's multi-key prompt instead (RULER's
niah_multikey): k needles uniform in 1..K, each "The pass key of <name> is NNNNN. ...", the
question asking for one name's, the answer its key. Passkey's corpus teaches copying the one
number; this one teaches finding the needle the question names.
"""

import argparse
import os
import random
import sys

import numpy as np

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, ROOT)
from data.passkey.prompt import (NAMES, NEEDLE, NEEDLE_OF, QUESTION,  # noqa: E402
                                 QUESTION_OF, multikey_prompt, passkey_prompt)
from data.tokenizer import (dtype_for, get_encoding, get_tokenizer, write_docs,  # noqa: E402
                            write_meta, write_split)


def documents(encode, n, seq_len, rng, needles=1):
    """n documents (lists of token ids), each a prompt and its answer, at most seq_len tokens: a
    passkey prompt (needles=1), else a multi-key one of k needles, k uniform in 1..needles."""
    bos = encode('')
    # the shortest prompt (no filler) and the longest answer: a document needs room for both
    shortest = len(encode(NEEDLE.format(99999) + QUESTION))
    if needles > 1:  # the most needles, their longest name each
        name = max(NAMES, key=len)
        shortest = len(encode(NEEDLE_OF.format(name=name, key=99999) * needles
                              + QUESTION_OF.format(name=name)))
    answer_room = len(encode(' 99999.\n')) - len(bos)
    if seq_len < shortest + answer_room + 1:
        sys.exit(f"error: --seq_len={seq_len}: a document of {needles} needles needs at least "
                 f"{shortest + answer_room + 1} tokens")
    docs = []
    for _ in range(n):
        if needles == 1:  # (the draws of a passkey corpus before --needles: the same corpus)
            key = rng.randint(10000, 99999)
            length = rng.randint(shortest + 1, seq_len - answer_room)
            prompt = passkey_prompt(encode, length, rng.random(), key)
        else:
            k = rng.randint(1, needles)
            length = rng.randint(shortest + 1, seq_len - answer_room)
            prompt, key = multikey_prompt(encode, length, rng.random(), k, rng)
        docs.append(prompt + encode(f' {key}.\n')[len(bos):])
    return docs


def prepare(out_dir=None, seq_len=256, train_docs=60000, val_docs=500, tokenizer='bytes',
            seed=0, needles=1):
    out_dir = out_dir or os.path.dirname(os.path.abspath(__file__))
    meta = dict(tokenizer='bytes', vocab_size=256)
    if tokenizer != 'bytes':
        try:
            enc = get_encoding(tokenizer)
        except ValueError as e:  # not an encoding tiktoken knows; offline, one it can't download
            sys.exit(f"error: --tokenizer={tokenizer}: {str(e).splitlines()[0]}")
        meta = dict(tokenizer=tokenizer, vocab_size=enc.n_vocab, eot_token=enc.eot_token)
    encode, _ = get_tokenizer(meta)
    rng = random.Random(seed)
    for split, n in (('train', train_docs), ('val', val_docs)):
        docs = documents(encode, n, seq_len, rng, needles)
        os.makedirs(out_dir, exist_ok=True)  # (after documents() checked seq_len: a mistake makes no folder)
        lengths = np.array([len(d) for d in docs], dtype=np.int64)
        ids = np.concatenate([np.array(d, dtype=np.int64) for d in docs])
        meta[f'{split}_tokens'] = write_split(os.path.join(out_dir, f'{split}.bin'), ids,
                                              meta['vocab_size'])
        write_docs(os.path.join(out_dir, f'{split}.docs.npy'), np.cumsum(lengths) - lengths)
    meta.update(dtype=dtype_for(meta['vocab_size']), docs=True,
                source=f'passkey prompts and answers up to {seq_len} tokens, seed {seed} '
                       f'(data/passkey/prepare.py)')
    if needles > 1:  # (a passkey corpus's meta.json as it was)
        meta['source'] += f', multi-key: 1 to {needles} needles'
    write_meta(out_dir, meta)
    print(f"passkey: {train_docs:,} + {val_docs:,} documents up to {seq_len} tokens -> "
          f"{meta['train_tokens']:,} train / {meta['val_tokens']:,} val tokens in {out_dir}")
    return meta


def positive(text):
    """argparse's type for a count: an int >= 1 (no documents make no corpus)."""
    n = int(text)
    if n < 1:
        raise argparse.ArgumentTypeError(f"{text}: must be >= 1")
    return n


if __name__ == '__main__':
    p = argparse.ArgumentParser(description=__doc__.split('\n\n')[0])
    p.add_argument('--out_dir', default=None, help='default: the folder of this script')
    p.add_argument('--seq_len', type=positive, default=256, help='the longest document, in tokens')
    p.add_argument('--train_docs', type=positive, default=60000)
    p.add_argument('--val_docs', type=positive, default=500)
    p.add_argument('--tokenizer', default='bytes', help="'bytes' or a tiktoken encoding name")
    p.add_argument('--seed', type=int, default=0)
    p.add_argument('--needles', type=positive, default=1,
                   help='1: passkey; K > 1: multi-key prompts of 1..K needles')
    a = p.parse_args()
    prepare(a.out_dir, a.seq_len, a.train_docs, a.val_docs, a.tokenizer, a.seed, a.needles)
