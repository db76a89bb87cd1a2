"""model.py against transformers' LlamaForCausalLM: logits, loss, checkpoint loading both ways."""
import json
import os
import weakref
from dataclasses import replace

import numpy as np
import pytest
import torch
import torch.nn.functional as F
import transformers
from safetensors.torch import save_file
from torch.utils._python_dispatch import TorchDispatchMode

from conftest import cuda, packed_batch
from model import Llama, LlamaConfig
from rope import apply_rope, rope_frequencies, rope_tables

LLAMA3_ROPE = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
               "high_freq_factor": 4.0, "original_max_position_embeddings": 64}


def rel_err(a, b):
    return ((a - b).norm() / b.norm()).item()


def hf_model(n_kv_head=2, tie=False, rope_scaling=None, vocab=211, seed=0, theta=500000.0):
    torch.manual_seed(seed)
    cfg = transformers.LlamaConfig(
        hidden_size=64, intermediate_size=160, num_attention_heads=4, num_key_value_heads=n_kv_head,
        num_hidden_layers=2, vocab_size=vocab, rms_norm_eps=1e-5, max_position_embeddings=256,
        rope_theta=theta, tie_word_embeddings=tie,
        rope_scaling=dict(rope_scaling) if rope_scaling else None,  # a copy: transformers edits it
        attn_implementation='eager')
    m = transformers.LlamaForCausalLM(cfg).float().eval()
    with torch.no_grad():  # HF inits norms to one: perturb them so the mapping is really tested
        for name, p in m.named_parameters():
            if 'norm' in name:
                p.add_(0.1 * torch.randn_like(p))
    return m


@pytest.mark.parametrize('n_kv_head,tie,rope', [
    (2, False, None), (1, False, None), (4, True, None), (2, False, LLAMA3_ROPE), (1, True, LLAMA3_ROPE)])
def test_logits_and_loss_match_transformers(tmp_path, n_kv_head, tie, rope):
    hf = hf_model(n_kv_head, tie, rope)
    hf.save_pretrained(tmp_path)
    ours = Llama.from_pretrained(tmp_path).eval()
    assert ours.config.n_kv_head == n_kv_head and ours.config.tie_embeddings == tie
    idx = torch.randint(0, 211, (2, 100))  # 100 > original_max_position_embeddings: scaling matters
    targets = idx.roll(-1, 1)
    targets[0, :7] = -100
    with torch.no_grad():
        ref = hf(idx, labels=None).logits
        logits = ours(idx)
        _, loss = ours(idx, targets)
    assert rel_err(logits, ref) < 1e-5
    ref_loss = F.cross_entropy(ref.flatten(0, 1), targets.flatten(), ignore_index=-100)
    assert abs(loss.item() - ref_loss.item()) < 1e-5 * ref_loss.item()


def test_rope_parameters_and_rope_scaling_forms_load_alike(tmp_path):
    hf = hf_model(2, False, LLAMA3_ROPE)
    hf.save_pretrained(tmp_path / 'new')
    config = json.loads((tmp_path / 'new' / 'config.json').read_text())
    assert 'rope_parameters' in config  # transformers 5 writes the new form
    # the hub's older form: rope_theta at the top level, rope_scaling with a 'type' key
    old = dict(config)
    params = old.pop('rope_parameters')
    old['rope_theta'] = params.pop('rope_theta')
    params['type'] = params.pop('rope_type')
    old['rope_scaling'] = params
    os.makedirs(tmp_path / 'old')
    (tmp_path / 'old' / 'config.json').write_text(json.dumps(old))
    os.link(tmp_path / 'new' / 'model.safetensors', tmp_path / 'old' / 'model.safetensors')
    a, b = Llama.from_pretrained(tmp_path / 'new'), Llama.from_pretrained(tmp_path / 'old')
    assert a.config == b.config and a.config.rope_theta == 500000.0
    idx = torch.randint(0, 211, (1, 90))
    assert torch.equal(a(idx), b(idx))


def test_sharded_safetensors_with_index(tmp_path):
    hf = hf_model(2, False, None)
    hf.save_pretrained(tmp_path / 'one')
    ours = Llama.from_pretrained(tmp_path / 'one')
    # split the checkpoint in two shards with an index, as the hub stores big models
    state = {k: v.contiguous() for k, v in hf.state_dict().items()}
    keys = sorted(state)
    shards = {'model-00001-of-00002.safetensors': keys[::2], 'model-00002-of-00002.safetensors': keys[1::2]}
    d = tmp_path / 'sharded'
    os.makedirs(d)
    weight_map = {}
    for fname, names in shards.items():
        save_file({k: state[k] for k in names}, d / fname)
        weight_map.update({k: fname for k in names})
    (d / 'model.safetensors.index.json').write_text(json.dumps({'metadata': {}, 'weight_map': weight_map}))
    (d / 'config.json').write_text((tmp_path / 'one' / 'config.json').read_text())
    sharded = Llama.from_pretrained(d)
    idx = torch.randint(0, 211, (1, 33))
    assert torch.equal(ours(idx), sharded(idx))


@pytest.mark.parametrize('tie,rope', [(False, None), (True, LLAMA3_ROPE)])
def test_save_pretrained_round_trip_through_transformers(tmp_path, tie, rope):
    torch.manual_seed(1)
    ours = Llama(LlamaConfig(n_layer=2, n_head=4, n_kv_head=2, n_embd=64, intermediate_size=96,
                             vocab_size=123, rope_theta=10000.0, rope_scaling=rope, tie_embeddings=tie))
    ours.save_pretrained(tmp_path)
    hf = transformers.LlamaForCausalLM.from_pretrained(tmp_path, attn_implementation='eager').float()
    idx = torch.randint(0, 123, (2, 80))
    with torch.no_grad():
        assert rel_err(ours(idx), hf(idx).logits) < 1e-5
    again = Llama.from_pretrained(tmp_path)
    assert torch.equal(again(idx), ours(idx))


def hf_mixtral(seed=0, **windows):
    """A tiny MixtralForCausalLM as transformers makes it (config.json's head_dim null); `windows`: its
    sliding_window (default None: none)."""
    torch.manual_seed(seed)
    cfg = transformers.MixtralConfig(
        hidden_size=64, intermediate_size=96, num_attention_heads=4, num_key_value_heads=2, num_hidden_layers=2,
        vocab_size=128, num_local_experts=4, num_experts_per_tok=2, rms_norm_eps=1e-5, attn_implementation='eager',
        **windows)
    m = transformers.MixtralForCausalLM(cfg).float().eval()
    with torch.no_grad():  # as hf_model: norms off one
        for name, p in m.named_parameters():
            if 'norm' in name:
                p.add_(0.1 * torch.randn_like(p))
    return m


