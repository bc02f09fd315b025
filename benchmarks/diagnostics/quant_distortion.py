"""Distortion of the TurboQuant codecs: MSE of unit vectors, inner-product bias/RMS, bits/channel.

For head dims 64 and 128 and the configs scalar b=1..4, RVQ 2+1/2+2/3+1/3+2 (conditional stage-2
codebooks; the shared-codebook variant alongside for comparison) and scalar b=2,3 + QJL:

- mse: mean ||u - u_hat||^2 over random unit vectors u (the design value and, for scalar
  configs, the Gaussian Lloyd-Max value next to it);
- inner products of unit vectors, q.k_hat - q.k, for independent pairs ("rand") and correlated
  pairs k = normalize(0.8 q + 0.6 n) ("corr", q.k ~ 0.8): mean bias, its z-score (bias / standard
  error), and RMS; with the QJL correction added for QJL configs (MSE-only numbers alongside);
- bits per channel (per-codec constants ignored, see longctx.quant.bits).

Usage: python benchmarks/diagnostics/quant_distortion.py [--n 20000] [--seed 0]
"""

from __future__ import annotations

import argparse
import math
import sys
import time
from pathlib import Path

import numpy as np

sys.path[:0] = [str(Path(__file__).resolve().parent), str(Path(__file__).resolve().parents[1])]  # diagnostics/, benchmarks/
from _common import write  # noqa: E402  (imports longctx first: OpenBLAS before mlx)

import mlx.core as mx  # noqa: E402

from longctx.quant.codec import QuantSpec, VectorCodec  # noqa: E402
from longctx.quant.rvq import ResidualQuantizer  # noqa: E402

GAUSSIAN_LM = {1: 0.3634, 2: 0.1175, 3: 0.03454, 4: 0.009497}
CONFIGS = (
    [("scalar", QuantSpec(b)) for b in (1, 2, 3, 4)]
    + [("rvq", QuantSpec(b1, b2)) for b1, b2 in ((2, 1), (2, 2), (3, 1), (3, 2))]
    + [("qjl", QuantSpec(b, qjl=True)) for b in (2, 3)]
)


def _unit(a: np.ndarray) -> np.ndarray:
    return (a / np.linalg.norm(a, axis=-1, keepdims=True)).astype(np.float32)


def _stats(err: np.ndarray) -> dict:
    se = err.std() / math.sqrt(len(err))
    return {"bias": float(err.mean()), "z": float(err.mean() / se), "rms": float(np.sqrt(np.mean(err**2)))}


def _ip_errors(codec: VectorCodec, q: np.ndarray, k: np.ndarray) -> dict:
    """Inner-product errors of N pairs (q, k): (N, dim) unit vectors each."""
    qm, km = mx.array(q[:, None]), mx.array(k[:, None])  # (N, 1, D): one key per pair
    enc = codec.encode(km)
    q_rot = codec.rotate(qm)
    est = (q_rot @ codec.decode_rotated(enc).swapaxes(-1, -2))[:, 0, 0]  # (N,)
    true = np.sum(q * k, axis=-1)
    out = {"true_mean": float(true.mean()), "mse_only": _stats(np.array(est) - true)}
    if codec.qjl is not None:
        corr = codec.qjl_correction(codec.qjl_project(q_rot), enc)[:, 0, 0]
        out["qjl"] = _stats(np.array(est + corr) - true)
    return out


def _shared_rvq_mse(dim: int, spec: QuantSpec, u: np.ndarray, seed: int) -> float:
    """MSE of the same RVQ config with one shared stage-2 codebook (for comparison)."""
    codec = VectorCodec(dim, QuantSpec(spec.bits), seed)
    rq = ResidualQuantizer(codec.padded_dim, spec.bits, spec.bits2, conditional=False)
    y = codec.rotate(mx.array(u))
    return float(mx.mean(mx.sum((rq.dequantize(*rq.quantize(y)) - y) ** 2, axis=-1)))


