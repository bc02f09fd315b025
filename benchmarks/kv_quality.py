"""KV cache quality per preset on real text nobody here wrote, against the uncompressed cache.

For each length N: a haystack of license texts (Debian's /usr/share/common-licenses: GPL-3,
LGPL-2.1, MPL-2.0, Apache-2.0, ...) with `--needles` RULER needles ("One of the special magic
numbers for X is: N.") at evenly spread depths, laid out as `longctx ingest` lays out a
document, is prefilled ONCE uncompressed; every preset's cache is then the compression an
ingest stores (`longctx.bench.quality.compressed`). Per preset:
- answer KL(fp16 || preset), perplexity and top-1 agreement over the prefix's last `--answer`
  tokens, teacher-forced in steps of 16 from an answering fork of the cache of the tokens before
  them (the exact prefix truncated: keys of a position depend on earlier tokens only);
- needle in a haystack: each needle's question asked from a fork of the whole prefix's cache,
  greedy, scored by RULER's string match.

`--peers` adds the TurboQuant packages on PyPI (mlx-turboquant, turboquant-mlx-full; `load_peers`),
imported from `--peers-site`: each layer's cache of theirs is given the exact prefix's keys and
values in one `update_and_fetch`, as a prefill gives them chunk by chunk (both quantize each
token on its own), then answers teacher-forced and needles asked on it directly (a fresh one each;
the answer's and question's own tokens are stored quantized too, as the packages store them).

Results: benchmarks/results/kv_quality_<cpu|h100|h200>.json (one run per length, appended as
each length finishes).

Usage: python benchmarks/kv_quality.py [--model M] [--lengths 2048 8192 16384] [--presets ...] [--peers]
"""

from __future__ import annotations

import argparse
import functools
import importlib.metadata
import json
import math
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import RESULTS, environment, machine_tag  # noqa: E402

import mlx.core as mx  # noqa: E402

from longctx import engine, kvcache, prompt  # noqa: E402
from longctx.bench import haystack, niah, quality  # noqa: E402
from longctx.kvcache.presets import bits_per_channel  # noqa: E402
from longctx.runtime import models  # noqa: E402

LICENSES = Path("/usr/share/common-licenses")
TEXTS = ("GPL-3", "LGPL-2.1", "MPL-2.0", "Apache-2.0", "GPL-2", "Artistic", "GFDL-1.3", "MPL-1.1")
PRESETS = ["fp16", "tq5k4v", "tq4", "tq4k3v", "tq3+qjl", "tq3", "rvq2+2"]
PEERS_SITE = "/tmp/peers/site"
PEERS_INSTALL = "pip install --no-deps --target {site} mlx-turboquant==0.0.2 turboquant-mlx-full==0.30.0"


def license_corpus(folder: Path) -> list:
    """The license texts as haystack essays (copied as .txt files for `haystack.load_corpus`)."""
    missing = [t for t in TEXTS if not (LICENSES / t).exists()]
    if len(missing) == len(TEXTS):
        raise SystemExit(f"no license texts in {LICENSES} (Debian/Ubuntu base-files)")
    for t in TEXTS:
        if t not in missing:
            (folder / f"{t}.txt").write_text((LICENSES / t).read_text(encoding="utf-8", errors="replace"))
    return haystack.load_corpus(folder)


def _qjl_sign_dot(qproj, packed, rnorm_c):
    """mlx-turboquant's QJL correction `kernels.qjl_dot.qjl_sign_dot` (a Metal kernel) in MLX ops."""
    from mlx_turboquant.qjl import unpack_signs_pm1

    signs = unpack_signs_pm1(packed, qproj.shape[-1])  # (G, NK, D) of +-1
    out = (qproj.astype(mx.float32) @ signs.swapaxes(-1, -2)) * rnorm_c[:, None, :].astype(mx.float32)
    return out.astype(qproj.dtype)  # (G, M, NK)


