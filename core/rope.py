"""Rotary position embeddings: inverse frequencies per rope type, and cos/sin tables.

The arithmetic follows transformers' `modeling_rope_utils` step for step (float32
frequencies, `position * inv_freq` elementwise, `cat(freqs, freqs)`, the rotate-half
layout), so the tables are bit-identical to what transformers computes.
"""

from __future__ import annotations

import math

import torch

from .config import ModelConfig
from .errors import ConfigError


def rotary_dim(config: ModelConfig) -> int:
    """How many leading dimensions of each head rotate: head_dim, or int(head_dim ·
    partial_rotary_factor) (Phi-4-mini: 0.75; config.py checked it is even)."""
    p = config.rope_parameters
    return int(config.head_dim * p.get("partial_rotary_factor", 1.0))


def inverse_frequencies(config: ModelConfig, long: bool = False) -> tuple[torch.Tensor, float]:
    """Return (inv_freq [rotary_dim/2] float32, attention_scaling) for the config's rope type;
    for longrope the short factors' frequencies, or the long factors' if `long`."""
    p = config.rope_parameters
    assert p is not None, "model without rotary embeddings"
    dim = rotary_dim(config)
    base = p["rope_theta"]
    exponents = torch.arange(0, dim, 2, dtype=torch.int64).to(torch.float) / dim
    inv_freq = 1.0 / (base**exponents)
    kind = p["rope_type"]
    if kind == "default":
        return inv_freq, 1.0
    if kind == "linear":
        return inv_freq / p["factor"], 1.0
    if kind == "llama3":
        return _llama3(inv_freq, p), 1.0
    if kind == "yarn":
        return _yarn(base, dim, config.max_position_embeddings, p)
    if kind == "longrope":
        return _longrope(base, dim, config.max_position_embeddings, p, long)
    raise AssertionError(kind)  # config validation rejects other types


def _longrope(base: float, dim: int, max_positions: int, p: dict, long: bool) -> tuple[torch.Tensor, float]:
    """transformers' _compute_longrope_parameters: the frequencies divided by one factor per
    pair (short_factor, or long_factor beyond original_max_position_embeddings), and the
    attention scaling sqrt(1 + log(factor) / log(original)) that multiplies cos and sin."""
    original = p["original_max_position_embeddings"]
    factor = p.get("factor")
    if factor is None:
        factor = max_positions / original
    scaling = p.get("attention_factor")
    if scaling is None:
        scaling = 1.0 if factor <= 1.0 else math.sqrt(1 + math.log(factor) / math.log(original))
    ext_factors = torch.tensor(p["long_factor" if long else "short_factor"], dtype=torch.float32)
    inv_freq_shape = torch.arange(0, dim, 2, dtype=torch.int64).float() / dim
    return 1.0 / (ext_factors * base**inv_freq_shape), float(scaling)


def _llama3(inv_freq: torch.Tensor, p: dict) -> torch.Tensor:
    factor, low, high = p["factor"], p["low_freq_factor"], p["high_freq_factor"]
    old_context = p["original_max_position_embeddings"]
    low_freq_wavelen = old_context / low
    high_freq_wavelen = old_context / high
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > low_freq_wavelen, inv_freq / factor, inv_freq)
    smooth = (old_context / wavelen - low) / (high - low)
    smoothed = (1 - smooth) * scaled / factor + smooth * scaled
    medium = ~(wavelen < high_freq_wavelen) * ~(wavelen > low_freq_wavelen)
    return torch.where(medium, smoothed, scaled)


