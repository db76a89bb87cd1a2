import os
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
from configurator import configure  # noqa: E402

FINITE = ': numbers must be finite (and values plain, as JSON holds them)'


def defaults():
    # what train.py's globals() looks like: config keys next to things that aren't
    return {'__name__': '__main__', '_private': 1, 'os': os, 'configure': configure,
            'MEMORY_KNOBS': ('mlp_chunks',), 'SCALE_GROWTH': 2000,  # constants, imported or not
            'batch_size': 12, 'max_iters': 5000, 'learning_rate': 6e-4, 'compile': True,
            'dry_run': False, 'out_dir': 'out', 'init_from': 'scratch', 'rope_scaling': None,
            'betas': (0.9, 0.95), 'layers': [1, 2], 'extra': {'a': 1},
            'anything': None, 'window': None, 'kinds': None,
            # a None default says what it takes: `window: int | None = None` in a script
            '__annotations__': {'rope_scaling': dict | None, 'window': int | None,
                                'kinds': list[str] | None}}


def write(tmp_path, text, name='cfg.py'):
    path = tmp_path / name
    path.write_text(text)
    return str(path)


def error(capsys, argv, g=None):
    """Run configure expecting a user mistake; return its one stderr line."""
    with pytest.raises(SystemExit) as e:
        configure(defaults() if g is None else g, argv)
    assert e.value.code == 2
    err = capsys.readouterr().err
    assert err.count('\n') == 1 and err.startswith('error: '), err
    assert 'Traceback' not in err
    return err.strip()


# ---- success ----

def test_no_arguments_changes_nothing():
    g = defaults()
    configure(g, [])
    assert g == defaults()


def test_config_file_then_overrides(tmp_path, capsys):
    path = write(tmp_path, "import math\n_tmp = 3\nbatch_size = 2 * 16\nmax_iters = 100\n"
                           "out_dir = 'from_file'\nlearning_rate = math.sqrt(4) / 1000\n")
    g = defaults()
    configure(g, [path, '--max_iters=7', '--out_dir=cli'])
    assert g['batch_size'] == 32
    assert g['max_iters'] == 7 and g['out_dir'] == 'cli'  # later arguments win
    assert g['learning_rate'] == 0.002
    assert g['_private'] == 1 and g['os'] is os and '_tmp' not in g and 'math' not in g
    assert capsys.readouterr().out == ''  # quiet: a run stopped by a mistake prints its one line and nothing else


def test_override_then_config_file_in_order(tmp_path):
    path = write(tmp_path, "max_iters = 100\n")
    g = defaults()
    configure(g, ['--max_iters=7', path])
    assert g['max_iters'] == 100


def test_equals_sign_in_value():
    g = defaults()
    configure(g, ['--out_dir=a=b', '--init_from=x==y='])
    assert g['out_dir'] == 'a=b' and g['init_from'] == 'x==y='


def test_int_for_float_becomes_float(tmp_path):
    g = defaults()
    configure(g, ['--learning_rate=1'])
    assert g['learning_rate'] == 1.0 and type(g['learning_rate']) is float
    configure(g, [write(tmp_path, "learning_rate = 3\n")])
    assert type(g['learning_rate']) is float
    configure(g, ['--learning_rate=1e-3'])
    assert g['learning_rate'] == 1e-3


@pytest.mark.parametrize('text,value', [('True', True), ('true', True), ('1', True),
                                        ('False', False), ('false', False), ('0', False)])
def test_bool_spellings(text, value):
    g = defaults()
    configure(g, [f'--compile={text}', f'--dry_run={text}'])
    assert g['compile'] is value and g['dry_run'] is value


def test_none_default_takes_its_annotation():
    g = defaults()
    configure(g, ["--rope_scaling={'factor': 8.0}", '--window=4', "--kinds=['a', 'b']"])
    assert g['rope_scaling'] == {'factor': 8.0} and g['window'] == 4 and g['kinds'] == ['a', 'b']
    configure(g, ['--rope_scaling=None', '--window=None', '--kinds=None'])
    assert g['rope_scaling'] is None and g['window'] is None and g['kinds'] is None
    # without an annotation, a None default takes anything (a fork's new key)
    configure(g, ['--anything=llama3'])
    assert g['anything'] == 'llama3'


def test_a_tuple_for_a_list_key_becomes_a_list(tmp_path):
    g = defaults()
    configure(g, [write(tmp_path, "kinds = ('a', 'b')\nlayers = (3, 4)\n")])
    assert g['kinds'] == ['a', 'b'] and g['layers'] == [3, 4]


