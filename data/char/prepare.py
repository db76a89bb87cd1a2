"""
Character-level dataset from a plain text file you bring (nanoGPT's shakespeare_char, any text).

The vocabulary is the set of characters in the file, so a model sees only symbols that occur and the
vocab is tiny (65 for tiny-shakespeare). The file is read verbatim (newline='': a '\r' stays a '\r'),
so train.bin + val.bin decode back to exactly the file. Split: first 90% of characters train, last 10% val.
The file is one document: each split's docs file holds the single offset 0.

    python data/char/prepare.py [path/to/input.txt] [--out_dir=DIR]
    default input: data/char/input.txt; default out_dir: this folder
"""

import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
from data.tokenizer import (dtype_for, get_tokenizer, make_out_dir, write_docs, write_meta,  # noqa: E402
                            write_split)

HERE = os.path.dirname(os.path.abspath(__file__))


def prepare(input_path=None, out_dir=None):
    input_path = input_path or os.path.join(HERE, "input.txt")
    out_dir = out_dir or HERE
    if not os.path.isfile(input_path):
        raise FileNotFoundError(f"no such input file: {input_path} (bring a UTF-8 text file, e.g. tiny-shakespeare)")
    try:
        with open(input_path, encoding="utf-8", newline="") as f:
            text = f.read()
    except UnicodeDecodeError as e:
        raise ValueError(f"{input_path} is not UTF-8 text ({e.reason} at byte {e.start})") from None
    if len(text) < 2:
        raise ValueError(f"{input_path} has {len(text)} characters: nothing to split into train and val")
    chars = "".join(sorted(set(text)))
    encode, _ = get_tokenizer(dict(tokenizer="char", chars=chars))
    n = int(len(text) * 0.9)
    make_out_dir(out_dir)
    meta = dict(
        tokenizer="char", vocab_size=len(chars), dtype=dtype_for(len(chars)),
        train_tokens=write_split(os.path.join(out_dir, "train.bin"), encode(text[:n]), len(chars)),
        val_tokens=write_split(os.path.join(out_dir, "val.bin"), encode(text[n:]), len(chars)),
        source=f"char-level {os.path.basename(input_path)}, first 90% train, last 10% val",
        chars=chars, docs=True,
    )
    for split in ("train", "val"):
        write_docs(os.path.join(out_dir, f"{split}.docs.npy"), [0])
    write_meta(out_dir, meta)
    print(f"char: {len(text):,} characters, vocab {len(chars)} -> "
          f"{meta['train_tokens']:,} train / {meta['val_tokens']:,} val tokens in {out_dir}")
    return meta


if __name__ == "__main__":
    import argparse
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("input", nargs="?", default=None, help="text file (default: data/char/input.txt)")
    p.add_argument("--out_dir", default=None, help="default: the folder of this script")
    args = p.parse_args()
    try:
        prepare(args.input, args.out_dir)
    except (FileNotFoundError, ValueError) as e:
        # a wrong path, a binary file or an out_dir that can't be made is the user's to fix:
        # one line, not a traceback
        print(f"error: {e}", file=sys.stderr)
        sys.exit(2)
