"""knobs.py: the memory knobs beside the architecture, their rules, and the FLOPs they run again."""
import re
from dataclasses import asdict, fields, replace

import pytest

from knobs import KNOBS, Knobs, architecture, hardware_flops, with_knobs
from model import LlamaConfig, flops_per_token, num_params


def test_the_knobs_are_not_the_architecture():
    """LlamaConfig holds what a config.json holds; Knobs adds exactly the five knobs, and a
    checkpoint's architecture drops them."""
    assert not set(KNOBS) & {f.name for f in fields(LlamaConfig)}
    assert {f.name for f in fields(Knobs)} == {f.name for f in fields(LlamaConfig)} | set(KNOBS)
    k = with_knobs(LlamaConfig(n_layer=2), mlp_chunks=4, recompute='full')
    assert (k.n_layer, k.mlp_chunks, k.recompute, k.offload) == (2, 4, 'full', 0.0)
    assert architecture(k) == asdict(LlamaConfig(n_layer=2))
    # a Knobs' knobs are replaced, not doubled
    assert with_knobs(k, recompute='none').recompute == 'none'


@pytest.mark.parametrize('knob, value, line', [
    ('mlp_chunks', -1, 'mlp_chunks=-1: must be >= 0 (0: automatic)'),
    ('loss_chunks', -2, 'loss_chunks=-2: must be >= 0 (0: automatic)'),
    ('attention_chunks', 3, 'attention_chunks=3: must divide n_kv_head=4'),
    ('offload', 1.5, 'offload=1.5: must be in [0, 1]'),
    ('recompute', 'some', "recompute='some': must be 'none', 'full' or 'selective'")])
def test_a_bad_knob_is_one_line_naming_it(knob, value, line):
    with pytest.raises(ValueError, match=re.escape(line)):
        Knobs(**{knob: value})


def test_hardware_flops_add_what_the_knobs_run_again():
    """model.flops_per_token's 24480 + 1344 a token at S = 6 (tests/test_model.py's hand count); recompute
    'full' runs forward again: 2·N and a third of attention's 1344; 'selective' the matrices but the LM
    head's, 2·(N - V·h); head groups their projections (2·L·h·(2h + 2kv) = 3072) and attention's forward once
    more."""
    c = Knobs(n_layer=2, n_head=4, n_kv_head=2, n_embd=16, intermediate_size=24, vocab_size=10)
    N = num_params(c, active=True)
    assert N == 4080 and flops_per_token(c, 6) == 24480 + 1344
    assert hardware_flops(c, 6) == 24480 + 1344
    full = replace(c, recompute='full')
    assert hardware_flops(full, 6) == 24480 + 1344 + 2 * N + 448
    assert hardware_flops(replace(c, recompute='selective'), 6) == 24480 + 1344 + 2 * (N - 160)
    assert hardware_flops(replace(full, attention_chunks=0), 6) == 24480 + 1344 + 2 * N + 448 + 3072 + 448
    # the knobs change no model FLOP (MFU's count)
    assert flops_per_token(replace(full, attention_chunks=0), 6) == flops_per_token(c, 6)


def test_hardware_flops_of_a_qwen3_shaped_model_by_hand():
    """head_dim 8 of 4 heads, a query width of 32 = 2·n_embd, with q, k, v biases and q and k norms (issue 52):
    a block's N is 2·16 (norms) + 2·16·32 (wq, wo) + 2·16·16 (wk, wv) + 32 + 2·16 (biases) + 2·8 (q, k norms)
    = 1648 and 3·16·24 = 1152 (MLP); N = 2·(1648 + 1152) + 16 + 10·16 = 5776. Attention 12·H·hd = 384 FLOPs a
    pair, 2 layers of 21 pairs at S = 6: 2688 a token. Head groups re-run the projections' matmuls,
    2·L·h·(2·32 + 2·16) = 6144 (n_embd for the query width: 4608), and attention's forward (896)."""
    c = Knobs(n_layer=2, n_head=4, n_kv_head=2, n_embd=16, head_dim=8, intermediate_size=24, vocab_size=10,
              attention_bias=True, qk_norm=True)
    N = num_params(c, active=True)
    assert N == 5776 and flops_per_token(c, 6) == 6 * 5776 + 2688
    full = replace(c, recompute='full')
    assert hardware_flops(full, 6) == 6 * 5776 + 2688 + 2 * 5776 + 896
    assert hardware_flops(replace(c, recompute='selective'), 6) == 6 * 5776 + 2688 + 2 * (5776 - 160)
    assert hardware_flops(replace(full, attention_chunks=0), 6) == 6 * 5776 + 2688 + 2 * 5776 + 896 + 6144 + 896
