"""Prepare the default dataset once, before any test starts train.py: a fresh clone has none, and the
first run's progress bar would otherwise land in the middle of some test's stderr."""
import importlib.util
import os
import sys

import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)


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
