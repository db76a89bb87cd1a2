"""
Did the long context work? Two probes of a trained checkpoint (or a Hugging Face directory), run on
the GPUs and under the layout it trained on, each printed as a table and drawn in out_dir:

    python eval.py --out_dir=out-tiny                          # train.py's checkpoint, its keys
    torchrun --nproc_per_node=8 eval.py --out_dir=out-llama3-8b-node    # its 8-GPU layout
    python eval.py config/llama3_8b_node.py --dry_run=True      # does its eval fit? (a laptop)
    python eval.py --init_from=path/to/hf_llama --dataset=mydata --seq_len=8192 --out_dir=out-hf

- positions.svg, loss by position: the val split's mean loss per position bucket (0, 1, 2-3, 4-7,
  ... up to seq_len; with doc_mask a token's position in its document). The val loss is one number
  over all positions; a model that uses its context keeps lowering its loss at later positions,
  one that lost track of it (past the length it trained at, a RoPE scaling gone wrong) flattens or
  rises. The buckets' token-weighted mean is train.py's evaluate() val loss: the same batches, the
  same targets (tests/test_eval.py checks it).
- passkey.svg, passkey retrieval: filler text with "The pass key is NNNNN. Remember it. NNNNN is
  the pass key." at a depth (a fraction of the filler before it), then the question "What is the
  pass key? The pass key is". The idea is LongLoRA's passkey_retrivial.py (Chen et al. 2023,
  after Mohtashami & Jaggi's landmark attention).
- multikey<k>.svg, multi-key retrieval (RULER's niah_multikey, Hsieh et al. 2024): k needles
  "The pass key of <name> is NNNNN. ...", each with its own name and key, the question asking for
  one name's. Passkey over a repeated filler can be solved by copying the only number there is;
  here the model must find the needle whose name the question says.
  Accuracy per (prompt length, depth) of the asked needle, a heatmap each.

Retrieval is teacher-forced: one forward over prompt + answer (" NNNNN."), and a trial is right
when the model's argmax at every answer token is that token. That is greedy decoding's verdict
(were the argmaxes the answer, greedy would have written it; tests/test_eval.py checks it against
sample.generate, trial by trial), without a KV cache: a forward is what training runs, so the
length a layout trains at is the length it evaluates at. A length counts prompt and answer.

Under torchrun the model is built, sharded and wrapped as train.py does it (train.setup,
place_model: tp, sp, Ulysses, the ring and both at once, pp, ep, zero 2 / 3, states on host, every
memory knob), the checkpoint of any layout loaded through DCP into this rank's pieces. Every rank
draws the same global batch and scores its tokens: each loss and verdict comes from the rank
holding that token (cp's shard, dp's rows, the last pipeline stage, tp's rank 0 after the
vocabulary's shards agree), summed over the ranks. Equal to one process's, bucket by bucket and
trial by trial (the tests, on gloo).

Memory: a forward's, under no_grad: no activation is kept past its block, and the LM head runs a
chunk of at most MIN_CHUNK_TOKENS tokens at a time, never the [B, S, V] logits. So an evaluation
at the training layout and length fits where training did, with room to spare; `--dry_run=True`
measures its forward on fake tensors as train.py's dry run measures a step, beside the training
step's estimate (eval.memory.json in out_dir).

The keys are train.py's (seq_len, batch_size, dataset, doc_mask, eval_iters, seed, device, dtype,
the layout and the memory knobs) and the ones below. With a checkpoint the run's own keys are the
defaults, so the evaluation sees the data, batches, layout and chunking that training saw. A
retrieval forward holds batch_size rows a dp rank, a trial each.

(The run's own curves, loss, tokens/s and memory against the step, are train.py's curves.svg,
drawn at each evaluation by measure.write_curves.)
"""

import functools
import json
import math
import os
import random
from pathlib import Path

import torch
import torch.nn.functional as F
from tqdm import tqdm

import checkpoint
import chunked
import measure
import optim
import parallel
import pipeline
import train
from configurator import check, configure, die
from data.passkey.prompt import answer, multikey_prompt, passkey_prompt
from data.tokenizer import get_tokenizer

