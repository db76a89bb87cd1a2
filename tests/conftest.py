"""Prepare the default dataset once, before any test starts train.py: a fresh clone has none, and the
first run's progress bar would otherwise land in the middle of some test's stderr."""
import importlib.util
import os
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)


def pytest_sessionstart(session):
    data_dir = os.path.join(ROOT, 'data', 'stdlib')
    if not os.path.exists(os.path.join(data_dir, 'meta.json')):
        spec = importlib.util.spec_from_file_location('stdlib_prepare', os.path.join(data_dir, 'prepare.py'))
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
        module.prepare(data_dir)