def test_mixtral_loads_from_shards_and_exports_to_the_same_logits(tmp_path):
    hf = hf_mixtral()
    hf.save_pretrained(tmp_path / 'hf', max_shard_size='100KB')  # shards and an index, as the hub's
    assert (tmp_path / 'hf' / 'model.safetensors.index.json').exists()
    assert json.loads((tmp_path / 'hf' / 'config.json').read_text())['head_dim'] is None
    ours = Llama.from_pretrained(tmp_path / 'hf').eval()
    c = ours.config
    assert (c.n_experts, c.experts_per_token, c.router_aux_loss_coef) == (4, 2, hf.config.router_aux_loss_coef)
    idx = torch.randint(0, 128, (2, 50))
    with torch.no_grad():
        ref = hf(idx).logits
        assert rel_err(ours(idx), ref) < 1e-5
    ours.save_pretrained(tmp_path / 'export')
    theirs = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / 'export', attn_implementation='eager')
    assert type(theirs) is transformers.MixtralForCausalLM
    with torch.no_grad():
        assert rel_err(theirs.float()(idx).logits, ref) < 1e-5


NOT_OURS = ("is not a Llama (nanolong reads 'llama', 'mistral', 'ministral', 'mixtral', 'qwen2', 'qwen3', "
            "'qwen3_moe')")


@pytest.mark.parametrize('model_type,edit,message', [
    ('qwen2_moe', {}, f"model_type 'qwen2_moe' {NOT_OURS}"),  # shared experts
    ('gemma', {}, f"model_type 'gemma' {NOT_OURS}"),  # (1 + w) norms
    ('mistral', {'sliding_window': -1}, "sliding_window=-1: must be >= 0"),
    ('ministral', {'layer_types': ['sliding_attention'] * 3}, "layer_types=['sliding_attention', "
     "'sliding_attention', 'sliding_attention']: must be None or n_layer=32 of 'sliding_attention', 'full_attention'")],
    ids=['qwen2_moe', 'gemma', 'mistral window -1', 'ministral layer_types too short'])
def test_other_families_are_refused_in_one_line_naming_them(tmp_path, model_type, edit, message):
    transformers.AutoConfig.for_model(model_type).save_pretrained(tmp_path)  # config.json is enough
    config = json.loads((tmp_path / 'config.json').read_text())
    (tmp_path / 'config.json').write_text(json.dumps({**config, **edit}))
    with pytest.raises(ValueError) as e:
        Llama.from_pretrained(tmp_path)
    assert str(e.value) == f"{tmp_path / 'config.json'}: {message}"


# ----------------------------------------------------------------------------- sliding windows: Mistral, Ministral, Mixtral
# transformers' rule (masking_utils.sliding_window_overlay on the causal mask): query i sees key j when
# 0 <= i - j < sliding_window. A window of 5 at 16 tokens: most queries see 5 keys, not all of theirs.
WINDOW, SEQ = 5, 16


def hf_windowed(family, seed=0, **windows):
    """A tiny MistralForCausalLM or MinistralForCausalLM (GQA, fp32, eager attention), norms off one, with
    `windows`: sliding_window and (Ministral) layer_types."""
    torch.manual_seed(seed)
    config_class = {'mistral': transformers.MistralConfig, 'ministral': transformers.MinistralConfig}[family]
    cfg = config_class(hidden_size=64, intermediate_size=96, num_attention_heads=4, num_key_value_heads=2,
                       head_dim=16, num_hidden_layers=2, vocab_size=128, rms_norm_eps=1e-5, rope_theta=10000.0,
                       attn_implementation='eager', **windows)
    m = transformers.AutoModelForCausalLM.from_config(cfg).float().eval()
    with torch.no_grad():
        for name, p in m.named_parameters():
            if 'norm' in name:
                p.add_(0.1 * torch.randn_like(p))
    return m


def both_ways(tmp_path, hf, architecture):
    """hf saved and loaded by Llama.from_pretrained, ours saved and loaded by transformers' AutoModel: each
    one's logits the transformers model's within 1e-5 (and the window really changes them); ours reads back
    its own export to the bit. Returns ours."""
    hf.save_pretrained(tmp_path / 'hf')
    ours = Llama.from_pretrained(tmp_path / 'hf').eval()
    idx = torch.randint(0, 128, (2, SEQ))
    with torch.no_grad():
        ref = hf(idx).logits
        assert rel_err(ours(idx), ref) < 1e-5
        unwindowed = Llama.from_pretrained(tmp_path / 'hf', sliding_window=0, layer_types=None)
        assert rel_err(unwindowed(idx), ref) > 1e-2  # the window matters at this length
        ours.save_pretrained(tmp_path / 'export')
        theirs = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / 'export', attn_implementation='eager')
        assert type(theirs) is architecture
        assert rel_err(theirs.float()(idx).logits, ref) < 1e-5
        again = Llama.from_pretrained(tmp_path / 'export')
        assert again.config == ours.config and torch.equal(again(idx), ours(idx))
    return ours


def test_mistral_with_a_window_loads_and_exports_to_the_same_logits(tmp_path):
    ours = both_ways(tmp_path, hf_windowed('mistral', sliding_window=WINDOW), transformers.MistralForCausalLM)
    assert (ours.config.sliding_window, ours.config.layer_types, ours.config.n_kv_head) == (WINDOW, None, 2)
    config = json.loads((tmp_path / 'export' / 'config.json').read_text())
    assert (config['model_type'], config['architectures'], config['sliding_window']) == (
        'mistral', ['MistralForCausalLM'], WINDOW)
    assert 'layer_types' not in config


def test_mixtral_with_a_window_loads_and_exports_to_the_same_logits(tmp_path):
    ours = both_ways(tmp_path, hf_mixtral(sliding_window=WINDOW), transformers.MixtralForCausalLM)
    assert (ours.config.sliding_window, ours.config.n_experts) == (WINDOW, 4)
    assert json.loads((tmp_path / 'export' / 'config.json').read_text())['sliding_window'] == WINDOW


def test_a_mix_of_windowed_and_full_layers_is_ministral_both_ways(tmp_path):
    """transformers' Llama, Mistral and Mixtral read no layer_types; Ministral (a Llama with layer_types, its
    modeling file otherwise Mistral's) does: a mix is read from and written as Ministral."""
    mix = ['full_attention', 'sliding_attention']
    hf = hf_windowed('ministral', sliding_window=WINDOW, layer_types=mix)
    ours = both_ways(tmp_path, hf, transformers.MinistralForCausalLM)
    assert (ours.config.sliding_window, ours.config.layer_types) == (WINDOW, mix)
    assert [block.attention.window for block in ours.layers.values()] == [0, WINDOW]
    config = json.loads((tmp_path / 'export' / 'config.json').read_text())
    assert (config['model_type'], config['layer_types']) == ('ministral', mix)