# -----------------------------------------------------------------------------
# our keys, beside train.py's: one command line sets both
EVAL_KEYS = dict(
    init_from='resume',  # 'resume' (out_dir's checkpoint) or a Hugging Face model directory
    passkey_lengths=[],  # prompt + answer lengths in tokens; []: seq_len / 2 and seq_len
    passkey_depths=[0.0, 0.25, 0.5, 0.75, 1.0],  # where the key sits: a fraction of the filler
    passkey_trials=5,  # prompts per (length, depth), each with its own key; 0: no retrieval
    multikey_needles=[4],  # the k of each multi-key test (k - 1 distractors); []: none
)
# (an empty default says nothing of its elements)
EVAL_TYPES = {'passkey_lengths': list[int], 'multikey_needles': list[int]}
EVAL_RULES = [  # configurator.check's rows, beside train.RULES
    ('passkey_trials', 'must be >= 0 (0: no retrieval test)', lambda v: v >= 0),
    ('passkey_depths', 'at least one depth, each in [0, 1], a fraction of the filler',
     lambda v: v and all(0 <= d <= 1 for d in v)),
    ('passkey_lengths', 'each a positive number of tokens', lambda v: all(n >= 1 for n in v)),
    ('multikey_needles', 'each a number of needles >= 1', lambda v: all(k >= 1 for k in v))]
# ' NNNNN.' is at most 7 tokens in any tokenizer (7 characters): a prompt leaves them room
ANSWER_ROOM = 7
# -----------------------------------------------------------------------------


def read_config(argv=None):
    """The config as a dict: train.py's defaults and ours, then (init_from='resume') the run's own
    config from its checkpoint, then the command line over all of it. It lives in train.py's
    globals: its setup, get_batch and evaluate read them there. A dry run reads no checkpoint."""
    g = vars(train)
    g.update(EVAL_KEYS, __annotations__={**g.get('__annotations__', {}), **EVAL_TYPES})
    cfg = configure(g, argv)
    if cfg['dry_run'] and cfg['init_from'] == 'resume':
        # the config's model, shapes only: as train.py's dry run
        g['init_from'] = cfg['init_from'] = 'scratch'
    elif cfg['init_from'] == 'resume':
        path = checkpoint.latest(cfg['out_dir'])
        if path is None:
            die(f"no checkpoint in {cfg['out_dir']} (train one first: python train.py)")
        # the run's keys, but it is this checkpoint we evaluate, wherever it was written
        g.update(checkpoint.meta(path)['config'], init_from='resume', out_dir=cfg['out_dir'])
        cfg = configure(g, argv)
    # before the loss pass: a mistake here would else come after minutes of it
    check(cfg, train.RULES + EVAL_RULES)
    return cfg


# ----------------------------------------------------------------------------- one forward, scored
@torch.no_grad()
def score(model, pipe, mesh, autocast, x, y, positions=None, docs=None):
    """(loss, right), each [B, S] like y, of this rank's shard of a batch: each target's
    cross-entropy and whether it is the argmax of the logits; (None, None) on a pipeline stage
    before the last. Under tp each rank's logits are its rows of the vocabulary: a target's logit
    is on one rank, the log-sum-exp and the largest logit are the ranks' together."""
    with autocast:
        if pipe is None:
            # the final norm's output, the hidden states the LM head reads: the head runs here
            # alone (the model's own loss would run it a second time)
            hidden = model(x, positions=positions, docs=docs, head=False)
        else:
            hidden = pipe.hidden(x, positions, docs, fake=train.dry_run)
    if hidden is None:
        return None, None
    # the head's weight, not its module (chunked.py swapped in a head that takes targets); under
    # FSDP2 the root's forward left it gathered. Its rows [first, first + real) of the
    # vocabulary; the rest is tp's padding
    weight = model.output.weight
    first = mesh.tp_rank * len(weight)
    real = max(0, min(len(weight), model.config.vocab_size - first))
    targets = y.flatten()
    ours = (targets >= first) & (targets < first + real)
    rows = torch.where(ours, targets - first, 0)
    # tokens a chunk: the loss_chunks key's chunks, at most MIN_CHUNK_TOKENS (with loss_chunks = 1
    # too: a long sequence's [B, S, V] fp32 logits never exist at once)
    N, c = targets.numel(), model.config
    chunks = train.loss_chunks or chunked.auto_loss_chunks(N, c.n_embd, c.vocab_size)
    per_chunk = min(math.ceil(N / chunks), chunked.MIN_CHUNK_TOKENS)
    stats = []  # [3, chunk] each: the log-sum-exp, the largest logit, the target's logit
    for h, r, o in zip(hidden.flatten(0, 1).split(per_chunk), rows.split(per_chunk),
                       ours.split(per_chunk)):
        with autocast:
            # this chunk's logits [chunk, real], the only ones that exist at a time
            logits = F.linear(h, weight[:real]).float()
        target = torch.where(o, logits.gather(1, r[:, None]).squeeze(1), 0)
        stats.append(torch.stack([logits.logsumexp(1), logits.amax(1), target]))
        # freed before the next chunk's are made
        del logits
    stats = torch.cat(stats, 1)
    if mesh.tp_group is not None:
        # every tp rank's [3, N], then the whole vocabulary's: the log-sum-exp of theirs, the
        # largest of theirs, the one target logit (the other ranks' are 0)
        every = parallel.all_gather(stats, 0, mesh.tp_group).view(mesh.tp, 3, N)
        stats = torch.stack([every[:, 0].logsumexp(0), every[:, 1].amax(0), every[:, 2].sum(0)])
    lse, top, target = stats
    return (lse - target).view_as(y), (target >= top).view_as(y)