def test_every_none_default_of_every_script_says_what_it_takes():
    # train.py, eval.py, plan.py and sample.py: their keys as configure() sees them
    import ast as _ast
    for script in ('train.py', 'eval.py', 'plan.py', 'sample.py'):
        tree = _ast.parse(open(os.path.join(ROOT, script)).read())
        for node in tree.body:
            if isinstance(node, _ast.Assign) and isinstance(node.value, _ast.Constant):
                name = node.targets[0]
                untyped = node.value.value is None and isinstance(name, _ast.Name)
                assert not (untyped and name.id[0].islower()), f"{script}: {name.id} = None"


def test_str_default_kept_as_str():
    g = defaults()
    configure(g, ['--out_dir=123', '--init_from=resume'])
    assert g['out_dir'] == '123' and g['init_from'] == 'resume'
    configure(g, ['--out_dir=None', '--init_from=[1]'])
    assert g['out_dir'] == 'None' and g['init_from'] == '[1]'
    configure(g, ["--out_dir='quoted'", '--init_from='])
    assert g['out_dir'] == 'quoted' and g['init_from'] == ''


def test_containers():
    g = defaults()
    configure(g, ['--betas=(0.8, 0.99)', '--layers=[3]', "--extra={'b': 2}"])
    assert g['betas'] == (0.8, 0.99) and g['layers'] == [3] and g['extra'] == {'b': 2}


def test_help(capsys):
    with pytest.raises(SystemExit) as e:
        configure(defaults(), ['--max_iters=abc', '--help'])  # help wins over a mistake
    assert e.value.code in (0, None)
    out = capsys.readouterr().out
    assert '--max_iters=5000' in out and "--out_dir='out'" in out
    assert '_private' not in out and '--configure' not in out and '--os' not in out
    assert 'MEMORY_KNOBS' not in out and 'SCALE_GROWTH' not in out
    with pytest.raises(SystemExit) as e:
        configure(defaults(), ['-h'])
    assert e.value.code in (0, None)


# ---- mistakes: one 'error:' line, exit status 2 ----

def test_unknown_key_suggests(capsys):
    g = defaults()
    g['learning_rate'] = 6e-4
    err = error(capsys, ['--lerning_rate=1e-3'], g)
    assert err == "error: unknown config key 'lerning_rate' (did you mean 'learning_rate'?)"
    err = error(capsys, ['--zzzzzz=1'])
    assert err == "error: unknown config key 'zzzzzz'"


def test_private_and_module_names_are_not_keys(capsys):
    assert "'_private'" in error(capsys, ['--_private=2'])
    assert "'os'" in error(capsys, ['--os=2'])
    assert "'configure'" in error(capsys, ['--configure=2'])
    # an upper-case constant (one train.py imports: it once ended in a KeyError traceback)
    assert "unknown config key 'MEMORY_KNOBS'" in error(capsys, ["--MEMORY_KNOBS=('x',)"])
    assert "unknown config key 'SCALE_GROWTH'" in error(capsys, ['--SCALE_GROWTH=2'])


@pytest.mark.parametrize('arg,msg', [
    ('--max_iters=abc', "error: --max_iters expects int, got 'abc'"),
    ('--max_iters=1.5', "error: --max_iters expects int, got '1.5'"),
    ('--max_iters=True', "error: --max_iters expects int, got 'True'"),
    ('--learning_rate=fast', "error: --learning_rate expects float, got 'fast'"),
    ('--compile=yes', "error: --compile expects bool, got 'yes'"),
    ('--compile=2', "error: --compile expects bool, got '2'"),
    ('--betas=[0.9, 0.95]', "error: --betas expects tuple[float], got '[0.9, 0.95]'"),
    ('--max_iters=\n', "error: --max_iters expects int, got '\\n'"),
    # a None default's annotation, and a list's elements (the examples, on train.py's keys)
    ('--window=abc', "error: --window expects int | None, got 'abc'"),
    ('--window=True', "error: --window expects int | None, got 'True'"),
    ('--window=1.5', "error: --window expects int | None, got '1.5'"),
    ('--kinds=[[1],[2]]', "error: --kinds expects list[str] | None, got '[[1],[2]]'"),
    ("--kinds={0: 'a'}", "error: --kinds expects list[str] | None, got \"{0: 'a'}\""),
    ('--rope_scaling=llama3', "error: --rope_scaling expects dict | None, got 'llama3'"),
    ('--layers=[128.5]', "error: --layers expects list[int], got '[128.5]'"),
    ("--layers=['long']", "error: --layers expects list[int], got \"['long']\""),
    ('--betas=(0.9, True)', "error: --betas expects tuple[float], got '(0.9, True)'"),
    # numbers must be finite, inside containers too
    ('--learning_rate=1e999', "error: --learning_rate=1e999" + FINITE),
    ("--rope_scaling={'factor': 1e999}",
     "error: --rope_scaling={'factor': 1e999}" + FINITE),
    ('--betas=(0.9, -1e999)', "error: --betas=(0.9, -1e999)" + FINITE),
])
def test_wrong_type(capsys, arg, msg):
    assert error(capsys, [arg]) == msg


