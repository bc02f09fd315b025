"""Cache kinds: one adapter per per-layer cache class, in an explicit registry.

Each adapter owns what differs between kinds: the names of its arrays in a cache file, writing
them, rebuilding a cache from them, its KV head count, and its stock mlx-lm form for `export`.
A kind is found by the cache object's exact class (`kind_of`), never by a name read from disk,
so nothing in a file chooses what code runs. Adding a cache kind is one class here (plus its
expected shapes in `store/layout.py`).

    class                        adapter      arrays of layer i
    mlx-lm KVCache               Exact        {i}.k, {i}.v float16 (B, H, T, D)
    mlx-lm QuantizedKVCache      Affine       {i}.{k,v}.{w,s,b}
    TurboQuantCache              Compressed   {i}.{k,v}.<codec part> (see kvcache/__init__)
    mlx-lm RotatingKVCache       Rotating     {i}.k, {i}.v float16 (B, H, min(T, W), D)
"""

from __future__ import annotations

AFFINE_PARTS = ("w", "s", "b")


class Kind:
    """The adapter interface; `cls()` returns the cache class it serves."""

    @staticmethod
    def cls():
        raise NotImplementedError

    def to_arrays(self, c, i: int) -> dict:
        """Layer `i`'s named arrays (empty: the layer holds nothing yet)."""
        raise NotImplementedError

    def from_arrays(self, template, i: int, arrays: dict, layer: dict, ctx: dict):
        """A cache like `template` holding the stored arrays; `layer`: this layer's arrays
        (stacked ones split), `ctx`: preset, head dims, dtype, prefix length."""
        raise NotImplementedError

    def heads(self, c) -> int:
        """The KV head count the filled cache holds."""
        raise NotImplementedError

    def stock(self, c, affine_bits: int):
        """The equivalent stock mlx-lm cache (fp16, or affine `affine_bits`)."""
        raise NotImplementedError

    def fork(self, c, exact_new: int):
        """A cache sharing `c`'s tokens read-only; its appends never touch `c` (`kvcache.fork`)."""
        raise NotImplementedError


def _fp16_stock(keys, values, n: int, affine_bits: int):
    import mlx.core as mx
    from mlx_lm.models.cache import KVCache

    stock = KVCache()
    stock.state = (keys.astype(mx.float16), values.astype(mx.float16), n)
    if affine_bits:
        group = 64 if keys.shape[-1] % 64 == 0 else 32
        stock = stock.to_quantized(group_size=group, bits=affine_bits)
    return stock


class Exact(Kind):
    @staticmethod
    def cls():
        from mlx_lm.models.cache import KVCache

        return KVCache

    def to_arrays(self, c, i):
        import mlx.core as mx

        n = c.offset
        keys, values = c.state[0], c.state[1]
        return {
            f"{i}.k": keys[..., :n, :].astype(mx.float16),  # (B, H, L, D)
            f"{i}.v": values[..., :n, :].astype(mx.float16),
        }

    def from_arrays(self, template, i, arrays, layer, ctx):
        keys, values = arrays[f"{i}.k"], arrays[f"{i}.v"]
        template.state = (keys.astype(ctx["dtype"]), values.astype(ctx["dtype"]), keys.shape[2])
        return template

    def heads(self, c):
        return int(c.keys.shape[1])

    def stock(self, c, affine_bits):
        n = c.offset
        return _fp16_stock(c.state[0][..., :n, :], c.state[1][..., :n, :], n, affine_bits)

    def fork(self, c, exact_new):
        n = c.offset
        f = type(c)()
        f.state = (c.state[0][..., :n, :], c.state[1][..., :n, :], n)
        return f


class Affine(Kind):
    @staticmethod
    def cls():
        from mlx_lm.models.cache import QuantizedKVCache

        return QuantizedKVCache

    def to_arrays(self, c, i):
        n = c.offset
        return {
            f"{i}.{tag}.{part}": arr[..., :n, :]
            for tag, parts in (("k", c.keys), ("v", c.values))
            for part, arr in zip(AFFINE_PARTS, parts)
        }

    def from_arrays(self, template, i, arrays, layer, ctx):
        k = tuple(arrays[f"{i}.k.{p}"] for p in AFFINE_PARTS)
        v = tuple(arrays[f"{i}.v.{p}"] for p in AFFINE_PARTS)
        template.keys, template.values, template.offset = k, v, k[0].shape[2]
        return template

    def heads(self, c):
        return int(c.keys[0].shape[1])

    def stock(self, c, affine_bits):
        import mlx.core as mx

        n = c.offset
        keys, values = (
            mx.dequantize(*(a[..., :n, :] for a in parts), group_size=c.group_size, bits=c.bits) for parts in (c.keys, c.values)
        )
        return _fp16_stock(keys, values, n, affine_bits)

    def fork(self, c, exact_new):
        n = c.offset
        f = type(c)(group_size=c.group_size, bits=c.bits)
        f.keys = tuple(a[..., :n, :] for a in c.keys)
        f.values = tuple(a[..., :n, :] for a in c.values)
        f.offset = n
        return f