def total(t, mesh):
    """t summed over the ranks: each token counted once, by the ranks that hold different tokens
    (dp's rows, cp's shards; a pipeline stage before the last adds zeros), tp's rank 0 for its
    group (its ranks hold the same tokens)."""
    if mesh.world == 1:
        return t
    if mesh.tp_rank > 0:
        t = torch.zeros_like(t)
    return parallel.all_reduce(t, None)


# ----------------------------------------------------------------------------- loss by position
def loss_by_position(model, pipe, mesh, meta, autocast, dev):
    """[2, buckets] fp64: the losses of the real targets in each position bucket, added, and their
    number, over evaluate()'s batches (from its seed: the same ones), every rank's. Bucket k holds
    positions 2^(k-1) to 2^k - 1 (position 0 alone in bucket 0): log-spaced, a position's bit
    length. With doc_mask a target's position is its input's place in its document: what of it
    the model saw."""
    generator = torch.Generator().manual_seed(train.seed + 1)
    sums = torch.zeros(2, (train.seq_len - 1).bit_length() + 1, dtype=torch.float64)
    for _ in tqdm(range(train.eval_iters), 'loss by position', disable=mesh.rank > 0):
        batch = train.get_batch(meta, 'val', train.batch_size * mesh.dp, generator, dev)
        # our dp rank's rows, our cp rank's tokens and their positions (one process: all of it)
        x, y, positions, docs = parallel.shard_batch(mesh, *batch)
        loss, _ = score(model, pipe, mesh, autocast, x, y, positions, docs)
        if loss is None:  # pp: the last stage's
            continue
        if positions is None:
            positions = torch.arange(y.shape[1], device=dev)
        real = y != -100
        # the bit length of each position: frexp's exponent (p = m 2^e, m in [0.5, 1); 0 for 0)
        bucket = torch.frexp(positions.expand_as(y)[real].double()).exponent
        sums[0] += torch.bincount(bucket, loss[real].double(), len(sums[0])).cpu()
        sums[1] += torch.bincount(bucket, minlength=len(sums[0])).cpu()
    return total(sums, mesh)


# ----------------------------------------------------------------------------- retrieval
def passkey_trial(encode, length, depth, rng):
    """A passkey prompt of `length` tokens with its own key, and its answer's ids."""
    key = rng.randint(10000, 99999)
    return passkey_prompt(encode, length, depth, key), answer(encode, key)


def multikey_trial(encode, length, depth, rng, k):
    """A multi-key prompt of `length` tokens, k needles, and the asked one's answer's ids."""
    ids, key = multikey_prompt(encode, length, depth, k, rng)
    return ids, answer(encode, key)


