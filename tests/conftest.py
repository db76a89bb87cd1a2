"""Prepare the default dataset once, before any test starts train.py: a fresh clone has none, and the
first run's progress bar would otherwise land in the middle of some test's stderr. The tiny_hf fixture:
a Hugging Face checkpoint with its own tokenizer, and data prepared with that tokenizer."""
import importlib.util
import os
import sys

import pytest
import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)


# tests that need a CUDA GPU: skipped without one (CI has none); bench/gpu_check.sh runs them on one
cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason='needs a CUDA GPU')


def pytest_sessionstart(session):
    data_dir = os.path.join(ROOT, 'data', 'stdlib')
    if not os.path.exists(os.path.join(data_dir, 'meta.json')):
        spec = importlib.util.spec_from_file_location('stdlib_prepare', os.path.join(data_dir, 'prepare.py'))
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
        module.prepare(data_dir)


def packed_batch(lens, vocab=97, seed=0):
    """(x, y, positions, docs) as train.get_batch makes them for rows cut into documents of these lengths: a
    target that begins the next document is ignored, positions restart, docs are the starts in the flat rows."""
    g = torch.Generator().manual_seed(seed)
    B, S = len(lens), sum(lens[0])
    x, y = torch.randint(0, vocab, (B, S), generator=g), torch.randint(0, vocab, (B, S), generator=g)
    pos = torch.cat([torch.arange(n) for row in lens for n in row]).view(B, S)
    y[:, :-1][pos[:, 1:] == 0] = -100
    return x, y, pos, torch.nonzero(pos.flatten() == 0).flatten()


# -----------------------------------------------------------------------------
# a tiny Hugging Face checkpoint with its own tokenizer, and data prepared with it (no hub: all made here)

def tiny_bpe(texts, vocab_size=400):
    """A byte-level BPE trained on texts (Llama 3's kind), with a BOS "<s>" its post-processor adds and an
    EOS "</s>" it leaves out, as Llama's do."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.train_from_iterator(texts, trainers.BpeTrainer(
        vocab_size=vocab_size, special_tokens=['<s>', '</s>'], show_progress=False,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))  # every byte encodes: no unknown token
    bos = ('<s>', tok.token_to_id('<s>'))
    tok.post_processor = processors.TemplateProcessing(single='<s> $A', special_tokens=[bos])
    return tok


def tiny_hf_dir(path, tok):
    """path/: tokenizer.json, tokenizer_config.json (bos/eos by name, as checkpoints have it) and a tiny
    random Llama with the tokenizer's vocabulary."""
    import json
    import torch
    from model import Llama, LlamaConfig
    os.makedirs(path, exist_ok=True)
    tok.save(os.path.join(path, 'tokenizer.json'))
    with open(os.path.join(path, 'tokenizer_config.json'), 'w') as f:
        json.dump({'bos_token': '<s>', 'eos_token': '</s>', 'tokenizer_class': 'PreTrainedTokenizerFast'}, f)
    torch.manual_seed(0)
    Llama(LlamaConfig(vocab_size=tok.get_vocab_size(), n_layer=2, n_embd=64, n_head=4, n_kv_head=4,
                      intermediate_size=128)).save_pretrained(path)
    return path


def tiny_docs(seed=0, n=60):
    """n documents of 1 to 60 words: short ones, ones longer than a 32-token window, non-ASCII, and one
    that spells the EOS token as text."""
    import random
    rng = random.Random(seed)
    words = ('the a model reads long documents and learns where each one ends naïve café 東京 🙂 def '
             'return x = 1 + 2 while True : print ( ) tokens attention window').split()
    docs = [' '.join(rng.choice(words) for _ in range(rng.randint(1, 60))) for _ in range(n)]
    docs[5] = 'this document spells </s> and <s> as text'
    return docs


@pytest.fixture(scope='session')
def tiny_hf(tmp_path_factory):
    """SimpleNamespace(hf: a tiny HF checkpoint directory with its tokenizer, data: a dataset prepared with
    data/hf/prepare.py --tokenizer=hf (a fifth of the documents in val), docs: the documents)."""
    import json
    import subprocess
    from types import SimpleNamespace
    root = tmp_path_factory.mktemp('tiny_hf')
    docs = tiny_docs()
    hf = tiny_hf_dir(str(root / 'hf'), tiny_bpe(docs))
    with open(root / 'docs.jsonl', 'w') as f:
        f.writelines(json.dumps({'text': d}) + '\n' for d in docs)
    env = {**os.environ, 'HF_DATASETS_OFFLINE': '1', 'HF_HUB_OFFLINE': '1', 'HF_DATASETS_CACHE': str(root / 'cache')}
    p = subprocess.run([sys.executable, os.path.join(ROOT, 'data', 'hf', 'prepare.py'),
                        f'--data_files={root / "docs.jsonl"}', f'--tokenizer={hf}', '--val_fraction=0.2',
                        '--num_proc=2', f'--out_dir={root / "data"}'], cwd=ROOT, capture_output=True, text=True,
                       env=env, timeout=300)
    assert p.returncode == 0, p.stderr[-3000:]
    return SimpleNamespace(hf=hf, data=str(root / 'data'), docs=docs)


def apply_techniques(model, mesh=None, knobs=None):
    """model with the techniques train.py applies, in its order (train.place_model, before the dtype
    and FSDP2): this rank's shard and the layout's attention cores, chunked.py's modules, offload's
    policy, under `knobs` (a knobs.Knobs; None: model.config, built as one). mesh None: one
    process."""
    import chunked
    import offload
    import parallel
    mesh = mesh or parallel.Mesh()
    if mesh.world > 1:
        parallel.parallelize(model, mesh)
    parallel.apply_cores(model, mesh)
    knobs = knobs or model.config
    chunked.apply(model, knobs, mesh.cp // mesh.cp_ring, mesh.tp_group)
    return offload.apply(model, knobs)
