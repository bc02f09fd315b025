"""Where the time to a first answer token goes, phase by phase, for (b) mlx-lm's prompt cache and
(c) a longctx restore of one preset (see benchmarks/restore.py for the comparison itself).

(b): load_prompt_cache (arrays evaluated), then the question through longctx's loop.
(c): open the store, read the file (its checksums start on other threads), rebuild the caches
(arrays evaluated), decode once (CPU only), the question, then the wait for the checksums still
running (`ask` shows the first token after it). Best of --repeat per phase; JSON under
benchmarks/results/.

Usage: python benchmarks/diagnostics/restore_phases.py --tokens 4096 [--preset tq4] [--model SPEC]
"""

from __future__ import annotations

import sys
import time
from pathlib import Path

sys.path[:0] = [str(Path(__file__).resolve().parent), str(Path(__file__).resolve().parents[1])]  # diagnostics/, benchmarks/
from _common import document_of, setup, write  # noqa: E402

from longctx.runtime.blas import tune_malloc  # noqa: E402

tune_malloc()

import mlx.core as mx  # noqa: E402

from longctx import engine, kvcache, session  # noqa: E402
from longctx.store import Store  # noqa: E402

QUESTION = "What does the document say about the chief engineer?"


def main() -> None:
    args, home, lm = setup([4096], "phases")
    from mlx_lm.models.cache import load_prompt_cache, make_prompt_cache, save_prompt_cache

    preset = kvcache.get_preset(args.preset)
    rows = []
    for n in args.tokens:
        doc, prefix, question = document_of(lm, home, n, QUESTION)
        base = make_prompt_cache(lm.model)
        engine.prefill(lm.model, prefix, base)
        path = home / f"mlxlm-{n}.safetensors"
        save_prompt_cache(str(path), base)
        del base
        entry = session.ingest(doc, model=args.model, preset=args.preset).entry
        times: dict[str, list[float]] = {}

        def lap(name: str, start: float) -> float:
            now = time.perf_counter()
            times.setdefault(name, []).append(now - start)
            return now

        for _ in range(args.repeat):
            t = time.perf_counter()
            loaded = load_prompt_cache(str(path))
            mx.eval([c.state for c in loaded])
            t = lap("b_load", t)
            engine.greedy_tokens(lm.model, question, loaded, 1)
            lap("b_question", t)
            del loaded
            t = time.perf_counter()
            store = Store(cleanup=False)  # as `ask` opens it
            t = lap("c_open", t)
            arrays, _, pending = store.load_verifying(entry, lambda m: None)
            t = lap("c_read", t)
            cache = kvcache.from_arrays(arrays, lm.model, preset, getattr(mx, lm.dtype))
            mx.eval([c.state for c in cache])
            t = lap("c_rebuild", t)
            if mx.default_device().type == mx.DeviceType.cpu:
                kvcache.decode_once(cache)
            t = lap("c_decode_once", t)
            store.close()
            engine.greedy_tokens(lm.model, question, kvcache.fork(cache), 1)
            t = lap("c_question", t)
            pending.wait()
            lap("c_verify_wait", t)
            del cache, arrays
        row = {
            "tokens": len(prefix),
            "question_tokens": len(question),
            "preset": args.preset,
            "b_bytes": path.stat().st_size,
            "c_bytes": entry.bytes,
            **{k: min(v) for k, v in times.items()},
            "all_s": times,
        }
        row["b_total"] = row["b_load"] + row["b_question"]
        row["c_total"] = sum(row[k] for k in ("c_open", "c_read", "c_rebuild", "c_decode_once", "c_question", "c_verify_wait"))
        rows.append(row)
        print(
            f"N={row['tokens']}: "
            + " ".join(f"{k} {row[k] * 1e3:.1f}ms" for k in row if k.startswith(("b_", "c_")) and not k.endswith("bytes"))
        )
    device = "cpu" if lm.dtype == "float32" else "gpu"
    out = write(
        args.name or f"restore_phases_{device}",
        {"model": lm.ref.model_id, "model_spec": args.model, "dtype": lm.dtype, "question": QUESTION, "rows": rows},
    )
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
