"""runtime/cuda_kernels: longctx's compiled CUDA kernels on disk, where MLX looks for them.

On the CPU: the generated source is MLX 0.32's `build_kernel` text, the module name its
`{name}_{std::hash:x}`, a launch that cannot be cached is skipped with a reason (never raised),
a complete pair for this architecture is a hit, a missing or foreign one is compiled (a stand-in
compiler) and written, a failed compile is not retried. With NVRTC at hand (`LONGCTX_TEST_NVRTC`: a folder holding the pip `nvidia/` packages) a real kernel is
compiled and written. On a CUDA GPU: MLX loads the written file (a file planted under the
predicted name, compiled from another body, is what runs).
"""

from __future__ import annotations

import ctypes
import os
from pathlib import Path

import mlx.core as mx
import pytest

from longctx.runtime import cuda_kernels as cc
from longctx.kernels import _prelude

SPEC = _prelude.KernelSpec(name="lc_probe", inputs=("x", "n"), outputs=("out",), source="out[lc_gid] = x[lc_gid] + 1.0f;")


def _launch(template=(("NT", 32),), dtype=mx.float32):
    return _prelude.Launch(
        [mx.zeros((32,), dtype), mx.array([32], mx.int32)], list(template), (32, 1, 1), (32, 1, 1), [(32,)], [mx.float32]
    )


def test_mlx_source_is_build_kernel_text():
    launch = _launch(template=(("NT", 32), ("T", mx.bfloat16)), dtype=mx.bfloat16)
    src = cc.mlx_source(
        "custom_kernel_k",
        "#define H 1\n",
        "BODY x_strides",
        ("x", "n"),
        launch.inputs,
        ("out",),
        launch.output_dtypes,
        launch.template,
    )
    assert src == (
        '\n#include "mlx/backend/cuda/device/utils.cuh"\n\n#include <cooperative_groups.h>\n\n'
        "#define H 1\nnamespace mlx::core::cu {\n\nnamespace cg = cooperative_groups;\n\n"
        "__global__ void custom_kernel_k(\n"
        "    const __nv_bfloat16* x,\n    const __grid_constant__ Strides x_strides,\n"
        "    const int32_t* n,\n    float* out) {\n"
        "  constexpr int NT = 32;\n  using T = __nv_bfloat16;\n\n"
        "BODY x_strides\n}\n\n} // namespace mlx::core::cu\n"
    )
    assert cc.template_suffix(launch.template) == "_32_bfloat16_t"
    # no template: no constants block
    plain = cc.mlx_source("k", "", "B", ("x",), [mx.zeros((2,))], ("o",), [mx.float16], [])
    assert plain.endswith("    __half* o) {\nB\n}\n\n} // namespace mlx::core::cu\n")


def test_module_name_is_libstdcxx_hash():
    # std::hash<std::string> of libstdc++ (printed by a g++ program): MLX's `{:x}` of it
    assert cc.std_hash(b"") == 0x553E93901E462A6E
    assert cc.std_hash(b"abc") == 0x32D82BF8ED3DBA39
    assert cc.module_name("custom_kernel_x", "abc") == "custom_kernel_x_32d82bf8ed3dba39"


class _FakeNvrtc:
    def __init__(self, fail=False):
        self.calls, self.fail = [], fail

    def compile(self, source, name, kernel, arch):
        self.calls.append((name, kernel, arch))
        if self.fail:
            raise RuntimeError("NVRTC: error")
        return b"\x7fELF cubin", "_Zmangled"


@pytest.fixture
def fake(monkeypatch, tmp_path):
    monkeypatch.setenv("MLX_PTX_CACHE_DIR", str(tmp_path))
    monkeypatch.setattr(cc, "MLX_VERSIONS", (mx.__version__,))
    monkeypatch.setattr(cc.sys, "platform", "linux")
    nvrtc = _FakeNvrtc()
    monkeypatch.setattr(cc, "_STATE", {"nvrtc": nvrtc, "arch": "sm_90a"})
    monkeypatch.setattr(cc, "_FAILED", set())
    return nvrtc, tmp_path