@pytest.mark.parametrize('arg', ['--max_iters', '-x', '--=3', '-', '--', '-max_iters=3'])
def test_malformed_argument(capsys, arg):
    err = error(capsys, [arg])
    assert err.startswith('error: malformed argument') and repr(arg) in err


def test_missing_config_file(capsys, tmp_path):
    path = str(tmp_path / 'nope.py')
    err = error(capsys, [path])
    assert path in err and 'No such file' in err
    err = error(capsys, [str(tmp_path)])  # a directory
    assert str(tmp_path) in err


def test_config_file_syntax_error(capsys, tmp_path):
    path = write(tmp_path, "batch_size = 4\nmax_iters = (\n")
    err = error(capsys, [path])
    assert err.startswith(f'error: {path}, line 2: syntax error')


def test_config_file_raises(capsys, tmp_path):
    path = write(tmp_path, "batch_size = 4\n\nmax_iters = 1 // 0\n")
    msg = 'ZeroDivisionError: integer division or modulo by zero'
    assert error(capsys, [path]) == f'error: {path}, line 3: {msg}'
    path = write(tmp_path, "def f():\n    raise ValueError('bad\\nvalue')\nf()\n", 'cfg2.py')
    assert error(capsys, [path]) == f'error: {path}, line 2: ValueError: bad value'
    path = write(tmp_path, "import no_such_module_xyz\n", 'cfg3.py')
    assert error(capsys, [path]).startswith(f'error: {path}, line 1: ModuleNotFoundError')


def test_config_file_raises_elsewhere_names_its_own_line(capsys, tmp_path, monkeypatch):
    # the error is in the config file's line that led to it, not deep in a module it imported
    write(tmp_path, "x = 1\n\n\nraise RuntimeError('boom')\n", 'helper_cfg_mod.py')
    monkeypatch.syspath_prepend(str(tmp_path))
    path = write(tmp_path, "batch_size = 4\nimport helper_cfg_mod\n")
    assert error(capsys, [path]) == f'error: {path}, line 2: RuntimeError: boom'


def test_config_file_unknown_key(capsys, tmp_path):
    path = write(tmp_path, "batch_size = 4\nmax_itres = 10\n")
    err = error(capsys, [path])
    assert err == f"error: {path}: unknown config key 'max_itres' (did you mean 'max_iters'?)"


def test_config_file_wrong_type(capsys, tmp_path):
    path = write(tmp_path, "max_iters = 'many'\n")
    assert error(capsys, [path]) == f"error: {path}: max_iters expects int, got 'many'"
    path = write(tmp_path, "compile = 'true'\n", 'cfg2.py')
    assert error(capsys, [path]) == f"error: {path}: compile expects bool, got 'true'"


def test_script_exits_cleanly(tmp_path):
    script = write(tmp_path, f"""import sys
sys.path.insert(0, {ROOT!r})
batch_size = 12
learning_rate = 6e-4
out_dir = 'out'
from configurator import configure
configure(globals())
print('trained', batch_size, learning_rate)
""", 'train.py')
    r = subprocess.run([sys.executable, script, '--batch_size=4', '--lerning_rate=1'],
                       capture_output=True, text=True, timeout=60)
    assert r.returncode == 2
    assert r.stderr.count('\n') == 1 and 'Traceback' not in r.stderr
    assert r.stderr == "error: unknown config key 'lerning_rate' (did you mean 'learning_rate'?)\n"
    assert 'trained' not in r.stdout


def test_config_file_nan_and_a_set_are_one_line(capsys, tmp_path):
    err = error(capsys, [write(tmp_path, "learning_rate = float('nan')\n")])
    assert err.endswith("learning_rate=nan" + FINITE), err
    err = error(capsys, [write(tmp_path, "anything = {1, 2}\n")])
    assert err.endswith("anything={1, 2}" + FINITE), err
