"""README.md and docs/: the front door stays short, its links resolve, the key table matches
`python train.py --help`, and README's commands that a CPU runs in a minute run. Each check has a
test beside it that breaks a copy of the documents and watches the check fail."""

import os
import re
import shlex
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
README_LIMIT = 15_000  # characters: about nanoGPT's README
RESULTS_LIMIT = 30_000  # bench/RESULTS.md: one section per claim, superseded runs removed


def documents(root=ROOT):
    """README.md, every page of docs/ and bench/RESULTS.md: {path: text}."""
    paths = [root / 'README.md', root / 'bench' / 'RESULTS.md'] + sorted((root / 'docs').glob('*.md'))
    return {path: path.read_text() for path in paths}


def slug(heading):
    """GitHub's anchor for a heading: lower case, punctuation dropped, spaces to hyphens."""
    text = re.sub(r'[^\w\- ]', '', heading.strip().lower())
    return text.replace(' ', '-')


def anchors(text):
    """The anchors of a markdown text's headings (outside code blocks)."""
    found = set()
    inside = False
    for line in text.splitlines():
        if line.startswith('```'):
            inside = not inside
        elif not inside and line.startswith('#'):
            found.add(slug(line.lstrip('#')))
    return found


def broken_links(docs):
    """Every relative link of the documents whose file or #anchor doesn't exist: 'file: link'."""
    broken = []
    for path, text in docs.items():
        # (code blocks hold no links)
        prose = re.sub(r'```.*?```', '', text, flags=re.S)
        for link in re.findall(r'\]\(([^)\s]+)\)', prose):
            if re.match(r'[a-z]+:', link):  # https:, mailto: (not ours to check offline)
                continue
            target, _, anchor = link.partition('#')
            file = (path.parent / target).resolve() if target else path
            if not file.exists():
                broken.append(f'{path.name}: {link}')
            elif anchor and file.suffix == '.md' and anchor not in anchors(file.read_text()):
                broken.append(f'{path.name}: {link}')
    return broken


def help_keys():
    """The keys `python train.py --help` lists."""
    out = subprocess.run([sys.executable, 'train.py', '--help'], cwd=ROOT, capture_output=True,
                         text=True, check=True, timeout=300).stdout
    return set(re.findall(r'^\s+--(\w+)=', out, flags=re.M))


def table_keys(text):
    """The keys in the first column of the key tables of docs/configuration.md."""
    keys = set()
    for line in text.splitlines():
        cells = line.split('|')
        if line.startswith('|') and len(cells) > 2:
            keys.update(re.findall(r'`(\w+)`', cells[1]))
    return keys


def test_readme_and_the_results_are_short():
    assert len((ROOT / 'README.md').read_text()) <= README_LIMIT
    assert len((ROOT / 'bench' / 'RESULTS.md').read_text()) <= RESULTS_LIMIT


def test_every_relative_link_resolves():
    assert broken_links(documents()) == []


def test_the_link_check_fails_on_a_broken_file_or_anchor():
    docs = documents()
    readme = ROOT / 'README.md'
    docs[readme] += '\n[a](docs/nowhere.md) [b](docs/memory.md#no-such-heading) [c](#two-commands)\n'
    assert broken_links(docs) == ['README.md: docs/nowhere.md',
                                  'README.md: docs/memory.md#no-such-heading']


def test_the_key_table_holds_every_key_of_help_and_no_other():
    keys = help_keys()
    table = table_keys((ROOT / 'docs' / 'configuration.md').read_text())
    assert sorted(keys - table) == [], 'keys of --help missing from docs/configuration.md'
    assert sorted(table - keys) == [], 'keys in docs/configuration.md that --help does not list'


def test_the_key_check_fails_on_a_key_missing_or_made_up():
    text = (ROOT / 'docs' / 'configuration.md').read_text()
    assert 'seq_len' in table_keys(text)
    # a row's key removed, a key added
    damaged = text.replace('`seq_len`', 'seq_len') + '\n| `sequence_length` | made up |\n'
    assert 'seq_len' not in table_keys(damaged)
    assert 'sequence_length' in table_keys(damaged)


# README's shell commands: each is run here, run by CI itself, or named with why not (a new one
# must be classified, so it can't go stale unseen)
BY_CI = ('pip install -r requirements.txt', 'pip install -r requirements-test.txt')
NOT_IN_A_MINUTE = {
    'pip install torch==2.13.0': 'a CUDA build, downloaded',
    'python train.py config/llama3_8b_one_gpu.py': 'a GPU',
    'torchrun --nproc_per_node=8': 'eight GPUs',
    'python train.py config/llama3_8b_node.py --dry_run=True': 'minutes (tests/test_memory.py '
    'runs dry runs of small shapes)',
    'python plan.py config/llama3_8b_node.py': 'its dry runs take minutes (tests/test_plan.py)',
    'python train.py --init_from=path/to/hf': 'a Hugging Face checkpoint (tests/test_data.py)',
}


def readme_commands():
    """The command lines of README.md's sh code blocks (comments and blank lines left out)."""
    text = (ROOT / 'README.md').read_text()
    blocks = re.findall(r'```sh\n(.*?)```', text, flags=re.S)
    lines = [line.split('  #')[0].strip() for block in blocks for line in block.splitlines()]
    return [line for line in lines if line and not line.startswith('#')]


def test_every_readme_command_is_classified():
    unclassified = []
    for command in readme_commands():
        known = [*BY_CI, *NOT_IN_A_MINUTE]
        if not any(part in command for part in known) and 'out-tiny' not in command:
            unclassified.append(command)
    assert unclassified == []


def test_readme_commands_on_a_trained_checkpoint_run(tmp_path):
    """The README's commands that read the first command's out-tiny (sample.py, eval.py) run as
    written, on a checkpoint of a few steps of the same config in a folder of the test's."""
    out = tmp_path / 'out-tiny'
    env = {**os.environ, 'OMP_NUM_THREADS': '2'}
    subprocess.run([sys.executable, 'train.py', 'config/train_tiny.py', '--max_iters=2',
                    '--eval_iters=1', '--device=cpu', f'--out_dir={out}'], cwd=ROOT, env=env,
                   check=True, capture_output=True, timeout=600)
    ran = []
    for command in readme_commands():
        if 'out-tiny' not in command:
            continue
        words = shlex.split(command.replace('out-tiny', str(out)))
        assert words[0] == 'python'
        result = subprocess.run([sys.executable, *words[1:]], cwd=ROOT, env=env,
                                capture_output=True, text=True, timeout=600)
        assert result.returncode == 0, result.stderr[-2000:]
        ran.append(words[1])
    assert 'sample.py' in ran and 'eval.py' in ran