def _prep(launch):
    return cc.prepare("lc_probe_0", "", SPEC.source, SPEC.inputs, SPEC.outputs, launch)


def test_prepare_skips_what_it_cannot_name(fake, monkeypatch):
    nvrtc, folder = fake
    before = cc.STATS["skip"]
    assert _prep(_launch(template=(("FLAG", True),))) == "skip"
    assert "not an int" in cc.STATS["last_skip"]
    assert _prep(_launch(template=(("T", mx.complex64),))) == "skip"  # never raises
    assert "KeyError" in cc.STATS["last_skip"]
    monkeypatch.setattr(cc, "_STATE", {"nvrtc": None, "why": "no libnvrtc"})
    assert _prep(_launch()) == "skip"
    assert cc.STATS["last_skip"] == "no libnvrtc"
    monkeypatch.setattr(cc, "MLX_VERSIONS", ("0.0.1",))
    assert _prep(_launch()) == "skip" and "mlx version" in cc.STATS["last_skip"]
    assert cc.STATS["skip"] == before + 4
    assert not nvrtc.calls and not list(folder.iterdir())


def test_prepare_writes_then_hits(fake):
    nvrtc, folder = fake
    launch = _launch()
    assert _prep(launch) == "write"
    (ptx,) = folder.glob("*.ptx")
    kernel = "custom_kernel_lc_probe_0_32"
    src = cc.mlx_source(kernel, "", SPEC.source, SPEC.inputs, launch.inputs, SPEC.outputs, launch.output_dtypes, launch.template)
    assert ptx.name == cc.module_name(kernel, src) + ".ptx"
    assert ptx.read_bytes() == b"\x7fELF cubin"
    # MLX reads "name<TAB>mangled" lines; the arch line has no tab (MLX skips it)
    assert ptx.with_suffix(".txt").read_text() == f"mlx::core::cu::{kernel}\t_Zmangled\narch sm_90a\n"
    assert nvrtc.calls == [(ptx.stem, "mlx::core::cu::" + kernel, "sm_90a")]
    assert not [f for f in folder.iterdir() if f.suffix not in (".ptx", ".txt")]  # no tmp left
    hits = cc.STATS["hit"]
    assert _prep(launch) == "hit" and cc.STATS["hit"] == hits + 1
    assert len(nvrtc.calls) == 1


def test_prepare_recompiles_an_incomplete_or_foreign_pair(fake):
    nvrtc, folder = fake
    launch = _launch()
    assert _prep(launch) == "write"
    (ptx,) = folder.glob("*.ptx")
    txt = ptx.with_suffix(".txt")
    txt.write_text(txt.read_text().replace("sm_90a", "sm_80"))  # another GPU's cubin
    assert _prep(launch) == "write" and "arch sm_90a" in txt.read_text()
    txt.unlink()  # a .ptx without its .txt (MLX would find no kernel in it)
    assert _prep(launch) == "write" and len(nvrtc.calls) == 3


def test_prepare_does_not_retry_a_failed_compile(fake):
    nvrtc, folder = fake
    nvrtc.fail = True
    assert _prep(_launch()) == "skip" and "NVRTC: error" in cc.STATS["last_skip"]
    assert _prep(_launch()) == "skip" and "earlier" in cc.STATS["last_skip"]
    assert len(nvrtc.calls) == 1 and not list(folder.glob("*.ptx"))


def test_cache_dir_follows_mlx(monkeypatch):
    monkeypatch.setenv("MLX_PTX_CACHE_DIR", "/x/y")
    assert cc.cache_dir() == Path("/x/y")
    monkeypatch.delenv("MLX_PTX_CACHE_DIR")
    for k in ("TMP", "TEMP", "TEMPDIR"):
        monkeypatch.delenv(k, raising=False)
    monkeypatch.setenv("TMPDIR", "/scratch")
    assert cc.cache_dir() == Path("/scratch/mlx") / mx.__version__ / "ptx"