def test_window_keys_are_read_as_transformers_auto_model_reads_them(tmp_path):
    """LlamaForCausalLM reads neither sliding_window nor layer_types (full attention); MixtralForCausalLM reads
    no layer_types (every layer windowed); AutoConfig reads a 'mistral' config.json with layer_types as Ministral's
    (MistralForCausalLM itself would ignore them); a Mistral config.json that leaves sliding_window out has
    transformers' default, 4096; a null one is no window."""
    mix = ['full_attention', 'sliding_attention']
    cases = {'llama': (hf_model(vocab=128), {'sliding_window': WINDOW, 'layer_types': mix}, 0, None),
             'mixtral': (hf_mixtral(sliding_window=WINDOW), {'layer_types': mix}, WINDOW, None),
             'mistral': (hf_windowed('mistral', sliding_window=WINDOW), {'layer_types': mix}, WINDOW, mix),
             'mistral without the key': (hf_windowed('mistral'), {'sliding_window': 'left out'}, 4096, None),
             'mistral null': (hf_windowed('mistral'), {'sliding_window': None}, 0, None)}
    idx = torch.randint(0, 128, (2, SEQ))
    for name, (hf, edit, window, layer_types) in cases.items():
        d = tmp_path / name
        hf.save_pretrained(d)
        config = {**json.loads((d / 'config.json').read_text()), **edit}
        if edit.get('sliding_window') == 'left out':
            del config['sliding_window']
        (d / 'config.json').write_text(json.dumps(config))
        theirs = transformers.AutoModelForCausalLM.from_pretrained(d, attn_implementation='eager').float()
        ours = Llama.from_pretrained(d)
        assert (ours.config.sliding_window, ours.config.layer_types) == (window, layer_types), name
        if name == 'mistral without the key':  # (16 tokens can't tell 4096 from no window: the config can)
            assert theirs.config.sliding_window == 4096
        with torch.no_grad():
            assert rel_err(ours(idx), theirs(idx).logits) < 1e-5, name


def test_a_mix_under_mixtral_is_refused_in_one_line_before_anything_is_written(tmp_path):
    """Mixtral windows every layer or none, and transformers has no Mixtral that reads layer_types."""
    config = LlamaConfig(n_layer=2, n_experts=4, sliding_window=WINDOW, layer_types=['sliding_attention',
                                                                                       'full_attention'])
    with pytest.raises(ValueError, match=r'^layer_types, dense_layers, norm_topk_prob=False: Mixtral has none'):
        Llama(config).save_pretrained(tmp_path / 'export')
    assert not (tmp_path / 'export').exists()


def test_no_window_anywhere_exports_a_plain_llama(tmp_path):
    """A window no layer uses (every layer 'full_attention') is a Llama's config.json, as with no window."""
    config = LlamaConfig(n_layer=2, sliding_window=WINDOW, layer_types=['full_attention'] * 2)
    Llama(config).save_pretrained(tmp_path / 'windowless')
    Llama(replace(config, sliding_window=0, layer_types=None)).save_pretrained(tmp_path / 'plain')
    assert (tmp_path / 'windowless' / 'config.json').read_text() == (tmp_path / 'plain' / 'config.json').read_text()
    assert json.loads((tmp_path / 'plain' / 'config.json').read_text())['model_type'] == 'llama'


@pytest.mark.parametrize('fields,message', [
    ({'sliding_window': -1}, "sliding_window=-1: must be >= 0"),
    ({'sliding_window': 4, 'layer_types': ['sliding_attention'] * 3},
     "layer_types=['sliding_attention', 'sliding_attention', 'sliding_attention']: must be None or n_layer=2 of "
     "'sliding_attention', 'full_attention'"),
    ({'sliding_window': 4, 'layer_types': ['sliding_attention', 'chunked_attention']},
     "layer_types=['sliding_attention', 'chunked_attention']: must be None or n_layer=2 of 'sliding_attention', "
     "'full_attention'"),
    ({'layer_types': ['sliding_attention', 'full_attention']},
     "sliding_window=0: must be > 0 where layer_types has 'sliding_attention'")],
    ids=['negative window', 'layer_types too long', 'unknown layer type', 'sliding layer without a window'])
def test_a_bad_window_is_one_line_naming_it(fields, message):
    with pytest.raises(ValueError) as e:
        LlamaConfig(n_layer=2, **fields)
    assert str(e.value) == message


# a checkpoint's context extended: S = 100 tokens, past the original 32 of every scaling
EXTENSIONS = {
    'rope_theta': (2e6, None),
    'linear': (10000.0, {'rope_type': 'linear', 'factor': 4.0}),
    'llama3': (500000.0, {**LLAMA3_ROPE, 'original_max_position_embeddings': 32}),
    'yarn': (10000.0, {'rope_type': 'yarn', 'factor': 4.0, 'original_max_position_embeddings': 32}),
    'yarn mscale': (10000.0, {'rope_type': 'yarn', 'factor': 8.0, 'original_max_position_embeddings': 32,
                              'beta_fast': 16, 'beta_slow': 2, 'mscale': 0.8, 'mscale_all_dim': 0.5,
                              'truncate': False}),
    'yarn attention_factor': (10000.0, {'rope_type': 'yarn', 'factor': 2.0, 'original_max_position_embeddings': 32,
                                        'attention_factor': 1.3}),
}


@pytest.mark.parametrize('name', EXTENSIONS)
def test_rope_extensions_match_transformers_loaded_extended_and_exported(tmp_path, name):
    theta, rope = EXTENSIONS[name]
    hf = hf_model(rope_scaling=rope, theta=theta)
    hf.save_pretrained(tmp_path / 'hf')
    base = hf_model(theta=10000.0)  # the same weights (the same seed), the original RoPE
    assert torch.equal(base.model.embed_tokens.weight, hf.model.embed_tokens.weight)
    base.save_pretrained(tmp_path / 'base')
    idx = torch.randint(0, 211, (2, 100))
    with torch.no_grad():
        ref = hf(idx).logits
        assert rel_err(base(idx).logits, ref) > 1e-4  # the extension changes the logits 10x the tolerance and more
        loaded = Llama.from_pretrained(tmp_path / 'hf')  # a checkpoint transformers extended
        assert (loaded.config.rope_theta, loaded.config.rope_scaling) == (theta, rope)
        assert rel_err(loaded(idx), ref) < 1e-5
        extended = Llama.from_pretrained(tmp_path / 'base', rope_theta=theta, rope_scaling=rope)  # ours extends it
        assert rel_err(extended(idx), ref) < 1e-5
        extended.save_pretrained(tmp_path / 'export')
        exported = transformers.LlamaForCausalLM.from_pretrained(tmp_path / 'export', attn_implementation='eager')
        assert rel_err(exported.float()(idx).logits, ref) < 1e-5
        assert torch.equal(Llama.from_pretrained(tmp_path / 'export')(idx), extended(idx))
    config = json.loads((tmp_path / 'export' / 'config.json').read_text())
    assert config['rope_theta'] == theta and config['rope_scaling'] == rope
    if rope and rope['rope_type'] == 'yarn':  # transformers checks YaRN's factor against this ratio
        assert config['max_position_embeddings'] == rope['factor'] * rope['original_max_position_embeddings']