@torch.no_grad()
def wrong_tokens(model, pipe, mesh, autocast, trials, length):
    """For each trial (prompt ids, answer ids), teacher-forced: how many of its answer tokens are
    not the model's argmax there (0: right). batch_size rows a dp rank a forward: x = prompt +
    answer, then zeros to `length` tokens; targets only the answer's (spare rows repeat the last
    trial)."""
    dev = next(model.parameters()).device
    n = train.batch_size * mesh.dp  # rows a forward
    wrong = []
    for first in range(0, len(trials), n):
        batch = trials[first:first + n]
        count = len(batch)
        batch = batch + batch[-1:] * (n - count)
        x = torch.zeros(n, length + 1, dtype=torch.long)
        y = torch.full((n, length), -100)
        for i, (prompt, ids) in enumerate(batch):
            seq = prompt + ids
            x[i, :len(seq)] = torch.tensor(seq)
            # the targets of the inputs before each answer token
            y[i, len(prompt) - 1:len(seq) - 1] = torch.tensor(ids)
        x, y, positions, _ = parallel.shard_batch(mesh, x[:, :-1].to(dev), y.to(dev))
        # a row each, ours in our dp rank's rows: summed over the ranks, every row's
        rows = torch.zeros(n, dtype=torch.float64)
        hit = score(model, pipe, mesh, autocast, x, y, positions)[1]
        if hit is not None:
            mine = len(y) * mesh.dp_rank
            rows[mine:mine + len(y)] = ((y != -100) & ~hit).sum(1).cpu().double()
        wrong += total(rows, mesh)[:count].int().tolist()
    return wrong


def retrieval(model, pipe, mesh, autocast, make, lengths, depths, trials, what):
    """wrong_tokens [depths][lengths][trials] of `trials` prompts a cell, made by
    make(length, depth, rng), each with its own key. Each cell draws from its own seed: its keys
    are the same whatever other lengths and depths a run asks for."""
    wrong = [[] for _ in depths]
    for length in tqdm(lengths, f'{what}, by length', disable=mesh.rank > 0):
        for i, depth in enumerate(depths):
            rng = random.Random(f'{train.seed} {length} {depth}')
            made = [make(length + 1 - ANSWER_ROOM, depth, rng) for _ in range(trials)]
            wrong[i].append(wrong_tokens(model, pipe, mesh, autocast, made, length))
    return wrong


# ----------------------------------------------------------------------------- the heatmap
def write_heatmap(path, accuracy, lengths, depths, what):
    """A cell per (depth, length), red at 0% to green at 100%, its figure in it. Hand-written SVG,
    as measure.py's pictures: any browser shows it."""
    out = [f'<svg xmlns="http://www.w3.org/2000/svg" width="{max(60 * len(lengths) + 80, 340)}" '
           f'height="{60 * len(depths) + 50}" font-family="sans-serif" font-size="12">',
           f'<text x="4" y="14">{what} accuracy: depth down, length (tokens) across</text>']
    for j, length in enumerate(lengths):
        out.append(f'<text x="{60 * j + 70}" y="{60 * len(depths) + 45}">{length}</text>')
    for i, depth in enumerate(depths):
        out.append(f'<text x="4" y="{60 * i + 55}">{depth:g}</text>')
        for j, a in enumerate(accuracy[i].tolist()):
            out.append(f'<rect x="{60 * j + 60}" y="{60 * i + 25}" width="60" height="60" '
                       f'fill="hsl({120 * a:.0f},70%,60%)"/>')
            out.append(f'<text x="{60 * j + 75}" y="{60 * i + 55}">{a:.0%}</text>')
    Path(path).write_text('\n'.join(out + ['</svg>']) + '\n')


# -----------------------------------------------------------------------------
def dry_run_forward(mem, config, model, pipe, weights, mesh, autocast):
    """One forward of a batch of the training length on fake tensors, scored, measured beside the
    training step's estimate (train.py's dry run; a pipeline's last stage in a process of its
    own, as there)."""
    if mesh.rank == 0:
        print(f"eval dry run: one forward of {train.batch_size} x {train.seq_len} tokens a dp "
              f"rank, scored (the training step's estimate beside it)")
    batch = parallel.shard_batch(mesh, *measure.fake_batch(
        train.batch_size * mesh.dp, train.seq_len, config.vocab_size, train.doc_mask))
    with mem.measure(pipe or model, weights.masters, weights):
        score(model, pipe, mesh, autocast, *batch)
    if mesh.pp > 1 and mesh.pp_rank == 0 and 'RANK' not in os.environ:
        measure.rerun(mesh.world - 1, f"the last pipeline stage (rank {mesh.world - 1})")


