"""
The memory knobs: how a model's forward and backward run, never what they compute. A Knobs is a
model.LlamaConfig (the architecture, what a config.json holds) with the five keys the techniques
apply, so that the techniques, the memory formula (memory.py) and the planner (plan.py) read one
object, and model.py none of them:

  mlp_chunks        the MLP in mini-sequences of S/m tokens (chunked.py, after MST): its
                    intermediate activations 3·S·I·b bytes become 3·(S/m)·I·b; 1 off, 0 automatic
  loss_chunks       the LM head + loss in chunks of tokens (chunked.py): S·V fp32 logits become
                    (S/n)·V; 1 one chunk, 0 automatic
  attention_chunks  attention by head groups, one at a time (chunked.py, after UPipe): q, k, v and
                    the kernel's output for H/G heads at once; 1 off, 0 one group a kv head
  recompute         'none' | 'selective' (the MLP and the projections again in backward) | 'full'
                    (the block's forward again: one block input of S·h·b bytes kept) (offload.py)
  offload           Memo's alpha in [0, 1]: > 0 sends block inputs, attention's outputs and this
                    fraction of the rest to host memory, overlapped with compute (offload.py)

What they cost is compute, counted here beside them (hardware_flops): recompute re-runs forward,
+2·N + 4·q·P/T FLOPs a token for 'full' (N the non-embedding parameters with the LM head, P the
layers' (query, key) pairs in T tokens, q = H·hd the query width: model.flops_per_token), the MLP
and the projections for 'selective' (the attention kernel not); head groups run forward's
projections wq, wk, wv, wo (their matmuls; q and k's biases and norms are not counted) and the
kernel again, +2·L·h·(2q + 2kv) + 4·q·P/T.

The knobs are free to change between runs of one model (a resume, an evaluation): the checkpoint
keeps the architecture alone (checkpoint.py).
"""

from dataclasses import asdict, dataclass

from model import LlamaConfig, flops_per_token, num_params


@dataclass
class Knobs(LlamaConfig):
    mlp_chunks: int = 1
    loss_chunks: int = 1
    attention_chunks: int = 1
    recompute: str = 'none'
    offload: float = 0.0

    def __post_init__(self):
        super().__post_init__()
        # each knob's rule, as one line naming it (train.py stops on it before anything is built);
        # the three chunk counts share one
        rules = [(key, getattr(self, key) >= 0, 'must be >= 0 (0: automatic)')
                 for key in ('mlp_chunks', 'loss_chunks', 'attention_chunks')]
        rules += [
            ('offload', 0 <= self.offload <= 1, 'must be in [0, 1]'),
            ('recompute', self.recompute in ('none', 'full', 'selective'),
             "must be 'none', 'full' or 'selective'"),
            ('attention_chunks', self.n_kv_head % max(1, self.attention_chunks) == 0,
             f"must divide n_kv_head={self.n_kv_head} (a group: kv heads with their query heads)")]
        for key, ok, allowed in rules:
            if not ok:
                raise ValueError(f"{key}={getattr(self, key)!r}: {allowed}")


# the knobs' names, in the order Knobs declares them
KNOBS = tuple(Knobs.__annotations__)


def with_knobs(config, **knobs):
    """config (a LlamaConfig, or a Knobs whose knobs `knobs` replace) with the knobs `knobs`."""
    return Knobs(**{**asdict(config), **knobs})


def architecture(config):
    """config's LlamaConfig fields alone, as a dict (what a checkpoint keeps)."""
    return {k: v for k, v in asdict(config).items() if k not in KNOBS}


def hardware_flops(c, *lengths):
    """The FLOPs a trained token costs the kernels under c's knobs: model.flops_per_token (what
    MFU counts) plus what recompute and head groups run again (the header)."""
    model_flops = flops_per_token(c, *lengths)
    N = num_params(c, active=True)
    attn = model_flops - 6 * N  # attention's 12·q·P/T
    again = {'none': 0, 'full': 2 * N + attn / 3,
             'selective': 2 * (N - c.vocab_size * c.n_embd)}[c.recompute]
    if c.attention_chunks != 1:
        q, kv = c.n_head * c.head_dim, c.n_kv_head * c.head_dim
        again += 2 * c.n_layer * c.n_embd * (2 * q + 2 * kv) + attn / 3
    return model_flops + again
