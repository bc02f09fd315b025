import time
import mlx.core as mx
import numpy as np
L, N, H = 30, 7928, 3
idx = N * H * 64 * 4 // 8  # bytes of one 4-bit index array
norm = N * H * 2
def arr(nbytes):
    return mx.array(np.random.randint(0, 255, size=nbytes, dtype=np.uint8))
layouts = {
 "shipped_241": {f"{l}.{kv}.{part}": arr(sz) for l in range(L) for kv in "kv" for part, sz in (("mu", 384), ("sink", 1536), ("idx", idx), ("norm", norm))},
 "per_layer_kv_60": {f"{l}.{kv}": arr(384 + 1536 + idx + norm) for l in range(L) for kv in "kv"},
 "per_layer_30": {f"{l}": arr(2 * (384 + 1536 + idx + norm)) for l in range(L)},
 "idx_60_small_1": {**{f"{l}.{kv}.idx": arr(idx) for l in range(L) for kv in "kv"}, "small": arr(L * 2 * (384 + 1536 + norm))},
 "chunks_16": {f"c{i}": arr(L * 2 * (384 + 1536 + idx + norm) // 16) for i in range(16)},
}
for name, arrs in layouts.items():
    p = f"/tmp/{name}.safetensors"; mx.save_safetensors(p, arrs); n = len(arrs); del arrs
    ts, fs = [], []
    for _ in range(9):
        t = time.perf_counter(); d = mx.load(p); mx.eval(list(d.values())); t1 = time.perf_counter()
        mx.eval([a.astype(mx.float32).sum() for a in d.values()]); t2 = time.perf_counter()
        ts.append(t1 - t); fs.append(t2 - t1); del d
    print(name, n, "load min/med", round(min(ts)*1e3, 2), round(sorted(ts)[4]*1e3, 2), "first pass", round(min(fs)*1e3, 2), flush=True)
