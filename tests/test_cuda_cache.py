"""runtime/cuda_kernels: longctx's compiled CUDA kernels on disk, where MLX looks for them.

On the CPU: the generated source is MLX 0.32's `build_kernel` text, the module name its
`{name}_{std::hash:x}`, a launch that cannot be cached is skipped with a reason, a file pair
present is a hit, and `longctx/__init__` points MLX's cache folder into longctx's home. With
NVRTC at hand (`LONGCTX_TEST_NVRTC`: a folder holding the pip `nvidia/` packages) a real kernel is
compiled and written. On a CUDA GPU: MLX loads the written file (a file planted under the
predicted name, compiled from another body, is what runs).
"""

from __future__ import annotations

import ctypes
import os
import subprocess
import sys
from pathlib import Path

import mlx.core as mx
import pytest

from longctx.runtime import cuda_kernels as cc
from longctx.kernels import _prelude

SPEC = _prelude.KernelSpec(name="lc_probe", inputs=("x", "n"), outputs=("out",),
                           source="out[lc_gid] = x[lc_gid] + 1.0f;")


def _launch(template=(("NT", 32),), dtype=mx.float32):
    return _prelude.Launch([mx.zeros((32,), dtype), mx.array([32], mx.int32)], list(template),
                           (32, 1, 1), (32, 1, 1), [(32,)], [mx.float32])


def test_mlx_source_is_build_kernel_text():
    launch = _launch(template=(("NT", 32), ("T", mx.bfloat16)), dtype=mx.bfloat16)
    src = cc.mlx_source("custom_kernel_k", "#define H 1\n", "BODY x_strides", ("x", "n"),
                        launch.inputs, ("out",), launch.output_dtypes, launch.template)
    assert src == (
        '\n#include "mlx/backend/cuda/device/utils.cuh"\n\n#include <cooperative_groups.h>\n\n'
        "#define H 1\nnamespace mlx::core::cu {\n\nnamespace cg = cooperative_groups;\n\n"
        "__global__ void custom_kernel_k(\n"
        "    const __nv_bfloat16* x,\n    const __grid_constant__ Strides x_strides,\n"
        "    const int32_t* n,\n    float* out) {\n"
        "  constexpr int NT = 32;\n  using T = __nv_bfloat16;\n\n"
        "BODY x_strides\n}\n\n} // namespace mlx::core::cu\n")
    assert cc.template_suffix(launch.template) == "_32_bfloat16_t"
    # no template: no constants block
    plain = cc.mlx_source("k", "", "B", ("x",), [mx.zeros((2,))], ("o",), [mx.float16], [])
    assert plain.endswith("    __half* o) {\nB\n}\n\n} // namespace mlx::core::cu\n")


def test_module_name_is_libstdcxx_hash():
    # std::hash<std::string> of libstdc++ (printed by a g++ program): MLX's `{:x}` of it
    assert cc.std_hash(b"") == 0x553E93901E462A6E
    assert cc.std_hash(b"abc") == 0x32D82BF8ED3DBA39
    assert cc.module_name("custom_kernel_x", "abc") == "custom_kernel_x_32d82bf8ed3dba39"


def test_prepare_skips_what_it_cannot_name(monkeypatch, tmp_path):
    monkeypatch.setenv("MLX_PTX_CACHE_DIR", str(tmp_path))
    before = dict(cc.STATS)
    assert cc.prepare("lc_probe_0", "", SPEC.source, SPEC.inputs, SPEC.outputs,
                      _launch(template=(("FLAG", True),))) == "skip"
    assert "not an int" in cc.STATS["last_skip"]
    monkeypatch.setattr(cc, "_STATE", {"nvrtc": None, "why": "no libnvrtc"})
    assert cc.prepare("lc_probe_0", "", SPEC.source, SPEC.inputs, SPEC.outputs, _launch()) == "skip"
    assert cc.STATS["last_skip"] == "no libnvrtc"
    assert cc.STATS["skip"] == before["skip"] + 2
    assert not list(tmp_path.iterdir())


def test_prepare_hits_an_existing_pair(monkeypatch, tmp_path):
    monkeypatch.setenv("MLX_PTX_CACHE_DIR", str(tmp_path))
    monkeypatch.setattr(cc, "_STATE", {"nvrtc": None, "why": "no libnvrtc"})
    launch = _launch()
    kernel = "custom_kernel_lc_probe_0" + cc.template_suffix(launch.template)
    src = cc.mlx_source(kernel, "", SPEC.source, SPEC.inputs, launch.inputs, SPEC.outputs,
                        launch.output_dtypes, launch.template)
    path = tmp_path / (cc.module_name(kernel, src) + ".ptx")
    path.write_bytes(b"cubin")
    # the .ptx alone is not complete (written last; MLX would find no kernel name)
    assert cc.prepare("lc_probe_0", "", SPEC.source, SPEC.inputs, SPEC.outputs, launch) == "skip"
    path.with_suffix(".txt").write_text(f"mlx::core::cu::{kernel}\tmangled\n")
    hits = cc.STATS["hit"]
    assert cc.prepare("lc_probe_0", "", SPEC.source, SPEC.inputs, SPEC.outputs, launch) == "hit"
    assert cc.STATS["hit"] == hits + 1