@pytest.mark.parametrize('rope', [
    {'rope_type': 'dynamic', 'factor': 2.0}, {'factor': 2.0}, 'yarn', ['yarn'], {'rope_type': ['yarn']},
    {'rope_type': 'linear'}, {'rope_type': 'linear', 'factor': '2'}, {'rope_type': 'linear', 'factor': True},
    {'rope_type': 'yarn', 'factor': 4.0},
    {'rope_type': 'yarn', 'factor': 4.0, 'original_max_position_embeddings': 32.0},
    {'rope_type': 'yarn', 'factor': 4.0, 'original_max_position_embeddings': 32, 'beta_fats': 8},
    {'rope_type': 'yarn', 'factor': 4.0, 'original_max_position_embeddings': 32, 'truncate': 'no'},
    {**LLAMA3_ROPE, 'low_freq_factor': None}, {**LLAMA3_ROPE, 'factor': -8.0}])
def test_a_bad_rope_scaling_is_one_line_that_says_what_is_allowed(rope):
    with pytest.raises(ValueError) as e:
        LlamaConfig(rope_scaling=rope)
    line = str(e.value)
    assert line.startswith(f'rope_scaling={rope!r}: must be None or') and '\n' not in line
    assert 'linear factor;' in line and 'yarn factor original_max_position_embeddings [attention_factor]' in line


def test_rope_theta_is_a_number_and_rope_scaling_takes_optional_fields():
    for theta in (None, 'big', 0, -1.0):  # (train.py's rope_theta is None, "not given", and takes any literal)
        with pytest.raises(ValueError, match=f'^rope_theta={theta!r}: must be a number > 0$'):
            LlamaConfig(rope_theta=theta)
    for ok in (None, {'rope_type': 'default'}, LLAMA3_ROPE, {'rope_type': 'yarn', 'factor': 4,
               'original_max_position_embeddings': 32, 'beta_fast': None, 'truncate': False}):
        LlamaConfig(rope_scaling=ok)


def test_loss_ignores_targets_and_all_ignored_is_zero():
    torch.manual_seed(0)
    m = Llama(LlamaConfig(n_layer=1, n_embd=32, n_head=2, n_kv_head=1, intermediate_size=64, vocab_size=50))
    idx = torch.randint(0, 50, (2, 9))
    t = idx.clone()
    t[:, ::2] = -100
    logits = m(idx)
    _, loss = m(idx, t)
    keep = t != -100
    ref = F.cross_entropy(logits[keep], t[keep])
    assert torch.allclose(loss, ref, rtol=1e-6)
    _, zero = m(idx, torch.full_like(idx, -100))
    assert zero.item() == 0.0


def test_init_residual_projections_scaled():
    torch.manual_seed(0)
    m = Llama(LlamaConfig(n_layer=8, n_embd=256, n_head=4, n_kv_head=4, intermediate_size=512))
    std = lambda p: p.detach().std().item()
    assert abs(std(m.layers['0'].attention.wq.weight) - 0.02) < 1e-3
    assert abs(std(m.layers['0'].feed_forward.w2.weight) - 0.02 / 4) < 5e-4  # 1/sqrt(2*8)


@pytest.mark.parametrize('window', [{}, dict(sliding_window=3), dict(sliding_window=4, layer_types=[
    'full_attention', 'sliding_attention']), dict(head_dim=12, attention_bias=True, qk_norm=True)],
    ids=['full', 'windowed', 'mixed', 'qwen block'])
def test_kv_cache_decoding_matches_full_forward(window):
    """Prefill then one token at a time: the logits of the whole sequence at once (from the prompt's
    last token on); under a sliding window each new token sees only the cache's last W keys (the
    prefill's 5 tokens are more than the window)."""
    from sample import KVCache
    torch.manual_seed(0)
    c = LlamaConfig(n_layer=2, n_embd=32, n_head=4, n_kv_head=2, intermediate_size=64, vocab_size=40, **window)
    m = Llama(c).eval()
    idx = torch.randint(0, 40, (2, 12))
    full = m(idx)
    caches = [KVCache(2, c.n_kv_head, c.head_dim, 12, 'cpu', torch.float32) for _ in range(c.n_layer)]
    out = [m(idx[:, :5], kv_caches=caches)]  # prefill: the last token's logits only
    assert out[0].shape == (2, 1, 40)
    for t in range(5, 12):
        out.append(m(idx[:, t:t + 1], positions=torch.tensor([t]), kv_caches=caches))
    assert rel_err(torch.cat(out, 1), full[:, 4:]) < 1e-5


def test_prefill_without_a_window_builds_no_mask(monkeypatch):
    """sample.generate's prefill of a layer with no window is SDPA's causal kernel: window_mask (a
    T x T bool, 16 GiB at 128K tokens) is never made for it; a windowed layer's prefill makes one."""
    import model
    from sample import generate
    calls = []
    real = model.window_mask

    def recording(n_q, n_k, window, device):
        calls.append((n_q, n_k, window))
        return real(n_q, n_k, window, device)

    monkeypatch.setattr(model, 'window_mask', recording)
    torch.manual_seed(0)
    generate(Llama(LlamaConfig()).eval(), torch.randint(0, 256, (1, 64)), 3)
    assert all(n_q == 1 for n_q, _, _ in calls)  # the new tokens' rows only, never 64 x 64
    calls.clear()
    windowed = LlamaConfig(sliding_window=8, layer_types=['full_attention', 'sliding_attention'] * 2)
    generate(Llama(windowed).eval(), torch.randint(0, 256, (1, 64)), 3)
    assert calls.count((64, 64, 8)) == 2  # the two windowed layers' prefill


def test_the_default_core_takes_varlen_on_cuda_and_the_document_loop_on_a_cpu(monkeypatch):
    """Llama(config)'s core, as sample.py, eval.py and checkpoint loading build it, runs packed
    documents as training ran them: one varlen kernel on CUDA (here fake CUDA tensors, a CPU build),
    one SDPA call a document on a CPU."""
    import model
    from torch._subclasses.fake_tensor import FakeTensorMode
    calls = []

    def kernel(name):
        def record(q, k, v, docs, window=0):
            calls.append((name, q.device.type))
            return q
        return record

    monkeypatch.setattr(model, 'one_kernel', kernel('varlen'))
    monkeypatch.setattr(model, 'per_document', kernel('per document'))
    core = Llama(LlamaConfig()).layers['0'].attention.core
    docs = np.array([0, 3])
    core(*[torch.empty(1, 4, 8, 32)] * 3, docs)
    with FakeTensorMode(allow_non_fake_inputs=True):
        core(*[torch.empty(1, 4, 8, 32, device='cuda')] * 3, docs)
    assert calls == [('per document', 'cpu'), ('varlen', 'cuda')]