def _nvrtc_from(folder: str) -> cc._Nvrtc:
    lib = next(Path(folder).glob("nvidia/*/lib/libnvrtc.so.*"))
    for builtins in lib.parent.glob("libnvrtc-builtins.so*"):
        ctypes.CDLL(str(builtins), mode=ctypes.RTLD_GLOBAL)
    ctypes.CDLL(str(lib), mode=ctypes.RTLD_GLOBAL)
    return cc._Nvrtc()


@pytest.mark.skipif(
    not os.environ.get("LONGCTX_TEST_NVRTC"), reason="set LONGCTX_TEST_NVRTC to a folder holding pip's nvidia/ packages"
)
def test_prepare_compiles_and_writes(monkeypatch, tmp_path):
    monkeypatch.setenv("MLX_PTX_CACHE_DIR", str(tmp_path))
    monkeypatch.setattr(cc, "_STATE", {"nvrtc": _nvrtc_from(os.environ["LONGCTX_TEST_NVRTC"]), "arch": "sm_90a"})
    monkeypatch.setattr(cc, "MLX_VERSIONS", (mx.__version__,))
    monkeypatch.setattr(cc.sys, "platform", "linux")
    header, body = _prelude.assemble(SPEC, "cuda")
    launch = _launch()
    assert cc.prepare("lc_probe_0", header, body, SPEC.inputs, SPEC.outputs, launch) == "write"
    (ptx,) = tmp_path.glob("*.ptx")
    assert ptx.read_bytes()[:4] == b"\x7fELF"  # a cubin
    name, mangled = ptx.with_suffix(".txt").read_text().split("\n")[0].split("\t")
    assert name == "mlx::core::cu::custom_kernel_lc_probe_0_32"
    assert mangled.startswith("_ZN3mlx4core2cu") and "lc_probe_0_32" in mangled
    assert cc.prepare("lc_probe_0", header, body, SPEC.inputs, SPEC.outputs, launch) == "hit"


ON_CUDA = _prelude.backend() == "cuda"


@pytest.mark.skipif(not ON_CUDA, reason="needs a CUDA device")
def test_cuda_kernel_cache_file_is_loaded():
    """MLX runs the file planted under the module name `prepare` predicts: compiled from a body
    adding 2 where the kernel's own body adds 1. A wrong prediction (another source text, hash or
    name than MLX's) leaves the file unread: MLX compiles the kernel's body, and 1 is added."""
    token = os.urandom(4).hex()  # a kernel no process has built (its digest is new)
    spec = _prelude.KernelSpec(
        name="lc_probe",
        inputs=("x", "n"),
        outputs=("out",),
        source=f"const int lc_t = 0x{token}; (void)lc_t;\nout[lc_gid] = x[lc_gid] + 1.0f;",
    )
    launch = _launch()
    _prelude._mlx_kernel(spec, "cuda")
    name, header, body = _prelude._SOURCES[("cuda", spec)]
    assert cc.enabled()
    assert cc.prepare(name, header, body, spec.inputs, spec.outputs, launch) == "write"
    kernel = "custom_kernel_" + name + cc.template_suffix(launch.template)
    src = cc.mlx_source(kernel, header, body, spec.inputs, launch.inputs, spec.outputs, launch.output_dtypes, launch.template)
    path = cc.cache_dir() / (cc.module_name(kernel, src) + ".ptx")
    other = cc.mlx_source(
        kernel,
        header,
        body.replace("+ 1.0f", "+ 2.0f"),
        spec.inputs,
        launch.inputs,
        spec.outputs,
        launch.output_dtypes,
        launch.template,
    )
    nvrtc, arch = cc._nvrtc_and_arch()
    cubin, mangled = nvrtc.compile(other, "probe", "mlx::core::cu::" + kernel, arch)
    assert path.with_suffix(".txt").read_text().split("\n")[0].split("\t")[1] == mangled
    path.write_bytes(cubin)
    (out,) = _prelude.run(spec, launch)
    assert mx.all(out == 2.0).item(), "MLX did not load the planted file (module name differs)"


