"""
Rotary position embeddings (RoPE) as Hugging Face's Llama computes them, and the fp32 they run in.

RoPE (Su et al. 2021, RoFormer) tells attention where a token is by rotating its query and key:
at position p, channel pair i of a head (d = head_dim channels, i < d/2) turns by the angle p·θ_i,
with θ_i = rope_theta^(-2i/d). A query at p and a key at p' then meet in a dot product that depends
on p - p' alone. HF's checkpoints pair channel i with channel i + d/2 ("rotate half"), not
neighbours as the paper does; we follow them, so their weights load unpermuted:

    rope(x) = x·cos(pθ) + R(x)·sin(pθ),    R(x1, x2) = (-x2, x1) for the two halves x1, x2 of x

The angles are computed in fp64 and the cos and sin tables kept in fp32, never in the model's bf16
(8 bits of mantissa: an angle at position 100,000 would be off by hundreds of radians).

A checkpoint's context is extended by scaling the θ_i (`rope_scaling`, with transformers' names and
formulas, those of its modeling_rope_utils.py):
  linear   position interpolation (Chen et al. 2023): every θ_i / factor
  llama3   Llama 3.1: the high frequencies kept, the low ones / factor, a smooth ramp in between
  yarn     YaRN (Peng et al. 2023): θ_i / factor for the dimensions that turn fewer than beta_slow
           times over the original context, kept for those that turn more than beta_fast times, a
           ramp in between; cos and sin times an attention factor, 0.1·ln(factor) + 1

fp32, a chunk at a time. Under bf16 the rotation is computed in fp32, as HF does. Autograd on the
formula holds five fp32 tensors of q's size at once, in forward and in backward (x in fp32, x·cos,
R(x), R(x)·sin, their sum): 5·4·B·S·h bytes, 10 GiB for one call at S = 131,072 and h = 4,096.
apply_rope runs the formula on FP32_CHUNK elements at a time instead, each written into the output
in x's dtype: 5·4·FP32_CHUNK bytes, 1.25 GiB, whatever S. Its Function saves the tables alone for
backward (every layer shares them): backward is the same rotation, by -θ. A tensor that fits in one
chunk (every short sequence) runs the formula itself under autograd: the same bits and the same
saved tensors (the tables), without the Function's Python and copies, which cost more than the
arithmetic at small sizes. model.py's RMSNorm computes in fp32 by the same chunks (fp32_chunks).
"""

import math

import torch

# elements held in fp32 at once by RoPE and RMSNorm (256 MiB): a few positions, not all
FP32_CHUNK = 1 << 26


# ----------------------------------------------------------------------------- rope_scaling
# rope_scaling's types, as transformers names them: each one's required fields, then its optional
# ones (names apart by spaces)
ROPE_SCALINGS = {
    'default': ('', ''),
    'linear': ('factor', ''),
    'llama3': ('factor low_freq_factor high_freq_factor original_max_position_embeddings', ''),
    'yarn': ('factor original_max_position_embeddings',
             'attention_factor beta_fast beta_slow mscale mscale_all_dim truncate'),
}
# the table above, as LlamaConfig's error message says it
ROPE_SCALING_RULE = (
    "must be None or a dict of 'rope_type' and its fields ([optional]): default; linear factor; "
    "llama3 factor low_freq_factor high_freq_factor original_max_position_embeddings; "
    "yarn factor original_max_position_embeddings [attention_factor] [beta_fast] [beta_slow] "
    "[mscale] [mscale_all_dim] [truncate] (numbers > 0, or None if optional; "
    "original_max_position_embeddings an int, truncate a bool)")


def rope_scaling_ok(scaling):
    """None, or one of ROPE_SCALINGS with its required fields, typed as transformers reads them; no
    unknown field."""
    if not isinstance(scaling, dict):
        return scaling is None
    kind = scaling.get('rope_type')
    if not isinstance(kind, str) or kind not in ROPE_SCALINGS:
        return False
    need, may = (set(fields.split()) for fields in ROPE_SCALINGS[kind])
    given = set(scaling) - {'rope_type'}
    if not need <= given <= need | may:
        return False
    for key in given:
        value = scaling[key]
        if key == 'truncate':
            ok = isinstance(value, bool)
        elif value is None:
            # an optional field left to transformers' default
            ok = key in may
        else:
            # a number > 0 (a bool is no number here), the original context an int
            numbers = (int,) if key == 'original_max_position_embeddings' else (int, float)
            ok = type(value) in numbers and value > 0
        if not ok:
            return False
    return True