def main():
    cfg = read_config()
    dev, ptdtype, autocast, rank, meta, config, ckpt, mesh, mem, model = train.setup(cfg)
    # a length every rank's shard divides: sp's tp, Ulysses' and the ring's two chunks a rank
    m = mesh.tp * mesh.cp * (1 + (mesh.cp_ring > 1))
    lengths = cfg['passkey_lengths'] or [train.seq_len // 2 // m * m, train.seq_len]
    tests = []  # (name, make)
    if cfg['passkey_trials'] and not train.dry_run:
        encode = get_tokenizer(meta)[0]
        tests.append(('passkey', functools.partial(passkey_trial, encode)))
        for k in cfg['multikey_needles']:
            tests.append((f'multikey{k}', functools.partial(multikey_trial, encode, k=k)))
    for n in lengths:  # said before any work: a ValueError (one line)
        if n % m:
            raise ValueError(f"passkey length {n}: this layout splits a sequence into {m} equal "
                             f"shards: a multiple of {m}")
    checked = []  # (name, make, the lengths its prompt fits in)
    for what, make in tests:
        fits = []
        for n in lengths:
            try:
                make(n + 1 - ANSWER_ROOM, 0.0, random.Random(0))
            except ValueError as e:  # (its length: the prompt's, the answer's room taken)
                if cfg['passkey_lengths']:  # lengths the user asked for: each one run
                    raise ValueError(f"{what} at length {n}: {e}") from None
                if rank == 0:  # the default lengths: those a short run's seq_len can't hold
                    print(f"{what}: not at length {n} ({e})")
                continue
            fits.append(n)
        if fits:
            checked.append((what, make, fits))
    out = Path(train.out_dir)
    out.mkdir(parents=True, exist_ok=True)
    if train.dry_run:
        mem.name = 'eval.' + mem.name
        mem.check(config)  # the training step's estimate, printed
    train.place_model(model, config, mesh, dev, ptdtype)
    # every weight of this rank, loaded as a run's (no optimizer: only the weights' keys)
    named = list(model.named_parameters())
    params = [p for _, p in named]
    weights = optim.MasterWeights(named, params, [parallel.local(p) for p in params], [], mesh,
                                  config)
    pipe = None
    if mesh.pp > 1:
        # forward only, the stages in turn (Pipeline.hidden): no schedule runs, any takes one batch
        pipe = pipeline.Pipeline(model, mesh, 'gpipe', 1, autocast, dev)
    if train.dry_run:
        return dry_run_forward(mem, config, model, pipe, weights, mesh, autocast)
    if ckpt:  # a bf16 run's fp32 masters into our weights (checkpoint.load)
        checkpoint.load(ckpt['path'], model, weights, mesh)
    model.eval()

    sums, counts = loss_by_position(model, pipe, mesh, meta, autocast, dev)
    # the buckets up to the last one holding a target (past it: none)
    means = (sums / counts)[:int(counts.nonzero().max()) + 1].tolist()
    # eval.json: every figure, each trial's wrong tokens (the tests compare layouts by it)
    report = {'val_loss': (sums.sum() / counts.sum()).item(), 'positions': means}
    if rank == 0:
        print(f"val loss {report['val_loss']:.4f} (evaluate()'s), by position:")
        # (no bucket below the last is empty: a target at position p has 0 .. p - 1 before it)
        for k, mean in enumerate(means):
            print(f'{2 ** k // 2:>9} to {2 ** k - 1:<9} {mean:.4f}')
        measure.write_lines(out / 'positions.svg',
                            [('val loss by bit length of the position', [list(enumerate(means))])])
    depths = cfg['passkey_depths']
    for what, make, lengths in checked:
        wrong = retrieval(model, pipe, mesh, autocast, make, lengths, depths,
                          cfg['passkey_trials'], what)
        # a trial is right when none of its answer tokens is wrong
        accuracy = (torch.tensor(wrong) == 0).double().mean(-1)
        report[what] = {'lengths': lengths, 'depths': depths, 'accuracy': accuracy.tolist(),
                        'wrong_tokens': wrong}
        if rank == 0:
            print(f'{what} accuracy', 'depth \\ length', *lengths, sep='\t')
            for depth, row in zip(depths, accuracy.tolist()):
                print('', depth, *[f'{a:.0%}' for a in row], sep='\t')
            write_heatmap(out / f'{what}.svg', accuracy, lengths, depths, what)
    if rank == 0:
        (out / 'eval.json').write_text(json.dumps(report, indent=1))


if __name__ == '__main__':
    try:
        main()
    # a damaged checkpoint, a Hugging Face directory's bad files, data made by another
    # tokenizer, a prompt too short or a length the layout can't split: the user's, one line
    except (checkpoint.Error, ValueError) as e:
        die(e)
    if torch.distributed.is_initialized():  # (as train.py ends: else gloo may abort at exit)
        torch.distributed.destroy_process_group()