class Compressed(Kind):
    @staticmethod
    def cls():
        # deferred: loads mlx.core, numpy (the light commands start without it)
        from longctx.kvcache.turbo import TurboQuantCache

        return TurboQuantCache

    def to_arrays(self, c, i):
        c.seal()
        return {f"{i}.{k}": v for k, v in c.arrays().items()}

    def from_arrays(self, template, i, arrays, layer, ctx):
        # deferred: loads mlx.core, numpy (the light commands start without it)
        from longctx.kvcache.turbo import TurboQuantCache

        return TurboQuantCache.from_arrays(ctx["preset"], template.layer, layer, ctx["head_dims"][i], template.paths)

    def heads(self, c):
        return int(c.means[0].shape[1])

    def stock(self, c, affine_bits):
        keys, values = c.dense()
        return _fp16_stock(keys, values, c.offset, affine_bits)

    def fork(self, c, exact_new):
        return c.fork(exact_new)


def rotating_tokens(c) -> tuple:
    """A RotatingKVCache's live tokens in temporal order: the `keep` first, then the newest."""
    import mlx.core as mx

    keys, values = c._temporal_order(c.keys), c._temporal_order(c.values)  # (B, H, L, D)
    n = min(c.offset, c.max_size)
    if keys.shape[2] > n:
        tail = n - c.keep
        keys = mx.concatenate([keys[..., : c.keep, :], keys[..., keys.shape[2] - tail :, :]], axis=2)
        values = mx.concatenate([values[..., : c.keep, :], values[..., values.shape[2] - tail :, :]], axis=2)
    return keys, values


def rotating_like(c, keys, values, offset: int):
    """A RotatingKVCache like `c` (window, keep) holding `keys`/`values` as its newest tokens."""
    from mlx_lm.models.cache import RotatingKVCache

    f = RotatingKVCache(max_size=c.max_size, keep=c.keep)
    if keys is not None:
        f.keys, f.values = keys[..., :, :], values[..., :, :]  # own objects: writes stay here
        f.offset, f._idx = offset, keys.shape[2]
    return f


class Rotating(Kind):
    """Sliding-window layers: uncompressed whatever the preset (only the newest W are live)."""

    @staticmethod
    def cls():
        from mlx_lm.models.cache import RotatingKVCache

        return RotatingKVCache

    def to_arrays(self, c, i):
        import mlx.core as mx

        if c.keys is None:
            return {}
        keys, values = rotating_tokens(c)
        return {f"{i}.k": keys.astype(mx.float16), f"{i}.v": values.astype(mx.float16)}

    def from_arrays(self, template, i, arrays, layer, ctx):
        keys, values = arrays[f"{i}.k"], arrays[f"{i}.v"]
        return rotating_like(template, keys.astype(ctx["dtype"]), values.astype(ctx["dtype"]), ctx["tokens"])

    def heads(self, c):
        return int(c.keys.shape[1])

    def stock(self, c, affine_bits):  # stays a rotating fp16 cache (mlx-lm cannot quantize it)
        import mlx.core as mx

        keys, values = rotating_tokens(c)
        return rotating_like(c, keys.astype(mx.float16), values.astype(mx.float16), c.offset)

    def fork(self, c, exact_new):
        if c.keys is None:
            return rotating_like(c, None, None, 0)
        return rotating_like(c, *rotating_tokens(c), c.offset)


REGISTRY: tuple[Kind, ...] = (Exact(), Affine(), Compressed(), Rotating())


def kind_of(c) -> Kind | None:
    """The adapter serving cache object `c` (by its exact class), or None."""
    for kind in REGISTRY:
        if type(c) is kind.cls():
            return kind
    return None
