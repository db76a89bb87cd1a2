"""
The default corpus: the .py sources of Python's own standard library, byte-level (vocab 256).

Every machine that runs nanolong has it, so `python train.py` works on a fresh clone with no
download and no tokenizer file: ~12 MB of real code, enough to see a small model's loss fall.

What goes in: every .py file under sysconfig.get_paths()['stdlib'], except directories named
site-packages / dist-packages (installed packages, not the stdlib), test / tests / idle_test (the
test suite is ~17 MB of fixtures and deliberately malformed sources, and distributions such as
Debian ship it as a separate package, so leaving it out keeps the corpus the same across installs)
and __pycache__. Files are sorted by relative path, each preceded by a line `# ---- path ----`.

Split: every 10th file (index % 10 == 9 in sorted order) is val. Whole files, spread across the
library, so val loss measures unseen modules, not the tail of the alphabet (xml.*, zipfile, ...).
Each file is one document: {split}.docs.npy holds where each file's header line starts.

    python data/stdlib/prepare.py [--out_dir=DIR]        # default: this folder
"""

import os
import sys
import sysconfig

import numpy as np
from tqdm import tqdm

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
from data.tokenizer import dtype_for, make_out_dir, write_docs, write_meta, write_split  # noqa: E402

SKIP_DIRS = {"site-packages", "dist-packages", "test", "tests", "idle_test", "__pycache__"}
VAL_EVERY = 10


def list_files(root=None):
    """Relative paths ('/'-separated) of the stdlib .py files that make up the corpus, sorted."""
    root = root or sysconfig.get_paths()["stdlib"]
    files = []
    for dirpath, dirnames, filenames in os.walk(root):
        dirnames[:] = [d for d in dirnames if d not in SKIP_DIRS]
        for name in filenames:
            if name.endswith(".py"):
                files.append(os.path.relpath(os.path.join(dirpath, name), root).replace(os.sep, "/"))
    return sorted(files)


def document(root, rel):
    """The bytes one file contributes: a header line, its source (bytes as on disk, whatever the
    encoding: byte-level needs no decoding), and a newline if the file lacks a final one."""
    with open(os.path.join(root, rel), "rb") as f:
        src = f.read()
    return f"# ---- {rel} ----\n".encode() + src + (b"" if src.endswith(b"\n") or not src else b"\n")


def prepare(out_dir=None):
    out_dir = out_dir or os.path.dirname(os.path.abspath(__file__))
    make_out_dir(out_dir)
    root = sysconfig.get_paths()["stdlib"]
    files = list_files(root)
    train, val = [], []
    for i, rel in enumerate(tqdm(files, desc="stdlib", unit="file")):
        (val if i % VAL_EVERY == VAL_EVERY - 1 else train).append(document(root, rel))
    n_train = write_split(os.path.join(out_dir, "train.bin"), np.frombuffer(b"".join(train), np.uint8), 256)
    n_val = write_split(os.path.join(out_dir, "val.bin"), np.frombuffer(b"".join(val), np.uint8), 256)
    for split, docs in (("train", train), ("val", val)):
        lens = np.array([len(d) for d in docs], dtype=np.int64)
        write_docs(os.path.join(out_dir, f"{split}.docs.npy"), np.cumsum(lens) - lens)
    meta = dict(
        tokenizer="bytes", vocab_size=256, dtype=dtype_for(256), train_tokens=n_train, val_tokens=n_val,
        source=f"Python {sys.version.split()[0]} stdlib .py files ({len(files)}, tests excluded), "
               f"every {VAL_EVERY}th file is val", docs=True,
    )
    write_meta(out_dir, meta)
    print(f"stdlib: {len(files)} files -> {n_train:,} train / {n_val:,} val byte tokens in {out_dir}")
    return meta


if __name__ == "__main__":
    import argparse
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out_dir", default=None, help="default: the folder of this script")
    try:
        prepare(p.parse_args().out_dir)
    except ValueError as e:
        # an out_dir that can't be made is the user's to fix: one line, not a traceback
        print(f"error: {e}", file=sys.stderr)
        sys.exit(2)