def test_rope_angles_stay_fp32_in_a_bf16_model():
    """model.to(bfloat16) once rounded RoPE's inverse frequencies to bf16 (a buffer): at position
    100,000 the angles were off by radians. The tables a bf16 model uses are the fp32 model's."""
    torch.manual_seed(0)
    config = LlamaConfig(n_layer=1, n_head=4, n_kv_head=2, n_embd=64, intermediate_size=128, vocab_size=64)
    tables = []
    for dtype in (torch.float32, torch.bfloat16):
        model = Llama(config).to(dtype=dtype)
        model.layers['0'].register_forward_pre_hook(lambda m, args: tables.append(args[1:3]))
        model(torch.zeros(1, 8, dtype=torch.long), positions=torch.arange(100_000, 100_008))
    (cos32, sin32), (cos16, sin16) = tables
    assert cos16.dtype == torch.float32 and torch.equal(cos16, cos32) and torch.equal(sin16, sin32)


# ----------------------------------------------------------------------------- doc_mask

DOC_LENS = [[5, 11], [16], [3, 3, 10]]  # each row of a packed batch cut into documents (doc_mask)


def test_doc_mask_equals_each_document_alone():
    """Packed documents with doc_mask: the loss and every gradient of each document run alone (its own
    positions from 0, its own attention), weighted by its real targets (fp32, 1e-5)."""
    torch.manual_seed(0)
    m = Llama(LlamaConfig(n_layer=2, n_embd=32, n_head=4, n_kv_head=2, intermediate_size=64, vocab_size=97))
    x, y, pos, docs = packed_batch(DOC_LENS)
    loss = m(x, y, pos, docs)[1]
    loss.backward()
    grads = {n: p.grad.clone() for n, p in m.named_parameters()}
    m.zero_grad()
    ref, count = 0.0, (y != -100).sum()
    for b, row in enumerate(DOC_LENS):
        for a, n in zip([0, *torch.tensor(row).cumsum(0).tolist()], row):
            yd = y[b:b + 1, a:a + n]
            part = m(x[b:b + 1, a:a + n], yd)[1] * (yd != -100).sum() / count
            part.backward()
            ref = ref + part.detach()
    assert abs(loss.item() - ref.item()) <= 1e-5 * ref.item()
    for n, p in m.named_parameters():
        assert rel_err(grads[n], p.grad) <= 1e-5, n
    m.zero_grad()
    m(x, y)[1].backward()  # without the mask: other gradients
    assert rel_err(m.layers['0'].attention.wq.weight.grad, grads['layers.0.attention.wq.weight']) > 0.05


# ----------------------------------------------------------------------------- RMSNorm and RoPE, a chunk at a time

def plain_norm(x, weight, eps=1e-5):  # what RMSNorm computed before its Function: autograd on HF's expression
    return weight * F.rms_norm(x.float(), x.shape[-1:], eps=eps).to(x.dtype)


def plain_rope(x, cos, sin):  # what apply_rope computed before its Function
    xf = x.float()
    x1, x2 = xf.chunk(2, dim=-1)
    return (xf * cos + torch.cat([x2, x1], dim=-1) * sin).to(x.dtype)


def grads(fn, inputs, autocast, seed=0):
    """fn(*inputs) and the gradients of the inputs that require one, for a random incoming gradient."""
    inputs = [t.detach().clone().requires_grad_(t.requires_grad) for t in inputs]
    with torch.autocast('cpu', dtype=torch.bfloat16, enabled=autocast):
        y = fn(*inputs)
    y.backward(torch.randn(y.shape, generator=torch.Generator().manual_seed(seed)).to(y.dtype))
    return [y.detach()] + [t.grad for t in inputs if t.requires_grad]


NORM_CASES = {'fp32': (torch.float32, torch.float32, False), 'bf16 under autocast': (torch.bfloat16,) * 2 + (True,),
              'fp32 under autocast': (torch.float32, torch.float32, True),
              'bf16 input, fp32 weight': (torch.bfloat16, torch.float32, True)}