def _yarn(base: float, dim: int, max_positions: int, p: dict) -> tuple[torch.Tensor, float]:
    original = p["original_max_position_embeddings"]
    factor = p.get("factor") or max_positions / original

    def mscale(scale: float, m: float = 1.0) -> float:
        return 1.0 if scale <= 1 else 0.1 * m * math.log(scale) + 1.0

    attention_factor = p.get("attention_factor")
    if attention_factor is None:
        if p.get("mscale") and p.get("mscale_all_dim"):
            attention_factor = float(mscale(factor, p["mscale"]) / mscale(factor, p["mscale_all_dim"]))
        else:
            attention_factor = mscale(factor)
    beta_fast = p.get("beta_fast") or 32  # config.py checked every field's type and range
    beta_slow = p.get("beta_slow") or 1

    def correction_dim(rotations: float) -> float:
        return (dim * math.log(original / (rotations * 2 * math.pi))) / (2 * math.log(base))

    low, high = correction_dim(beta_fast), correction_dim(beta_slow)
    if not (math.isfinite(low) and math.isfinite(high)):  # config.py's ranges leave only extreme corners here
        raise ConfigError(f"yarn rope: beta_fast {beta_fast} / beta_slow {beta_slow} give no usable frequency range "
                          f"for original_max_position_embeddings {original}")
    if p.get("truncate", True):
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    if low == high:
        high += 0.001  # avoid a zero-width ramp
    pos_freqs = base ** (torch.arange(0, dim, 2).to(dtype=torch.float) / dim)
    extrapolation = 1.0 / pos_freqs
    interpolation = 1.0 / (factor * pos_freqs)
    ramp = torch.clamp((torch.arange(dim // 2, dtype=torch.float32) - low) / (high - low), 0, 1)
    keep = 1 - ramp
    return interpolation * (1 - keep) + extrapolation * keep, float(attention_factor)


class RotaryTables:
    """cos/sin for positions [0, length), grown on demand, kept in float32 and in the
    compute dtype (the cast transformers does on every call is done once here). They are
    rotary_dim wide: with partial_rotary_factor < 1 only a head's first rotary_dim
    dimensions rotate (apply_rotary passes the rest through).

    longrope picks its factors by the length of the sequence a forward pass reaches
    (transformers: max(position_ids) + 1 > original_max_position_embeddings → long, for
    every position of that pass). `cos`/`sin`, the tables the decode steps index by
    position, hold the short factors' rows below original_max_position_embeddings and the
    long factors' from there on: exactly what a one-token step at that position uses.
    `lookup` (the eager layers) does the same for a pass that continues a row (a later
    prefill chunk, a speculative verify pass, a chat turn: they agree with token-by-token
    decoding), and for a pass that starts a row (its first position 0, a prompt) takes the
    long table for every position once the row's last position is past the boundary
    (`long_cos`/`long_sin`), as transformers' forward of the whole sequence does."""

    def __init__(self, config: ModelConfig, device: torch.device, dtype: torch.dtype):
        self.inv_freq, self.scaling = inverse_frequencies(config)
        self.inv_freq = self.inv_freq.to(device)
        self.device, self.dtype = device, dtype
        self.rotary_dim = rotary_dim(config)
        self.cos = self.sin = torch.empty(0, self.rotary_dim, device=device, dtype=dtype)
        p = config.rope_parameters
        self.boundary: int | None = None  # longrope's original_max_position_embeddings
        if p["rope_type"] == "longrope":
            self.boundary = p["original_max_position_embeddings"]
            self.long_inv_freq = inverse_frequencies(config, long=True)[0].to(device)
            self.long_cos = self.long_sin = self.cos

    def _table(self, inv_freq: torch.Tensor, length: int) -> tuple[torch.Tensor, torch.Tensor]:
        positions = torch.arange(length, device=self.device, dtype=torch.int64)
        freqs = positions[:, None].float() * inv_freq.float()
        emb = torch.cat((freqs, freqs), dim=-1)
        return (emb.cos() * self.scaling).to(self.dtype), (emb.sin() * self.scaling).to(self.dtype)

    def ensure(self, length: int) -> None:
        if length <= self.cos.shape[0]:
            return
        length = max(length, 2 * self.cos.shape[0], 256)
        self.cos, self.sin = self._table(self.inv_freq, length)
        if self.boundary is not None:
            self.long_cos, self.long_sin = self._table(self.long_inv_freq, length)
            cut = min(self.boundary, length)
            self.cos = torch.cat((self.cos[:cut], self.long_cos[cut:]))
            self.sin = torch.cat((self.sin[:cut], self.long_sin[cut:]))

    def lookup(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """positions [B, T] → cos, sin [B, 1, T, rotary_dim] (broadcast over heads)."""
        cos, sin = self.cos[positions], self.sin[positions]
        if self.boundary is not None:
            # per row, by its own length; a row continuing its cache keeps the per-position rows
            long = ((positions[:, 0] == 0) & (positions.amax(dim=1) + 1 > self.boundary)).view(-1, 1, 1)
            cos = torch.where(long, self.long_cos[positions], cos)
            sin = torch.where(long, self.long_sin[positions], sin)
        return cos.unsqueeze(1), sin.unsqueeze(1)


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x [B, H, T, D] rotated by the rotate-half convention used by HF checkpoints; only
    the first cos.shape[-1] dimensions when that is less than D (partial rotary)."""
    width = cos.shape[-1]
    if width != x.shape[-1]:
        rot, rest = x[..., :width], x[..., width:]
        return torch.cat((apply_rotary(rot, cos, sin), rest), dim=-1)
    half = x.shape[-1] // 2
    rotated = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
    return x * cos + rotated * sin
