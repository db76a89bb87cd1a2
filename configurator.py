"""
Poor man's configurator, after nanoGPT's, made safe. train.py keeps its config as plain globals
and calls configure(globals()); `python train.py config/x.py --batch_size=32 --out_dir=a=b` then
applies, in order, each config file (a Python file, exec'd on its own) and each --key=value (a
Python literal if it parses as one, else the raw string), and returns the config as a dict. Each
value must fit its default's type. The keys are the script's settings: its globals in lower case
holding plain values (numbers, strings, None, containers), never its constants, imports or
functions.

Every mistake is one 'error: ...' line on stderr and exit status 2, never a traceback: a typo in a
key must stop a run that would otherwise train for hours on the default, and a traceback buries the
one line that says what was wrong. train.py's own checks of the values (ranges, devices, data) stop
it through the same die(), and a collective that fails (a rank died or hung) through
collective_failed().
"""
import ast
import difflib
import json
import os
import sys
import time
import traceback
import typing
from contextlib import suppress
from datetime import timedelta
from pathlib import Path
from types import ModuleType, UnionType

_CONFIG_TYPES = (int, float, str, type(None), dict, list, tuple)  # bool is an int
REFUSED = object()  # what fit() returns for a value its key can't take (None is a value)
_BOOLS = {'True': True, 'true': True, '1': True, 'False': False, 'false': False, '0': False}


def die(msg):
    """Stop on a user's mistake: one line, exit status 2. Under torchrun every rank meets the same
    mistake: rank 0 alone says it, once every rank has come here (wait_for_every_rank: else torchrun
    could kill it before it does)."""
    if os.environ.get('RANK', '0') == '0':
        # one line, whatever msg holds: its lines joined by spaces
        print('error:', *str(msg).splitlines(), file=sys.stderr, flush=True)
    wait_for_every_rank('died')
    sys.exit(2)

def wait_for_every_rank(what, timeout=60):
    """Under torchrun, return once every rank reaches this call (or after `timeout` s): torchrun
    kills all ranks when one exits, so a rank stopping with a message waits for the others'
    (torchrun's TCP store: no process group)."""
    world = int(os.environ.get('WORLD_SIZE', 1))
    deadline = time.monotonic() + timeout
    if world == 1 or 'MASTER_ADDR' not in os.environ:
        return
    # (only a multi-rank job needs torch here, and has it imported already)
    import torch.distributed as dist
    key = f"nanolong/{os.environ.get('TORCHELASTIC_RESTART_COUNT', 0)}/{what}"
    with suppress(RuntimeError, ValueError):  # no store to reach (not torchrun): nobody to wait for
        store = dist.TCPStore(os.environ['MASTER_ADDR'], int(os.environ['MASTER_PORT']),
                              is_master=False, timeout=timedelta(seconds=timeout))
        store.add(key, 1)
        while store.add(key, 0) < world and time.monotonic() < deadline:
            time.sleep(0.05)

def collective_failed(e, timeout_s):
    """One line for a collective that raised: a rank died, or hung past timeout_s (gloo raises
    then; NCCL's watchdog aborts the process itself). Exit at once: a rank that hangs would never
    meet us in a barrier."""
    frames = traceback.extract_tb(e.__traceback__)
    if not frames[-1].filename.endswith('distributed_c10d.py'):
        raise e  # not a collective: a bug of ours, with its traceback
    # the frames of our files, the innermost three
    here = os.path.dirname(os.path.abspath(__file__))
    ours = [f.name for f in frames[::-1] if f.filename.startswith(here) and f.name[0] != '<']
    # gloo's message, without its source line: its first sentence
    why = str(e).strip().partition('] ')[-1].replace('. ', '\n').partition('\n')[0]
    print(f"error: rank {os.environ.get('RANK', 0)}: {frames[-1].name} "
          f"(from {' < '.join(ours[:3])}) failed: {why} "
          f"(timeout_s={timeout_s}: a rank died or stopped responding)",
          file=sys.stderr, flush=True)
    os._exit(3)

def check(cfg, rules):
    """Stop at the first value a key does not allow. rules: (keys, what is allowed, test) rows, the
    keys space-separated, the test a function of the value; every script's ranges are a table of
    them, so each mistake reads the same: `key=value: what is allowed`."""
    for keys, allowed, ok in rules:
        for key in keys.split():
            if not ok(cfg[key]):
                die(f"{key}={cfg[key]!r}: {allowed}")

def has_device(name):
    """False for 'cuda' on a CPU build, 'cuda:1' with one GPU, or a device type torch does not
    know."""
    import torch  # (here only: the configurator itself needs no torch)
    try:
        dev = torch.device(name)
    except RuntimeError:
        return False
    count = {'cpu': 1, 'mps': torch.backends.mps.is_available(),
             'cuda': torch.cuda.device_count()}
    return (dev.index or 0) < count.get(dev.type, 0)

def pick_device(name):
    """name, or for 'auto' the first of cuda, mps and cpu this machine has."""
    if name == 'auto':
        return next(n for n in ('cuda', 'mps', 'cpu') if has_device(n))
    return name

def writable(path):
    """Whether path is, or could be made, a directory we can write in; checked without creating
    it."""
    path = os.path.abspath(path)
    while not os.path.exists(path):
        path = os.path.dirname(path)
    return os.path.isdir(path) and os.access(path, os.W_OK)