def test_cache_dir_follows_mlx(monkeypatch):
    monkeypatch.setenv("MLX_PTX_CACHE_DIR", "/x/y")
    assert cc.cache_dir() == Path("/x/y")
    monkeypatch.delenv("MLX_PTX_CACHE_DIR")
    for k in ("TMP", "TEMP", "TEMPDIR"):
        monkeypatch.delenv(k, raising=False)
    monkeypatch.setenv("TMPDIR", "/scratch")
    assert cc.cache_dir() == Path("/scratch/mlx") / mx.__version__ / "ptx"


@pytest.mark.skipif(sys.platform == "darwin", reason="CUDA only")
def test_init_points_mlx_cache_into_home(tmp_path):
    code = "import os, longctx; print(os.environ.get('MLX_PTX_CACHE_DIR'))"
    env = {k: v for k, v in os.environ.items() if k != "MLX_PTX_CACHE_DIR"}
    env["LONGCTX_HOME"] = str(tmp_path)
    root = str(Path(__file__).resolve().parents[1])
    env["PYTHONPATH"] = root + os.pathsep + env.get("PYTHONPATH", "")

    def child(**extra):
        out = subprocess.run([sys.executable, "-c", code], env={**env, **extra}, cwd=root,
                             capture_output=True, text=True, check=True)
        return out.stdout.strip()

    assert child() == str(tmp_path / "cuda-kernels" / f"mlx-{mx.__version__}")
    assert child(MLX_PTX_CACHE_DIR="/mine") == "/mine"  # the user's setting stays
    assert child(LONGCTX_CUDA_KERNEL_CACHE="0") == "None"
    assert not (tmp_path / "cuda-kernels").exists()  # nothing created at import


def _nvrtc_from(folder: str) -> cc._Nvrtc:
    lib = next(Path(folder).glob("nvidia/*/lib/libnvrtc.so.*"))
    for builtins in lib.parent.glob("libnvrtc-builtins.so*"):
        ctypes.CDLL(str(builtins), mode=ctypes.RTLD_GLOBAL)
    ctypes.CDLL(str(lib), mode=ctypes.RTLD_GLOBAL)
    return cc._Nvrtc()


@pytest.mark.skipif(not os.environ.get("LONGCTX_TEST_NVRTC"),
                    reason="set LONGCTX_TEST_NVRTC to a folder holding pip's nvidia/ packages")
def test_prepare_compiles_and_writes(monkeypatch, tmp_path):
    monkeypatch.setenv("MLX_PTX_CACHE_DIR", str(tmp_path))
    monkeypatch.setattr(cc, "_STATE", {"nvrtc": _nvrtc_from(os.environ["LONGCTX_TEST_NVRTC"]),
                                       "arch": "sm_90a"})
    header, body = _prelude.assemble(SPEC, "cuda")
    launch = _launch()
    assert cc.prepare("lc_probe_0", header, body, SPEC.inputs, SPEC.outputs, launch) == "write"
    (ptx,) = tmp_path.glob("*.ptx")
    assert ptx.read_bytes()[:4] == b"\x7fELF"  # a cubin
    name, mangled = ptx.with_suffix(".txt").read_text().rstrip("\n").split("\t")
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
    spec = _prelude.KernelSpec(name="lc_probe", inputs=("x", "n"), outputs=("out",),
                               source=f"const int lc_t = 0x{token}; (void)lc_t;\n"
                                      "out[lc_gid] = x[lc_gid] + 1.0f;")
    launch = _launch()
    _prelude._mlx_kernel(spec, "cuda")
    name, header, body = _prelude._SOURCES[("cuda", spec)]
    assert cc.enabled()
    assert cc.prepare(name, header, body, spec.inputs, spec.outputs, launch) == "write"
    kernel = "custom_kernel_" + name + cc.template_suffix(launch.template)
    src = cc.mlx_source(kernel, header, body, spec.inputs, launch.inputs, spec.outputs,
                        launch.output_dtypes, launch.template)
    path = cc.cache_dir() / (cc.module_name(kernel, src) + ".ptx")
    other = cc.mlx_source(kernel, header, body.replace("+ 1.0f", "+ 2.0f"), spec.inputs,
                          launch.inputs, spec.outputs, launch.output_dtypes, launch.template)
    nvrtc, arch = cc._nvrtc_and_arch()
    cubin, mangled = nvrtc.compile(other, "probe", "mlx::core::cu::" + kernel, arch)
    assert path.with_suffix(".txt").read_text().split("\t")[1].strip() == mangled
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
        return lambda **launch: [mx.zeros(s, d) for s, d in
                                 zip(launch["output_shapes"], launch["output_dtypes"])]

    monkeypatch.setattr(mx.fast, "cuda_kernel", fake_cuda_kernel)
    monkeypatch.setattr(_prelude, "CUDA_PREPARE", lambda *a: seen.append(a))
    spec = _prelude.KernelSpec(name="lc_probe_dispatch", inputs=("x", "n"), outputs=("out",),
                               source=f"out[lc_gid] = (float)0x{os.urandom(3).hex()};")
    with _prelude.force_backend("cuda"):
        for template in ((("NT", 32),), (("NT", 32),), (("NT", 64),)):
            _prelude.run(spec, _launch(template))
            _prelude.run(spec, _launch(template), reference=lambda: [mx.zeros((32,))])
    assert [a[5].template for a in seen] == [[("NT", 32)], [("NT", 64)]]
    (name,) = made
    assert all(a[0] == name and (a[1], a[2]) == made[name] for a in seen)
    assert seen[0][3:5] == (("x", "n"), ("out",))
