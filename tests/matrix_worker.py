"""The restoring half of the architecture matrix (tests/test_models_matrix.py), in a new process.

Reads a JSON job on stdin: {"question": str, "tokens": int, "families": [{"name", "home",
"tq4", "fp16", "export_dir"}]} where tq4/fp16 are entry ids stored in `home`. For every family
it restores both entries as `ask` would (checksums, CPU decode-once), then measures:
- `kl`: KL(fp16 || tq4) of the next-token distributions at every position of the question and
  the fp16 greedy answer (teacher-forced: one forward pass over question + answer per cache);
- `gaps`: at each answer position, fp16's top logit minus its logit of tq4's greedy token;
- `kl_no_document`: KL(fp16 || no cache) at the same positions: what the document changes;
- `greedy`: each cache's greedy answer tokens, and `text`, the answer `ask` would print;
- `export`: each entry exported to a stock mlx-lm prompt cache (`manage.export`), loaded with
  `mlx_lm.models.cache.load_prompt_cache` and continued by the plain mlx-lm model: its layer
  types and offsets, KL(fp16 restore || export) on the fp16 answer, KL(same entry restored ||
  export) on that entry's own answer, its greedy answer and its `gaps` against the restore.
Writes one JSON object per family on stdout: the results, or {"error": traceback}.
"""

from __future__ import annotations

import json
import os
import sys
import traceback


def _kl(p_logits, q_logits) -> list[float]:
    """KL(p || q) in nats per position of two (L, V) logit arrays."""
    import mlx.core as mx

    lp = p_logits.astype(mx.float32) - mx.logsumexp(p_logits.astype(mx.float32), axis=-1, keepdims=True)
    lq = q_logits.astype(mx.float32) - mx.logsumexp(q_logits.astype(mx.float32), axis=-1, keepdims=True)
    return (mx.exp(lp) * (lp - lq)).sum(axis=-1).tolist()


def _gaps(logits, n_suffix: int, chosen: list[int]) -> list[float]:
    """Per answer token: how far below the top logit of `logits` (the forced pass of a reference
    answer) its token `chosen` there lies. 0 where they agree; meaningful up to the first
    disagreement, where the reference and `chosen` still share their prefix."""
    import mlx.core as mx

    rows = logits[n_suffix - 1 : n_suffix - 1 + len(chosen)].astype(mx.float32)  # (n, V)
    picked = mx.take_along_axis(rows, mx.array(chosen, dtype=mx.int32)[:, None], axis=-1)[:, 0]
    return (rows.max(axis=-1) - picked).tolist()


def _family(job: dict, fam: dict) -> dict:
    import mlx.core as mx
    from mlx_lm.models.cache import load_prompt_cache

    from longctx import engine, kvcache, manage, prompt, session
    from longctx.runtime import models
    from longctx.store import Store

    os.environ["LONGCTX_HOME"] = fam["home"]
    n = job["tokens"]
    entries = {p: manage.find_entry(fam[p]) for p in ("tq4", "fp16")}
    lm = models.load(models.resolve(entries["fp16"].model_spec))
    store = Store(cleanup=False)
    try:
        caches = {p: session.restore(e, lm, store) for p, e in entries.items()}
    finally:
        store.close()
    entry = entries["fp16"]
    lay = (
        prompt.Layout(prefix_text="", suffix_text=entry.question_suffix)
        if entry.question_suffix
        else prompt.layout(lm.tokenizer, entry.name, "")
    )
    suffix = prompt.question_tokens(lm.tokenizer, lay, job["question"])
    out = {"kinds": [type(c).__name__ for c in caches["tq4"]], "greedy": {}, "text": {}}
    for p, cache in caches.items():
        out["greedy"][p] = engine.greedy_tokens(lm.model, suffix, kvcache.fork(cache), n)
        out["text"][p] = "".join(engine.generate(lm.model, lm.tokenizer, suffix, kvcache.fork(cache), max_tokens=n))
    forced = mx.array([suffix + out["greedy"]["fp16"]], dtype=mx.int32)  # (1, Lq + n)
    logits = {p: lm.model(forced, cache=kvcache.fork(c))[0] for p, c in caches.items()}  # (L, V)
    out["kl"] = _kl(logits["fp16"], logits["tq4"])
    out["gaps"] = _gaps(logits["fp16"], len(suffix), out["greedy"]["tq4"])
    # What the document changes: the same positions with no document in the cache at all
    blind = lm.model(forced, cache=kvcache.make(lm.model, kvcache.get_preset("fp16")))[0]
    out["kl_no_document"] = _kl(logits["fp16"], blind)
    out["positions"] = int(forced.shape[1])
    out["export"] = {}
    for p, e in entries.items():
        path = str(manage.export(e.id, os.path.join(fam["export_dir"], f"{p}.safetensors")))
        stock, meta = load_prompt_cache(path, return_metadata=True)
        exported = {
            "types": [type(c).__name__ for c in stock],
            "offsets": [c.offset for c in stock],
            "entry": meta.get("longctx_entry"),
        }
        # plain mlx-lm attention from here on; each continuation from a freshly loaded cache
        exported["kl"] = _kl(logits["fp16"], lm.model(forced, cache=stock)[0])
        own = mx.array([suffix + out["greedy"][p]], dtype=mx.int32)  # this entry's own answer
        restored = lm.model(own, cache=kvcache.fork(caches[p]))[0]
        exported["kl_vs_restored"] = _kl(restored, lm.model(own, cache=load_prompt_cache(path))[0])
        exported["greedy"] = engine.greedy_tokens(lm.model, suffix, load_prompt_cache(path), n)
        exported["gaps"] = _gaps(restored, len(suffix), exported["greedy"])
        out["export"][p] = exported
    out["prefix_tokens"] = entry.tokens
    return out


def main() -> None:
    job = json.load(sys.stdin)
    for fam in job["families"]:
        try:
            result = _family(job, fam)
        except Exception:  # reported per family: one broken family does not hide the others
            result = {"error": traceback.format_exc()}
        print(json.dumps({"name": fam["name"], **result}), flush=True)


if __name__ == "__main__":
    main()