def load_peers(site: Path, model) -> dict:
    """The peers' configurations: name -> (package, version, make(model) -> per-layer caches,
    stored bits per channel averaged over keys and values, as each package counts them)."""
    sys.path.insert(0, str(site))
    try:
        import mlx_turboquant
        from turboquant_mlx.layers.polar_kv_cache import make_turboquant_cache
    except ImportError as e:
        raise SystemExit(f"{e}: install the peers with `{PEERS_INSTALL.format(site=site)}`")
    # Its rotated keys need rotated queries: register() rebinds mlx-lm's attention function where the
    # stock one still sits, so before longctx's routing wraps it (kvcache.make of a turbo preset).
    mlx_turboquant.register()
    if not getattr(sys.modules[type(model).__module__].scaled_dot_product_attention, "_turboquant_wrapped", False):
        raise SystemExit("mlx-turboquant's query rotation is not on the model's attention")
    if not mx.metal.is_available():  # its QJL correction is a Metal kernel only
        import mlx_turboquant.kernels.qjl_dot

        mlx_turboquant.kernels.qjl_dot.qjl_sign_dot = _qjl_sign_dot
    d = kvcache.head_dims(model)[0]

    # mlx-turboquant: mlx-lm's affine codes, an fp16 scale and bias per 64 channels; QJL adds a sign
    # bit per key channel and an fp16 residual norm per key (README's KB/token table, kv_cache.py;
    # scales and biases take the keys' dtype, so an fp32 model's cache holds 0.5 bit/ch more)
    def mtq(bits: int, qjl: bool = False) -> tuple:
        make = lambda m: mlx_turboquant.make_prompt_cache(m, kv_bits=bits, qjl=qjl)
        return "mlx-turboquant", make, bits + 32 / 64 + qjl * (1 + 16 / d) / 2

    # turboquant-mlx-full: 32 // b codes per uint32 word, an fp16 RMS per 64 channels
    # (TurboQuantKVCache._tq_quantize; its nbytes and docstring's ratios, 3-bit ~4.6x, agree)
    def tqf(k: int, v: int) -> tuple:
        side = lambda b: 32 * math.ceil(d / (32 // b)) / d + 16 / 64
        return "turboquant-mlx-full", lambda m: make_turboquant_cache(m, k_bits=k, v_bits=v), (side(k) + side(v)) / 2

    configs = {
        "mlx-turboquant 4-bit": mtq(4),
        "mlx-turboquant 3-bit": mtq(3),
        "mlx-turboquant 3-bit+QJL": mtq(3, qjl=True),  # its README's 3-bit recommendation
        "turboquant-mlx-full K4V4": tqf(4, 4),
        "turboquant-mlx-full K3V3": tqf(3, 3),
        "turboquant-mlx-full K8V3": tqf(8, 3),  # its recommended default
    }
    return {f"peer:{k}": (p, importlib.metadata.version(p), make, b) for k, (p, make, b) in configs.items()}


def peer_cache(model, make, exact: list, upto: int | None = None) -> list:
    """A peer's cache of the exact prefix (its first `upto` tokens), given whole to each layer."""
    cache = make(model)
    for src, dst in zip(exact, cache):
        n = src.offset if upto is None else min(upto, src.offset)
        dst.update_and_fetch(src.keys[..., :n, :], src.values[..., :n, :])
        mx.eval(vars(dst))  # its stored arrays (other attributes are skipped)
    return cache


def scored(n: int, name: str, bits: float, s: dict, fp16_ppl: float, answers: list[str], case) -> dict:
    """A preset's row, printed."""
    found = [niah.string_match_all(text, probe.answers) for text, probe in zip(answers, case.probes)]
    r = {
        "bits_per_channel": round(bits, 3),
        "answer_kl": s["kl"],
        "answer_ppl": s["ppl"],
        "ppl_delta_pct": 100 * (s["ppl"] / fp16_ppl - 1),
        "top1": s["top1"],
        "niah": found,
        "niah_score": sum(found) / len(found),
        "answers": answers,
    }
    print(
        f"[{n}] {name:>8} {r['bits_per_channel']:6.2f} b/ch  KL {r['answer_kl']:.5f}  "
        f"dppl {r['ppl_delta_pct']:+6.2f}%  top1 {100 * r['top1']:5.1f}%  "
        f"NIAH {sum(found):g}/{len(found)}",
        file=sys.stderr,
        flush=True,
    )
    return r


def run_length(lm, n: int, presets: list[str], needles: int, answer: int, essays, seed: int, peers: dict) -> dict:
    tok = lm.tokenizer
    depths = [i / (needles - 1) for i in range(needles)] if needles > 1 else [0.5]
    cache_pieces: dict[str, int] = {}

    def piece_tokens(s: str) -> int:
        if s not in cache_pieces:
            cache_pieces[s] = len(tok.encode(s, add_special_tokens=False))
        return cache_pieces[s]

    case = niah.make_case("single", n, depths, 0, seed, tok, essays, n, piece_tokens)
    lay = prompt.layout(tok, niah.DOC_NAME, case.text)
    ids = prompt.prefix_tokens(tok, lay)
    print(f"[{n}] prefix {len(ids)} tokens, {needles} needles; exact prefill...", file=sys.stderr, flush=True)
    exact, prefill_s = quality.prefill_exact(lm.model, ids)
    head = len(ids) - answer
    row = {
        "tokens": len(ids),
        "answer_tokens": answer,
        "prefill_seconds": round(prefill_s, 1),
        "depths": list(case.needle_depths),
        "presets": {},
    }
    suffixes = [prompt.question_tokens(tok, lay, probe.question) for probe in case.probes]
    truncated, ref = {}, []
    for p in presets:
        truncated[p] = quality.compressed(lm.model, exact, p, upto=head)
    scores = quality.answer_scores(lm.model, truncated, ids[head - 1 :], ref=ref)
    del truncated
    for p in presets:
        full = quality.compressed(lm.model, exact, p)
        answers = [niah.cut_answer(quality.ask(lm.model, tok, full, s, max_tokens=24)) for s in suffixes]
        bits = bits_per_channel(kvcache.get_preset(p), kvcache.head_dims(lm.model)[0], len(ids))
        row["presets"][p] = scored(n, p, bits, scores[p], scores["fp16"]["ppl"], answers, case)
        del full
    for p, (package, version, make, bits) in peers.items():
        row["presets"][p] = {"package": package, "version": version}
        try:
            truncated = {p: functools.partial(peer_cache, lm.model, make, exact, head)}
            s = quality.answer_scores(lm.model, truncated, ids[head - 1 :], ref=ref)[p]
            answers = [
                niah.cut_answer("".join(engine.generate(lm.model, tok, q, peer_cache(lm.model, make, exact), max_tokens=24)))
                for q in suffixes
            ]
        except Exception as e:  # a peer that fails on this model is a result too
            row["presets"][p]["error"] = f"{type(e).__name__}: {e}".splitlines()[0]
            print(f"[{n}] {p}: {row['presets'][p]['error']}", file=sys.stderr, flush=True)
            continue
        row["presets"][p].update(scored(n, p, bits, s, scores["fp16"]["ppl"], answers, case))
    row["expected"] = [list(p.answers) for p in case.probes]
    return row


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default=None, help="default: longctx's default model")
    ap.add_argument("--lengths", type=int, nargs="+", default=[2048, 8192, 16384])
    ap.add_argument("--presets", nargs="+", default=PRESETS)
    ap.add_argument("--needles", type=int, default=5)
    ap.add_argument("--answer", type=int, default=256)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--name", default=None)
    ap.add_argument("--peers", action="store_true", help="also the TurboQuant packages on PyPI (PEERS_INSTALL)")
    ap.add_argument("--peers-site", type=Path, default=Path(PEERS_SITE), help="the folder they are installed in")
    args = ap.parse_args()

    lm = models.load(models.resolve(args.model))
    peers = load_peers(args.peers_site, lm.model) if args.peers else {}
    presets = ["fp16"] + [p for p in args.presets if p != "fp16"]
    out = RESULTS / f"{args.name or 'kv_quality_' + machine_tag()}.json"
    data = {
        "model": lm.ref.model_id,
        "dtype": lm.dtype,
        "text": "Debian common-licenses: " + ", ".join(TEXTS),
        "method": "one exact prefill per length; each preset's cache = the compression ingest stores",
        **({"peers": "each peer cache = its update_and_fetch of the exact prefix, one call per layer; no fork"} if peers else {}),
        "runs": [],
    }
    if out.exists():  # a run of other lengths adds to the file (one file per machine)
        old = json.loads(out.read_text())
        if old.get("model") == data["model"]:
            data["runs"] = [r for r in old["runs"] if not any(abs(r["tokens"] - n) < 64 for n in args.lengths)]
    start = time.perf_counter()
    with tempfile.TemporaryDirectory() as folder:
        essays = license_corpus(Path(folder))
        for n in args.lengths:
            data["runs"].append(run_length(lm, n, presets, args.needles, args.answer, essays, args.seed, peers))
            data["runs"].sort(key=lambda r: r["tokens"])
            data["seconds"] = round(time.perf_counter() - start, 1)
            out.write_text(json.dumps({"environment": environment(), **data}, indent=1))
            mx.clear_cache()
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