def test_dispatcher_prepares_each_cuda_variant_once(monkeypatch):
    """`_prelude.run` hands each variant to CUDA_PREPARE before its first CUDA launch, with the
    kernel name, header and body it gives MLX; the compressed cache's module installs `prepare`."""
    import longctx.kvcache.turbo  # noqa: F401

    assert _prelude.CUDA_PREPARE is cc.prepare
    seen, made = [], {}

    def fake_cuda_kernel(*, name, source, header, **kw):
        made[name] = (header, source)
        return lambda **launch: [mx.zeros(s, d) for s, d in zip(launch["output_shapes"], launch["output_dtypes"])]

    monkeypatch.setattr(mx.fast, "cuda_kernel", fake_cuda_kernel)
    monkeypatch.setattr(_prelude, "CUDA_PREPARE", lambda *a: seen.append(a))
    spec = _prelude.KernelSpec(
        name="lc_probe_dispatch", inputs=("x", "n"), outputs=("out",), source=f"out[lc_gid] = (float)0x{os.urandom(3).hex()};"
    )
    with _prelude.force_backend("cuda"):
        for template in ((("NT", 32),), (("NT", 32),), (("NT", 64),)):
            _prelude.run(spec, _launch(template))
            _prelude.run(spec, _launch(template), reference=lambda: [mx.zeros((32,))])
    assert [a[5].template for a in seen] == [[("NT", 32)], [("NT", 64)]]
    (name,) = made
    assert all(a[0] == name and (a[1], a[2]) == made[name] for a in seen)
    assert seen[0][3:5] == (("x", "n"), ("out",))

    def broken(*a):
        raise RuntimeError("no")

    monkeypatch.setattr(_prelude, "CUDA_PREPARE", broken)  # a launch never fails for its file
    with _prelude.force_backend("cuda"):
        (out,) = _prelude.run(spec, _launch((("NT", 128),)))
    assert out.shape == (32,)


@pytest.mark.skipif(not ON_CUDA, reason="needs a CUDA device")
def test_cuda_kernel_files_serve_the_answer_path(monkeypatch):
    """Every kernel a question and a decode step launch over a compressed cache gets its file
    (compiled against the stub header, or found): none is left to MLX's own compilation."""
    from longctx.kvcache import get_preset
    from longctx.kvcache.attention import compressed_attention
    from longctx.kvcache.turbo import TurboQuantCache

    # variants met earlier in this process are checked and prepared again
    monkeypatch.setattr(_prelude, "_PREPARED", set())
    monkeypatch.setattr(_prelude, "_VERIFIED", set())
    before = dict(cc.STATS)
    preset, (h, hq, d) = get_preset("tq4"), (8, 32, 128)
    c = TurboQuantCache(preset, 0)
    kv = mx.random.normal((1, h, 4096, d)).astype(mx.bfloat16)
    c.update_and_fetch(kv, kv)
    c.seal()
    fork = TurboQuantCache.from_arrays(preset, 0, c.arrays(), d).fork(exact_new=1024)
    for lq in (16, 1):
        k = mx.random.normal((1, h, lq, d)).astype(mx.bfloat16)
        q = mx.random.normal((1, hq, lq, d)).astype(mx.bfloat16)
        view, _ = fork.update_and_fetch(k, k)
        mx.eval(compressed_attention(q, view, d**-0.5, mask="causal" if lq > 1 else None))
    assert cc.STATS["skip"] == before["skip"], cc.STATS["last_skip"]
    assert cc.STATS["hit"] + cc.STATS["write"] > before["hit"] + before["write"]