def run(n: int, seed: int) -> list[dict]:
    rng = np.random.default_rng(seed)
    rows = []
    for dim in (64, 128):
        u = _unit(rng.standard_normal((n, dim)))
        q_rand, k_rand = _unit(rng.standard_normal((n, dim))), _unit(rng.standard_normal((n, dim)))
        q_corr = _unit(rng.standard_normal((n, dim)))
        k_corr = _unit(0.8 * q_corr + 0.6 * _unit(rng.standard_normal((n, dim))))
        for kind, spec in CONFIGS:
            codec = VectorCodec(dim, spec, seed=seed + 1)
            t = time.perf_counter()
            uh = codec.decode(codec.encode(mx.array(u)))
            mse = float(mx.mean(mx.sum((uh - mx.array(u)) ** 2, axis=-1)))
            row = {
                "dim": dim,
                "kind": kind,
                "bits": spec.bits,
                "bits2": spec.bits2,
                "qjl": spec.qjl,
                "mse": mse,
                "mse_design": codec.unit_mse,
                "mse_gaussian_lloyd_max": GAUSSIAN_LM.get(spec.bits) if kind == "scalar" else None,
                "turboquant_bound": math.sqrt(3) * math.pi / 2 * 4.0 ** -(spec.bits + spec.bits2),
                "rand": _ip_errors(codec, q_rand, k_rand),
                "corr": _ip_errors(codec, q_corr, k_corr),
                "bits_per_channel": codec.bits_per_channel(),
                "breakdown": codec.bit_breakdown()["per_vector"],
            }
            if kind == "rvq":
                row["mse_shared_stage2"] = _shared_rvq_mse(dim, spec, u, seed + 1)
            row["seconds"] = time.perf_counter() - t
            rows.append(row)
    return rows


def _name(r: dict) -> str:
    if r["kind"] == "rvq":
        return f"rvq {r['bits']}+{r['bits2']}"
    return f"b={r['bits']}" + (" +qjl" if r["qjl"] else "")


def print_table(rows: list[dict]) -> None:
    print(
        f"{'dim':>4} {'config':<10} {'bits/ch':>7} {'mse':>8} {'design':>8} {'ref':>8} "
        f"{'rand bias':>10} {'rand rms':>9} {'corr bias':>10} {'(z)':>6} {'corr rms':>9} "
        f"{'mse-only corr bias':>18}"
    )
    for r in rows:
        est = "qjl" if r["qjl"] else "mse_only"
        ref = r["mse_gaussian_lloyd_max"] or r.get("mse_shared_stage2")
        ref_s = f"{ref:8.5f}" if ref is not None else f"{'-':>8}"
        print(
            f"{r['dim']:>4} {_name(r):<10} {r['bits_per_channel']:>7.3f} {r['mse']:>8.5f} "
            f"{r['mse_design']:>8.5f} {ref_s} "
            f"{r['rand'][est]['bias']:>10.5f} {r['rand'][est]['rms']:>9.5f} "
            f"{r['corr'][est]['bias']:>10.5f} {r['corr'][est]['z']:>6.1f} "
            f"{r['corr'][est]['rms']:>9.5f} {r['corr']['mse_only']['bias']:>18.5f}"
        )
    print(
        "ref: Gaussian Lloyd-Max d*MSE for scalar rows, shared-stage-2 MSE for rvq rows. "
        "Biases and RMS are of q.k_hat - q.k for unit q, k (corr: q.k ~ 0.8); "
        "qjl rows include the QJL correction, whose MSE-only bias is in the last column."
    )


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--n", type=int, default=20_000, help="vectors / pairs per measurement")
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args()
    rows = run(args.n, args.seed)
    print_table(rows)
    out = write("quant_distortion", {"n": args.n, "seed": args.seed, "correlation": 0.8, "rows": rows})
    print(f"wrote {out}", file=sys.stderr)


if __name__ == "__main__":
    main()