# ----------------------------------------------------------------------- frequencies and tables
def rope_frequencies(config):
    """(inverse frequencies θ_i in fp64 with the rope scaling applied, the factor cos and sin are
    multiplied by: YaRN's attention factor, 1 otherwise), as transformers' _compute_*_parameters
    return them."""
    d = config.head_dim
    inv_freq = 1.0 / (config.rope_theta ** (torch.arange(0, d, 2, dtype=torch.float64) / d))
    scaling = config.rope_scaling or {}
    kind, factor = scaling.get('rope_type'), scaling.get('factor')
    # llama3 and yarn: the context the checkpoint was trained at
    old_len = scaling.get('original_max_position_embeddings')
    if kind == 'linear':
        # position interpolation: position p is rotated as p / factor
        return inv_freq / factor, 1.0
    if kind == 'llama3':
        # keep the high frequencies, divide the low ones by `factor`, interpolate in between
        low, high = scaling['low_freq_factor'], scaling['high_freq_factor']
        wavelen = 2 * math.pi / inv_freq
        smooth = (old_len / wavelen - low) / (high - low)
        between = (1 - smooth) * inv_freq / factor + smooth * inv_freq
        # wavelengths up to old_len / high kept, those up to old_len / low on the ramp, longer
        # ones / factor
        kept_or_ramped = torch.where(wavelen >= old_len / high, between, inv_freq)
        return torch.where(wavelen > old_len / low, inv_freq / factor, kept_or_ramped), 1.0
    if kind == 'yarn':
        # YaRN: divide by `factor` the dimensions turning fewer than beta_slow times over the
        # original context, keep those turning more than beta_fast times, ramp in between; cos and
        # sin scaled by the attention factor (mscale)
        def dimension(turns):
            # the (fractional) dimension whose angle turns `turns` times over old_len positions
            return d * math.log(old_len / (turns * 2 * math.pi)) / (2 * math.log(config.rope_theta))

        def mscale(m):
            # (1 when the context is not extended)
            return 0.1 * m * math.log(max(factor, 1)) + 1.0

        low = dimension(scaling.get('beta_fast') or 32)
        high = dimension(scaling.get('beta_slow') or 1)
        if scaling.get('truncate', True):
            low, high = math.floor(low), math.ceil(high)
        low, high = max(low, 0), min(high, d - 1)
        ramp = (torch.arange(d // 2, dtype=torch.float64) - low) / ((high - low) or 0.001)
        ramp = ramp.clamp(0, 1)
        attention_factor = scaling.get('attention_factor')
        if attention_factor is None:
            m, m_all = scaling.get('mscale'), scaling.get('mscale_all_dim')
            attention_factor = mscale(m) / mscale(m_all) if m and m_all else mscale(1)
        return inv_freq / factor * ramp + inv_freq * (1 - ramp), attention_factor
    return inv_freq, 1.0


def rope_tables(inv_freq, positions, scale=1.0):
    """cos and sin [S, head_dim] for integer positions [S] ([B, 1, S, head_dim] for [B, S]: a row
    per sequence, broadcast over heads), times scale (YaRN's attention factor); fp64 math, fp32
    result. In HF's rotate-half layout (channel i pairs with i + d/2), the sin table carrying R's
    sign (-sin for the first half): R is then a swap of the halves."""
    if positions.dim() == 2:
        positions = positions[:, None]
    angles = positions.double()[..., None] * inv_freq.to(positions.device)
    cos, sin = angles.cos() * scale, angles.sin() * scale
    # both channels of a pair turn by its angle: cos for each half, sin with R's signs
    return cos.tile(2).float(), torch.cat([-sin, sin], dim=-1).float()


# ---------------------------------------------------------------------- fp32, a chunk at a time
def fp32_chunks(x):
    """Indices of x's chunks of about FP32_CHUNK elements each: x[rows] is a slice of dim -2 (the
    positions; the rows of the dims before it are treated apart), as are the RoPE tables'."""
    n = max(1, FP32_CHUNK * x.shape[-2] // max(1, x.numel()))
    return [(..., slice(s, s + n), slice(None)) for s in range(0, x.shape[-2], n)]


def rotate(x, cos, sin):
    """The formula: x·cos + R(x)·sin in fp32, cast to x's dtype (R's sign is in the sin table)."""
    xf = x.float()
    # R(x) but for its signs: the halves of x swapped, a roll by half the channels
    return (xf * cos + xf.roll(x.shape[-1] // 2, dims=-1) * sin).to(x.dtype)


def apply_rope(x, cos, sin):
    """RoPE on x [B, H, S, hd] (q or k) with rope_tables' cos and sin, in fp32, in x's dtype."""
    if x.numel() <= FP32_CHUNK:
        return rotate(x, cos, sin)
    return _ChunkedRope.apply(x, cos, sin)


def _rotate_in_chunks(x, cos, sin, sign):
    """rotate() by sign·θ, FP32_CHUNK elements of x at a time."""
    out = torch.empty_like(x)
    for rows in fp32_chunks(x):
        out[rows] = rotate(x[rows], cos[rows], sign * sin[rows])
    return out


class _ChunkedRope(torch.autograd.Function):
    """rotate() a chunk at a time, saving only the tables. Backward rotates the gradient by -θ:
    the swap of halves is its own transpose and moves the sin table's signs, so the gradient
    g·cos + swap(g·sin) is g·cos + swap(g)·(-sin), to the bit (negations are exact)."""

    @staticmethod
    def forward(ctx, x, cos, sin):
        ctx.save_for_backward(cos, sin)
        return _rotate_in_chunks(x, cos, sin, 1)

    @staticmethod
    def backward(ctx, g):
        cos, sin = ctx.saved_tensors
        return _rotate_in_chunks(g, cos, sin, -1), None, None
