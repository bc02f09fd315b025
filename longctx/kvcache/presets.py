"""Named KV cache presets: how keys and values are stored, in memory and on disk.

- `fp16`: mlx-lm's `KVCache`; half precision on disk.
- `affine8`, `affine4`: mlx-lm's own `QuantizedKVCache` (group 64), for comparison.
- `tq4`, `tq3`, `tq4k3v`: TurboQuant, rotated Lloyd-Max keys and values at the given bits.
- `tq3+qjl`: 3-bit keys plus a 1-bit QJL sketch of their residual; 3-bit values.
- `rvq2+2`: two-stage (2+2 bit) residual keys; 3-bit values.
- `tq5k4v`: 5-bit keys, 4-bit values (the quality option).

Compressed presets keep the newest 128 tokens uncompressed in memory (`window`): ingest's chunks
see their predecessor exactly; files hold those tokens compressed. An answering fork
(`kvcache.fork`) keeps more: its question and answer, up to `kvcache.ANSWER_EXACT` tokens. They also keep the first 4 tokens of the sequence
exact, on disk too (`sink`, fp16): attention sinks draw a large share of every query's attention,
so their key error shifts every distribution. On SmolLM2-135M's answer path (KL vs fp16, tq4) the
window takes 0.071 to 0.038 nats and the sink then to 0.004 (benchmarks/kv_quality.py).

The default is `tq4`: the measurements in the README show 3-bit values or keys (<= 3.6 bits per
channel) cost this model too much quality.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass

from longctx.errors import ConfigError


@dataclass(frozen=True)
class Preset:
    """A KV storage recipe. `kind` picks the cache class; the rest configures TurboQuant."""

    name: str
    kind: str  # "fp16" | "affine" | "turbo"
    description: str
    key_bits: int = 0
    key_bits2: int = 0  # second RVQ stage for keys (0: none)
    key_qjl: bool = False
    value_bits: int = 0
    affine_bits: int = 0
    window: int = 0  # newest tokens kept uncompressed in memory (never on disk)
    sink: int = 0  # first tokens of the sequence kept uncompressed (in memory and on disk)
    seed: int = 0x7C0FFEE
    key_bits_layers: tuple = ()  # (layer, bits) pairs: layers whose keys take other bits

    def key_bits_of(self, layer: int) -> int:
        """The key bits of `layer` (`key_bits` unless `key_bits_layers` names it)."""
        return dict(self.key_bits_layers).get(layer, self.key_bits)

    def to_json(self) -> dict:
        d = asdict(self)
        if not self.key_bits_layers:  # files written before the field read the same
            del d["key_bits_layers"]
        return d


WINDOW = 128
SINK = 4


def _turbo(name: str, description: str, **bits) -> Preset:
    """A TurboQuant preset with the shared window and sink."""
    return Preset(name, "turbo", f"TurboQuant: {description}", window=WINDOW, sink=SINK, **bits)


PRESETS = {
    p.name: p
    for p in (
        Preset("fp16", "fp16", "uncompressed keys and values, half precision"),
        Preset("affine8", "affine", "mlx-lm 8-bit affine quantized cache (group 64)", affine_bits=8),
        Preset("affine4", "affine", "mlx-lm 4-bit affine quantized cache (group 64)", affine_bits=4),
        _turbo("tq4", "4-bit rotated Lloyd-Max keys and values", key_bits=4, value_bits=4),
        _turbo("tq4k3v", "4-bit keys, 3-bit values", key_bits=4, value_bits=3),
        _turbo("tq3", "3-bit keys and values", key_bits=3, value_bits=3),
        _turbo("tq3+qjl", "3-bit keys + 1-bit QJL residual sketch, 3-bit values", key_bits=3, key_qjl=True, value_bits=3),
        _turbo("rvq2+2", "two-stage 2+2-bit keys, 3-bit values", key_bits=2, key_bits2=2, value_bits=3),
        _turbo("tq5k4v", "5-bit keys, 4-bit values", key_bits=5, value_bits=4),
    )
}
DEFAULT_PRESET = "tq4"


def get_preset(name: str) -> Preset:
    """The preset called `name`, or a ConfigError listing the known ones."""
    if name not in PRESETS:
        raise ConfigError(f"Unknown KV preset '{name}'; choose one of: {', '.join(PRESETS)}.")
    return PRESETS[name]


def bits_per_channel(preset: Preset, head_dim: int, tokens: int | None = None) -> float:
    """Stored bits per key/value channel, averaged over keys and values, all-in.

    fp16: 16. affine: packed bits plus an fp16 scale and bias per group. turbo: indices, norms,
    sketches, plus per-cache constants amortized over `tokens` (codec constants from
    `longctx.quant.bits`, the fp32 centering mean and the fp16 sink tokens).
    """
    if preset.kind == "fp16":
        return 16.0
    if preset.kind == "affine":
        group = 64 if head_dim % 64 == 0 else 32
        return preset.affine_bits + 32 / group
    # deferred: loads mlx.core, numpy (the light commands start without it)
    from longctx.quant.bits import kv_bits

    # deferred: loads mlx.core, numpy (the light commands start without it)
    from longctx.quant.codec import QuantSpec

    keys = QuantSpec(bits=preset.key_bits, bits2=preset.key_bits2, qjl=preset.key_qjl)
    parts = kv_bits(head_dim, keys, QuantSpec(bits=preset.value_bits), None)
    if tokens is None:  # asymptotic: every token compressed, constants vanish
        return parts["average"]
    sink = min(tokens, preset.sink)
    total = 0.0
    for side in ("keys", "values"):
        b = parts[side]
        total += (tokens - sink) * b["vector_bits"] + b["constant_bits"] + (16 * sink + 32) * head_dim
    return total / (2 * tokens * head_dim)
