"""The project's shape, checked mechanically: the core's budget of code tokens, the style gate, no
file reaching into another's private names, no torch internals, nothing cited from outside the
repository.

The budget counts what a reader must parse: Python tokens less comments, docstrings and layout
(explanations are free). The gate holds the few style rules a machine can check; each failure is
reported as `file:line: rule`."""
import ast
import glob
import io
import os
import re
import tokenize

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
CORE = sorted(p for p in glob.glob(os.path.join(ROOT, '*.py')) if os.path.basename(p) != 'bench.py')
MODULES = {os.path.basename(p)[:-3] for p in CORE}
ALL = (CORE + [os.path.join(ROOT, 'bench.py')] + glob.glob(os.path.join(ROOT, 'data', '*', '*.py'))
       + glob.glob(os.path.join(ROOT, 'config', '*.py')) + glob.glob(os.path.join(ROOT, 'bench', '*.py')))

# The core (top-level *.py but bench.py): 30,000 code tokens after the tutorial rewrite (30,971 before
# it), plus what each later feature issue allows: 27 (the dry run in a minute, as a picture) +1,000,
# 28 (attention by head groups) +1,200, 29 (packed documents under every layout) +1,500, 30 (fp16 with loss
# scaling, one run per out_dir) +500, 31 (mixture of experts) +3,500. No file over 5,000.
CORE_TOKENS = 37_700
FILE_TOKENS = 5_000
LINE_CHARS = 100
FUNCTION_LINES = 100
LAYOUT = (tokenize.NL, tokenize.NEWLINE, tokenize.INDENT, tokenize.DEDENT, tokenize.ENDMARKER,
          tokenize.COMMENT)
DEFS = (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)
BLOCKS = (ast.If, ast.For, ast.While, ast.With, ast.Try, ast.AsyncFor, ast.AsyncWith)


def docstring_lines(tree):
    """The line numbers of every module, class and function docstring."""
    lines = set()
    for node in ast.walk(tree):
        if isinstance(node, (ast.Module,) + DEFS) and node.body:
            first = node.body[0]
            is_string = isinstance(first, ast.Expr) and isinstance(first.value, ast.Constant)
            if is_string and isinstance(first.value.value, str):
                lines.update(range(first.lineno, first.end_lineno + 1))
    return lines


def code_tokens(src):
    """Python tokens a reader must parse: no comments, docstrings, newlines or indentation."""
    docs = docstring_lines(ast.parse(src))
    count = 0
    for tok in tokenize.generate_tokens(io.StringIO(src).readline):
        if tok.type in LAYOUT:
            continue
        if tok.type == tokenize.STRING and tok.start[0] in docs:
            continue
        count += 1
    return count


def style_failures(src):
    """(line, rule) for every place the source breaks the gate."""
    tree = ast.parse(src)
    parents = {child: node for node in ast.walk(tree) for child in ast.iter_child_nodes(node)}
    found = []
    statements_on_line = {}
    for node in ast.walk(tree):
        if isinstance(node, ast.Expr) and isinstance(node.value, (ast.BoolOp, ast.IfExp)):
            found.append((node.lineno, 'condition as a statement'))
        if isinstance(node, (ast.Assign, ast.AnnAssign)) and isinstance(node.value, ast.Lambda):
            found.append((node.lineno, 'lambda bound to a name'))
        if isinstance(node, ast.NamedExpr):
            parent = parents.get(node)
            if not (isinstance(parent, (ast.If, ast.While)) and parent.test is node):
                found.append((node.lineno, ':= outside an if/while test'))
        if isinstance(node, ast.IfExp):
            if isinstance(node.body, ast.IfExp) or isinstance(node.orelse, ast.IfExp):
                found.append((node.lineno, 'ternary inside a ternary'))
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            if node.end_lineno - node.lineno + 1 > FUNCTION_LINES:
                found.append((node.lineno, f'function over {FUNCTION_LINES} lines'))
        if isinstance(node, ast.stmt) and not isinstance(node, DEFS):
            statements_on_line.setdefault(node.lineno, []).append(node)
        if isinstance(node, BLOCKS) and node.body and node.body[0].lineno == node.lineno:
            found.append((node.lineno, 'a block on its header line'))
    for line, statements in statements_on_line.items():
        if len(statements) > 1 and len({id(parents.get(s)) for s in statements}) == 1:
            found.append((line, 'two statements on one line'))
    for number, text in enumerate(src.splitlines(), 1):
        if len(text) > LINE_CHARS:
            found.append((number, f'line over {LINE_CHARS} characters'))
        if text.rstrip().endswith('\\') and not text.lstrip().startswith('#'):
            found.append((number, 'backslash continuation'))
    return sorted(set(found))


def test_the_gate_catches_what_it_names():
    src = ('x = 1; y = 2\n'
           'x and print(y)\n'
           'f = lambda: 1\n'
           'z = (w := 3)\n'
           'v = 1 if x else 2 if y else 3\n'
           'if x: print(x)\n'
           's = 1 + \\\n    2\n'
           f"t = '{'a' * 100}'\n"
           'def long():\n' + '    pass\n' * 100)
    rules = [rule for _, rule in style_failures(src)]
    assert rules == ['two statements on one line', 'condition as a statement', 'lambda bound to a name',
                     ':= outside an if/while test', 'ternary inside a ternary',
                     'a block on its header line', 'backslash continuation',
                     'line over 100 characters', 'function over 100 lines']
    assert style_failures('while n := len(x):\n    print(n)\n') == []
    assert code_tokens('"""free"""\nx = 1  # free\n') == 3


def test_core_token_budget():
    tokens = {os.path.basename(p): code_tokens(open(p).read()) for p in CORE}
    assert sum(tokens.values()) <= CORE_TOKENS, tokens
    over = {name: n for name, n in tokens.items() if n > FILE_TOKENS}
    assert not over, over


@pytest.mark.parametrize('path', CORE, ids=lambda p: os.path.relpath(p, ROOT))
def test_style_gate(path):
    failures = style_failures(open(path).read())
    name = os.path.relpath(path, ROOT)
    assert not failures, '\n'.join(f'{name}:{line}: {rule}' for line, rule in failures)


@pytest.mark.parametrize('path', ALL, ids=lambda p: os.path.relpath(p, ROOT))
def test_no_private_names_across_files_and_no_torch_internals(path):
    with open(path) as f:
        src = f.read()
    tree = ast.parse(src)
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and node.module in MODULES:
            assert not any(a.name.startswith('_') for a in node.names), (path, node.lineno)
        if isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name) and node.value.id in MODULES:
            assert not node.attr.startswith('_'), (path, node.lineno, node.attr)
        if isinstance(node, ast.FunctionDef):
            assert node.name != '__del__', (path, node.lineno)
    for bad in ('_cdata', 'sys._getframe', '_current_graph_task_id'):
        assert bad not in src, (path, bad)
    # a private aten kernel only by keyword, in one wrapper
    for call in re.findall(r'torch\.ops\.aten\._\w+(?:\.default)?\(([^)]*)', src):
        assert '=' in call.split(',')[0], (path, call)


@pytest.mark.parametrize('path', ALL + [os.path.join(ROOT, 'README.md')],
                         ids=lambda p: os.path.relpath(p, ROOT))
def test_nothing_cites_files_outside_the_repository(path):
    with open(path) as f:
        src = f.read()
    assert 'DESIGN.md' not in src and 'REFERENCES.md' not in src and '../shared' not in src