@pytest.mark.parametrize('per_chunk', [None, 5], ids=['one chunk', '5 positions a chunk'])
@pytest.mark.parametrize('shape', [(2, 37, 64), (37, 48)], ids=['B S h', 'S h'])
@pytest.mark.parametrize('case', NORM_CASES)
def test_rmsnorm_is_the_plain_expression(monkeypatch, case, shape, per_chunk):
    """Output and dx to the bit; dweight to the bit in one chunk, and summed over chunks in fp32 within fp32's
    rounding of a different order (1e-6), or of bf16's (2^-8: measured equal) when cast to bf16."""
    import model
    if per_chunk:
        monkeypatch.setattr('rope.FP32_CHUNK', per_chunk * torch.Size(shape).numel() // shape[-2])
    x_dtype, w_dtype, autocast = NORM_CASES[case]
    g = torch.Generator().manual_seed(1)
    norm = model.RMSNorm(shape[-1], 1e-5).to(w_dtype)
    with torch.no_grad():
        norm.weight.add_(0.1 * torch.randn(shape[-1], generator=g))
    x = (3 * torch.randn(shape, generator=g)).to(x_dtype).requires_grad_()
    ours = grads(lambda x, w: torch.func.functional_call(norm, {'weight': w}, (x,)), [x, norm.weight], autocast)
    ref = grads(plain_norm, [x, norm.weight], autocast)
    assert ours[0].dtype == ref[0].dtype and torch.equal(ours[0], ref[0]) and torch.equal(ours[1], ref[1])
    if per_chunk is None:
        assert torch.equal(ours[2], ref[2])
    elif w_dtype == torch.float32:
        assert rel_err(ours[2], ref[2]) <= 1e-6
    else:
        assert ((ours[2].float() - ref[2].float()).abs() <= 2 ** -8 * ref[2].float().abs()).all()


@pytest.mark.parametrize('per_chunk', [None, 5], ids=['one chunk', '5 positions a chunk'])
@pytest.mark.parametrize('per_row', [False, True], ids=['positions [S]', 'positions [B, S]'])
@pytest.mark.parametrize('dtype', [torch.float32, torch.bfloat16], ids=['fp32', 'bf16 under autocast'])
def test_rope_is_the_plain_expression(monkeypatch, dtype, per_row, per_chunk):
    """apply_rope on q's layout ([B, S, H, hd] in memory), tables as Llama.forward makes them ([B, 1, S, hd]
    for per-row positions: doc_mask's), an odd length: output and dx to the bit."""
    B, H, S, hd = 2, 4, 37, 16
    if per_chunk:
        monkeypatch.setattr('rope.FP32_CHUNK', per_chunk * B * H * hd)
    inv_freq, scale = rope_frequencies(LlamaConfig(n_embd=H * hd, n_head=H, rope_theta=500000.0))
    positions = torch.stack([torch.arange(S), torch.arange(S) % 11]) if per_row else torch.arange(S)
    cos, sin = rope_tables(inv_freq.float(), positions, scale)
    x = (3 * torch.randn(B, S, H, hd)).to(dtype).transpose(1, 2).requires_grad_()
    ours, ref = (grads(f, [x, cos, sin], dtype == torch.bfloat16) for f in (apply_rope, plain_rope))
    assert ours[0].dtype == dtype and all(torch.equal(a, b) for a, b in zip(ours, ref))


def test_rope_in_one_chunk_keeps_only_the_tables():
    """A tensor that fits in one fp32 chunk (every short sequence) runs the formula under autograd
    rather than the Function: it saves for backward the tables alone, as the Function does."""
    cos, sin = rope_tables(rope_frequencies(LlamaConfig(n_embd=64, n_head=4))[0].float(), torch.arange(37))
    q = torch.randn(2, 37, 4, 16, dtype=torch.bfloat16).transpose(1, 2).requires_grad_()
    kept = []
    with torch.autograd.graph.saved_tensors_hooks(lambda t: kept.append(t) or t, lambda t: t):
        apply_rope(q, cos, sin)
    tables = {cos.untyped_storage().data_ptr(), sin.untyped_storage().data_ptr()}
    assert kept and {t.untyped_storage().data_ptr() for t in kept} <= tables


class Peak(TorchDispatchMode):
    """The most bytes alive at once of the storages that the ops inside create (those of `outside` not counted)."""

    def __init__(self, *outside):
        super().__init__()
        self.alive, self.now, self.peak = {id(t.untyped_storage()) for t in outside}, 0, 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in out if isinstance(out, (tuple, list)) else (out,):
            s = t.untyped_storage() if isinstance(t, torch.Tensor) else None
            if s is not None and id(s) not in self.alive:
                self.alive.add(id(s))
                self.now += s.nbytes()
                weakref.finalize(s, self.free, id(s), s.nbytes())
        self.peak = max(self.peak, self.now)
        return out

    def free(self, key, nbytes):
        self.alive.discard(key)
        self.now -= nbytes


def test_rmsnorm_and_rope_hold_no_full_size_fp32_copy(monkeypatch):
    """RMSNorm saves its bf16 input alone (the plain expression: an fp32 copy and x/rms besides), and neither it nor
    RoPE holds an fp32 tensor the size of its input, forward or backward: the output, the gradient and a chunk's."""
    import model
    S, h, H = 2048, 256, 4
    monkeypatch.setattr('rope.FP32_CHUNK', 1 << 13)  # 64 chunks of 32 positions
    chunk = 4 * (1 << 13)  # bytes of one chunk in fp32: a full-size fp32 copy is 64 of them
    x = torch.randn(1, S, h, dtype=torch.bfloat16, requires_grad=True)
    weight = torch.nn.Parameter(torch.ones(h, dtype=torch.bfloat16))
    cos, sin = rope_tables(rope_frequencies(LlamaConfig(n_embd=h, n_head=H))[0].float(), torch.arange(S))
    q = x.detach().view(1, S, H, h // H).transpose(1, 2).requires_grad_()
    norm = lambda x: torch.func.functional_call(model.RMSNorm(h, 1e-5), {'weight': weight}, (x,))
    for ours, plain, inp in [(norm, lambda x: plain_norm(x, weight), x),
                             (lambda q: apply_rope(q, cos, sin), lambda q: plain_rope(q, cos, sin), q)]:
        peaks, saved = [], []
        for fn in (ours, plain):
            kept = []
            with torch.autograd.graph.saved_tensors_hooks(lambda t: kept.append(t) or t, lambda t: t), \
                    Peak(inp, weight, cos, sin) as forward:
                y = fn(inp)
            dy = torch.ones_like(y)
            with Peak(inp, weight, cos, sin, y, dy) as backward:
                y.backward(dy)
            peaks.append((forward.peak, backward.peak))
            saved.append(sum({id(t.untyped_storage()): t.untyped_storage().nbytes() for t in kept
                              if all(t.untyped_storage() is not s.untyped_storage() for s in (weight, cos, sin))
                              }.values()))
        bound = inp.nbytes + 32 * chunk  # its output or gradient, and a few chunks' fp32 tensors
        assert max(peaks[0]) <= bound < max(peaks[1])  # (the plain expression: 5 fp32 copies at once)
        assert saved[0] == (inp.nbytes if ours is norm else 0) and saved[1] >= 3 * inp.nbytes * (ours is norm)


def test_flops_per_token_counts_the_pairs_attention_computes():
    """A hand count: 6·N + 12·h·P/T a token, P the (query, key) pairs the mask allows in T tokens, summed over
    the layers: causal attention half of every query seeing every key, a window and documents their own pairs
    (what the knobs run again: tests/test_knobs.py)."""
    from model import attention_pairs, flops_per_token, num_params
    c = LlamaConfig(n_layer=2, n_head=4, n_kv_head=2, n_embd=16, intermediate_size=24, vocab_size=10)
    L, h, kv, I, V = 2, 16, 8, 24, 10
    # per layer two norms, wq wo, wk wv, w1 w2 w3; then the final norm and the LM head
    N = L * (2 * h + 2 * h * h + 2 * h * kv + 3 * h * I) + h + V * h
    assert N == num_params(c) == 4080
    # S = 6, causal: query i sees i keys, 1 + 2 + ... + 6 = 21 pairs a layer (every key: 36)
    assert attention_pairs([6]) == 21
    assert flops_per_token(c, 6) == 6 * N + 12 * h * (2 * 21) / 6 == 24480 + 1344
    # a window of 2 keys in layer 0: 1 + 2 + 2 + 2 + 2 + 2 = 11 pairs there, 21 in layer 1
    window = replace(c, sliding_window=2, layer_types=['sliding_attention', 'full_attention'])
    assert attention_pairs([6], 2) == 11
    assert flops_per_token(window, 6) == 6 * N + 12 * h * (11 + 21) / 6 == 24480 + 1024
    # documents of 2 and 4 tokens in the row: causal 3 + 10 = 13 pairs a layer; the window's 3 + 7 = 10
    assert attention_pairs([2, 4]) == 13 and attention_pairs([2, 4], 2) == 10
    assert flops_per_token(c, 2, 4) == 6 * N + 12 * h * (2 * 13) / 6 == 24480 + 832
    assert flops_per_token(window, 2, 4) == 6 * N + 12 * h * (10 + 13) / 6 == 24480 + 736
    # two rows, one a document of 6, the other documents of 2 and 4: 21 + 13 = 34 pairs a layer in 12 tokens
    assert flops_per_token(c, 6, 2, 4) == 6 * N + 12 * h * (2 * 34) / 12 == 24480 + 1088
    # a window as long as the sequence is a causal layer
    assert flops_per_token(replace(window, sliding_window=6), 6) == flops_per_token(c, 6)


@cuda
def test_sdpa_on_cuda_in_bf16_is_the_cpu_fp32_model():
    """On a CUDA GPU, attention is SDPA's flash or memory-efficient kernel under bf16 autocast: the loss and
    gradients of a small model stay within bf16's rounding of the CPU's fp32 math."""
    torch.manual_seed(0)
    model = Llama(LlamaConfig(n_layer=2, n_head=4, n_kv_head=2, n_embd=128, intermediate_size=256, vocab_size=97))
    idx = torch.randint(0, 97, (2, 256))
    results = []
    for dev in ('cpu', 'cuda'):
        m = model.to(dev)
        m.zero_grad(set_to_none=True)
        with torch.autocast('cuda', dtype=torch.bfloat16, enabled=dev == 'cuda'):
            _, loss = m(idx.to(dev), idx.roll(-1, 1).to(dev))
        loss.backward()
        # (cloned: a CPU gradient would move with the model to the GPU)
        results.append((loss.float().cpu(), {n: p.grad.float().cpu().clone() for n, p in m.named_parameters()}))
    (l32, g32), (l16, g16) = results
    assert abs(l16 - l32) < 2e-2 * l32
    assert all(rel_err(g16[n], g32[n]) < 5e-2 for n in g32), max(rel_err(g16[n], g32[n]) for n in g32)


@cuda
def test_documents_in_one_varlen_kernel_on_cuda_are_the_per_document_loop():
    """doc_mask on CUDA (train.py builds the model around attention with varlen=True there): one varlen_attn call for every document of
    the batch gives the loss and gradients of the per-document SDPA loop on the same GPU, to bf16's rounding;
    one-token documents and one of most of a row among them."""
    import functools
    import model as model_py
    config = LlamaConfig(n_layer=2, n_head=4, n_kv_head=2, n_embd=128, intermediate_size=256, vocab_size=97)
    x, y, positions, docs = packed_batch([[1, 1, 254], [100, 56, 100]], 97)
    results = []
    for varlen in (False, True):
        torch.manual_seed(0)
        model = Llama(config, functools.partial(model_py.attention, varlen=varlen)).cuda()
        with torch.autocast('cuda', dtype=torch.bfloat16):
            loss = model(x.cuda(), y.cuda(), positions.cuda(), docs.numpy())[1]
        loss.backward()
        results.append((loss.float().cpu(), {n: p.grad.float().cpu().clone() for n, p in model.named_parameters()}))
    (loop_loss, loop_grads), (varlen_loss, varlen_grads) = results
    assert abs(varlen_loss - loop_loss) < 1e-2 * loop_loss
    assert all(rel_err(varlen_grads[n], loop_grads[n]) < 3e-2 for n in loop_grads), max(
        rel_err(varlen_grads[n], loop_grads[n]) for n in loop_grads)


def masked_attention(q, k, v, allowed):
    """Attention by its definition: softmax over the keys `allowed` [S, S] (or [B, S, S]) lets each query see."""
    scores = (q @ k.repeat_interleave(q.shape[1] // k.shape[1], 1).transpose(-1, -2)) / q.shape[-1] ** 0.5
    if allowed.dim() == 3:
        allowed = allowed[:, None]
    weights = scores.masked_fill(~allowed, -torch.inf).softmax(-1)
    return weights @ v.repeat_interleave(q.shape[1] // v.shape[1], 1)


@pytest.mark.parametrize('window', [1, 3, 7, 16, 40])
def test_the_window_is_hf_rule_with_and_without_documents(window):
    """attention() with a sliding window W: query i sees key j when 0 <= i - j < W (Hugging Face's rule), within
    its document when doc_mask packs several; fp64 against the definition, and the window changes the output
    where it is shorter than the sequence (or a document)."""
    from model import attention
    g = torch.Generator().manual_seed(0)
    q = torch.randn(2, 4, 16, 8, generator=g, dtype=torch.float64)
    k, v = torch.randn(2, 2, 2, 16, 8, generator=g, dtype=torch.float64)
    i = torch.arange(16)
    gap = i[:, None] - i[None, :]
    allowed = (gap >= 0) & (gap < window)
    torch.testing.assert_close(attention(q, k, v, None, window), masked_attention(q, k, v, allowed))
    docs = np.array([0, 7, 16, 17, 20])  # row 0: 7 + 9 tokens; row 1: 1 + 3 + 12
    doc = torch.as_tensor(np.searchsorted(docs, np.arange(32), 'right')).view(2, 16)
    same_doc = doc[:, :, None] == doc[:, None, :]
    want = masked_attention(q, k, v, allowed & same_doc)
    torch.testing.assert_close(attention(q, k, v, docs, window), want)
    if window < 12:  # the longest document: a window shorter than it changes something
        assert not torch.allclose(want, masked_attention(q, k, v, (gap >= 0) & same_doc))


def test_each_layer_gets_its_window():
    """layer_types picks the windowed layers; None windows every layer when sliding_window > 0."""
    mixed = LlamaConfig(n_layer=3, sliding_window=8, layer_types=['sliding_attention', 'full_attention',
                                                                  'sliding_attention'])
    assert [block.attention.window for block in Llama(mixed).layers.values()] == [8, 0, 8]
    assert [LlamaConfig(n_layer=2, sliding_window=8).window(i) for i in range(2)] == [8, 8]
    assert [LlamaConfig(n_layer=2).window(i) for i in range(2)] == [0, 0]


# ----------------------------------------------------------------------------- Qwen2, Qwen3, Qwen3-MoE
QWEN_CLASSES = {'qwen2': transformers.Qwen2ForCausalLM, 'qwen3': transformers.Qwen3ForCausalLM,
                'qwen3_moe': transformers.Qwen3MoeForCausalLM, 'llama': transformers.LlamaForCausalLM}
QWEN_CASES = {
    # biases on q, k, v; Llama's head width
    'qwen2': ('qwen2', dict(num_attention_heads=4, num_key_value_heads=2)),
    # an odd head count of a decoupled width (3 x 24 = 72 on a 64 wide model), tied
    'qwen2 3 heads of 24, tied': ('qwen2', dict(num_attention_heads=3, num_key_value_heads=1, head_dim=24,
                                                tie_word_embeddings=True)),
    # q and k norms, 6 x 32 = 192 wide heads
    'qwen3 6 heads of 32': ('qwen3', dict(num_attention_heads=6, num_key_value_heads=2, head_dim=32)),
    'qwen3 tied': ('qwen3', dict(num_attention_heads=4, num_key_value_heads=4, head_dim=16,
                                 tie_word_embeddings=True)),
    # experts of their own width, weights not renormalised, layer 1 dense
    'qwen3_moe dense layer 1': ('qwen3_moe', dict(num_attention_heads=4, num_key_value_heads=2, head_dim=32,
                                                  num_experts=4, num_experts_per_tok=2, moe_intermediate_size=48,
                                                  norm_topk_prob=False, mlp_only_layers=[1])),
    # every other layer sparse, weights renormalised
    'qwen3_moe sparse step 2': ('qwen3_moe', dict(num_attention_heads=4, num_key_value_heads=2, head_dim=24,
                                                  num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32,
                                                  norm_topk_prob=True, decoder_sparse_step=2)),
    # a Llama (Mistral-Nemo's shape, small) whose config.json sets head_dim
    'llama head_dim 32': ('llama', dict(num_attention_heads=4, num_key_value_heads=2, head_dim=32)),
}


def hf_qwen(family, seed=0, **fields):
    """A tiny transformers model of `family` (3 layers, 64 wide, fp32, eager), its norms and biases perturbed
    (HF inits them to one and zero: the mapping is then really tested)."""
    torch.manual_seed(seed)
    cfg = transformers.AutoConfig.for_model(family, hidden_size=64, intermediate_size=96, num_hidden_layers=3,
                                            vocab_size=128, rms_norm_eps=1e-5, rope_theta=10000.0,
                                            max_position_embeddings=256, **fields)
    cfg._attn_implementation = 'eager'
    m = QWEN_CLASSES[family](cfg).float().eval()
    with torch.no_grad():
        for name, p in m.named_parameters():
            if 'norm' in name or name.endswith('bias'):
                p.add_(0.1 * torch.randn_like(p))
            if name.endswith('gate.weight'):  # the router: HF inits it to zero (every expert alike)
                p.normal_(std=0.5)
    return m


@pytest.mark.parametrize('case', QWEN_CASES)
def test_qwen_families_load_and_export_to_the_same_logits(tmp_path, case):
    family, fields = QWEN_CASES[case]
    hf = hf_qwen(family, **fields)
    hf.save_pretrained(tmp_path / 'hf')
    ours = Llama.from_pretrained(tmp_path / 'hf').eval()
    c = ours.config
    assert c.head_dim == fields.get('head_dim', 64 // fields['num_attention_heads'])
    assert (c.attention_bias, c.qk_norm) == (family == 'qwen2', family.startswith('qwen3'))
    idx = torch.randint(0, 128, (2, 40))
    with torch.no_grad():
        ref = hf(idx).logits
        assert rel_err(ours(idx), ref) < 1e-5
        ours.save_pretrained(tmp_path / 'export')
        theirs = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / 'export', attn_implementation='eager')
        assert type(theirs) is QWEN_CLASSES[family]  # the same family, not a Llama with weights dropped
        assert rel_err(theirs.float()(idx).logits, ref) < 1e-5
        again = Llama.from_pretrained(tmp_path / 'export')
        assert again.config == c and torch.equal(again(idx), ours(idx))


def test_qwen3_moe_dense_layers_and_routing_are_read_as_transformers_has_them(tmp_path):
    hf_qwen('qwen3_moe', **QWEN_CASES['qwen3_moe sparse step 2'][1]).save_pretrained(tmp_path / 'step')
    c = Llama.from_pretrained(tmp_path / 'step').config
    # decoder_sparse_step 2: layers 1 (of 0, 1, 2) sparse
    assert (c.dense_layers, c.n_experts, c.moe_intermediate_size, c.norm_topk_prob) == ([0, 2], 4, 32, True)
    model = Llama.from_pretrained(tmp_path / 'step')
    assert [type(b.feed_forward).__name__ for b in model.layers.values()] == ['MLP', 'MoE', 'MLP']
    # norm_topk_prob=False: the k weights are the probabilities over all E, not renormalised
    moe = Llama(replace(c, norm_topk_prob=False, dense_layers=None)).layers['0'].feed_forward
    x = torch.randn(5, 64)
    probs = F.softmax(moe.router(x).float(), dim=-1)
    seen = {}

    def route(x, chosen, weights):  # records the weights the experts' outputs would be weighed by
        seen['weights'] = weights
        return x

    moe.route = route
    moe(x)
    assert torch.allclose(seen['weights'], probs.topk(2).values)
    assert not torch.allclose(seen['weights'].sum(-1), torch.ones(5))


@pytest.mark.parametrize('model_type,edit,message', [
    ('qwen3', {'attention_bias': True}, "attention_bias=True on a 'qwen3' (o_proj's bias too) is not supported"),
    ('qwen2', {'use_sliding_window': True}, "use_sliding_window=True (Qwen's windowed layers) is not supported")])
def test_what_qwen_we_do_not_read_is_refused_in_one_line(tmp_path, model_type, edit, message):
    transformers.AutoConfig.for_model(model_type).save_pretrained(tmp_path)
    config = json.loads((tmp_path / 'config.json').read_text())
    (tmp_path / 'config.json').write_text(json.dumps({**config, **edit}))
    with pytest.raises(ValueError) as e:
        Llama.from_pretrained(tmp_path)
    assert str(e.value).startswith(f"{tmp_path / 'config.json'}: {message}")


@pytest.mark.parametrize('fields,message', [
    (dict(attention_bias=True, qk_norm=True), "attention_bias, qk_norm: Qwen2's"),
    (dict(attention_bias=True, n_experts=4), "attention_bias, qk_norm: Qwen2's"),
    (dict(qk_norm=True, sliding_window=4), "attention_bias, qk_norm: Qwen2's"),
    (dict(n_experts=4, norm_topk_prob=False), "layer_types, dense_layers, norm_topk_prob=False: Mixtral has none"),
    (dict(n_experts=4, dense_layers=[1]), "layer_types, dense_layers, norm_topk_prob=False: Mixtral has none")])
def test_an_export_no_family_says_is_refused_before_anything_is_written(tmp_path, fields, message):
    with pytest.raises(ValueError, match=message):
        Llama(LlamaConfig(**fields)).save_pretrained(tmp_path / 'out')
    assert not (tmp_path / 'out').exists()


@pytest.mark.parametrize('fields,message', [
    (dict(head_dim=7), "head_dim=7: a head's width (head_dim, or n_embd / n_head) must be even (RoPE)"),
    (dict(n_embd=20), "n_embd=20: a head's width (head_dim, or n_embd / n_head) must be even (RoPE)"),
    (dict(n_embd=30), "n_embd=30: must be divisible by n_head=4 (or give head_dim)"),
    (dict(head_dim=-1), "head_dim=-1: must be >= 0"),
    (dict(n_experts=4, dense_layers=[4]), "dense_layers=[4]: must be None or layers of range(n_layer=4)")],
    ids=['odd head_dim', 'odd n_embd / n_head', 'n_embd not divisible', 'negative head_dim', 'no such layer'])
def test_a_bad_qwen_field_is_one_line_naming_it(fields, message):
    with pytest.raises(ValueError) as e:
        LlamaConfig(**fields)
    assert str(e.value) == message
    assert LlamaConfig(n_embd=30, head_dim=8).head_dim == 8  # a width of its own: n_embd need not divide