def kind_of(default, hint):
    """The type a key takes: its annotation where the script gives one (`sliding_window: int | None
    = None`), else its default's; a container's default gives its elements' type too ([1024, 2048]:
    list[int]). None: a None default with no annotation, which takes anything."""
    if hint is not None:
        return hint
    if default is None:
        return None
    if isinstance(default, (list, tuple)) and default:
        return type(default)[type(default[0])]
    return type(default)

def fit(value, kind, raw):
    """value as type kind (int, list[int], int | None, ...), or REFUSED if it does not fit. raw:
    the command-line text; None from a file or inside a container."""
    if kind is None:
        return value
    if isinstance(kind, UnionType):  # int | None: the first arm the value fits
        for arm in typing.get_args(kind):
            new = fit(value, arm, raw)
            if new is not REFUSED:
                return new
        return REFUSED
    if kind is bool:  # before int, as bool is an int; repr makes a file's 1 '1'
        return _BOOLS.get(raw or repr(value), REFUSED)
    if kind is float and type(value) is int:
        return float(value)  # --learning_rate=1 means 1.0
    if kind is str and raw is not None:
        return value if isinstance(value, str) else raw  # --out_dir=123 is the directory '123'
    container = typing.get_origin(kind)
    if container is None:
        return value if type(value) is kind else REFUSED
    # list[int], tuple[float]: the container, then each element. A tuple for a list key becomes a
    # list: a checkpoint's JSON holds lists, and resuming compares the two
    if not isinstance(value, (list, tuple)) or (container is tuple and type(value) is list):
        return REFUSED
    new = [fit(v, typing.get_args(kind)[0], None) for v in value]
    if REFUSED in new:
        return REFUSED
    return container(new)

def override(g, defaults, key, value, raw, where=''):
    if key not in defaults:
        close = difflib.get_close_matches(key, defaults, n=1)
        hint = f" (did you mean {close[0]!r}?)" if close else ''
        die(f"{where}unknown config key {key!r}{hint}")
    kind = kind_of(defaults[key], g.get('__annotations__', {}).get(key))
    new = fit(value, kind, raw)
    name, got = (key, value) if raw is None else ('--' + key, raw)
    if new is REFUSED:
        # 'int', 'list[int]', 'int | None'
        allowed = str(kind).replace("<class '", '').replace("'>", '').replace('NoneType', 'None')
        die(f"{where}{name} expects {allowed}, got {got!r}")
    try:
        # the checkpoint's meta.json keeps every key: no inf or nan anywhere in the value (1e999
        # is inf: rope_theta=1e999 makes every RoPE frequency 0), and nothing JSON can't hold
        json.dumps(new, allow_nan=False)
    except (ValueError, TypeError):
        die(f"{where}{name}={got}: numbers must be finite (and values plain, as JSON holds them)")
    g[key] = new  # silently: a run with a mistake prints its one line and nothing else

def load(path, g, defaults):
    try:
        # bytes: compile() then honours coding cookies and reports bad encodings
        code = compile(Path(path).read_bytes(), path, 'exec')
    except OSError as e:  # missing, a directory, no permission
        die(f"cannot read config file {path}: {e.strerror}")
    except SyntaxError as e:
        die(f"{path}, line {e.lineno or '?'}: syntax error: {e.msg}")
    ns = {}  # fresh: a config file sees none of train.py, so it reads the same from anywhere
    try:
        exec(code, ns)
    except Exception as e:
        # the file's innermost line in the traceback
        lines = [fr.lineno for fr in traceback.extract_tb(e.__traceback__) if fr.filename == path]
        die(f"{path}, line {lines[-1] if lines else '?'}: {type(e).__name__}: {e}")
    for key, value in ns.items():
        if key[0] != '_' and not isinstance(value, ModuleType):  # skip `import math`
            override(g, defaults, key, value, None, f"{path}: ")

def configure(g, argv=None):
    """Apply the config files and --key=value of argv (the command line's) to the globals g; returns
    the config: {key: value} of every key."""
    if argv is None:
        argv = sys.argv[1:]
    # the defaults, before any override: every later value is checked against these types. The
    # keys are the script's own settings: its names in lower case holding plain values (not
    # _private, an imported module or function, or a constant in upper case: MEMORY_KNOBS)
    defaults = {k: v for k, v in g.items() if k[0].islower() and isinstance(v, _CONFIG_TYPES)}
    if '-h' in argv or '--help' in argv:
        print(f"usage: {sys.argv[0]} [config_file.py ...] [--key=value ...]\nkeys and defaults:",
              *[f"  --{k}={v!r}" for k, v in defaults.items()], sep='\n')
        sys.exit(0)
    for arg in argv:
        if not arg.startswith('-'):
            load(arg, g, defaults)
            continue
        key, eq, raw = arg[2:].partition('=')  # the first '=': values may hold more
        if not arg.startswith('--') or not key or not eq:
            die(f"malformed argument {arg!r}: expected --key=value or a config file path")
        value = raw  # --init_from=resume: a bare string, unless it parses as a literal
        with suppress(Exception):  # SyntaxError, ValueError, ...: not a literal
            value = ast.literal_eval(raw)
        override(g, defaults, key, value, raw)
    return {key: g[key] for key in defaults}
