"""Compiled CUDA kernels kept on disk between processes, where MLX looks for them.

MLX compiles each `mx.fast.cuda_kernel` with NVRTC on its first launch in a process, 1-3 s per
kernel source (`benchmarks/diagnostics/nvrtc_compile.py`): a fresh `longctx ask` on CUDA paid ~5 s
before its first token (`benchmarks/diagnostics/first_step.py`). MLX keeps the compiled code of its
own kernels in a cache directory (`MLX_PTX_CACHE_DIR`, by default `<temp>/mlx/<version>/ptx`) but
not that of custom kernels: `CustomKernel::eval_gpu` asks for the module with its disk cache off,
which turns off the WRITING only. Every module, custom ones included, is first looked up in that
directory (mlx 0.32 `JitModule::JitModule`: `read_cached_ptx` before the builder), under the name
`custom_kernel_<name><template hash>_<std::hash of the generated source, hex>`.

So before the first launch of each variant in a process, `prepare` builds the exact source MLX
will generate for it (`mlx_source`, mlx 0.32's `build_kernel`), names its module as MLX will
(`module_name`: libstdc++'s `std::_Hash_bytes`, which `std::hash<std::string>` is), and, when
that file is missing, compiles the source with NVRTC itself (same options as MLX; MLX's device
header replaced by the few declarations the signature needs) and writes the cubin and its
kernel's mangled name there. MLX then loads that file instead of compiling: ~ms, in this process
and every later one. The launch itself is MLX's, unchanged (inputs, shapes and strides as always).
`install()` hands `prepare` to the kernels' dispatcher (`_prelude.CUDA_PREPARE`); the compressed
cache's module installs it when imported.

Anything that does not fit (another MLX version, a template value that is not an int or a
dtype, a name too long for one file, no NVRTC or libstdc++ found, a compile error, a folder that
cannot be written) skips the file: MLX compiles as it always did, and `prepare` never raises. A
wrong guess of the name is harmless the same way (the file is never read). The files live in
MLX's own folder (machine-local by default, so GPUs of other architectures on other machines
never share them); the `.txt` carries the cubin's architecture on a line MLX ignores (no tab),
and a file compiled for another architecture is compiled again. `disable()` turns it off
(MLX then compiles the kernels in every process: benchmarks compare).
"""

from __future__ import annotations

import ctypes
import ctypes.util
import os
import sys
import tempfile
import threading
import time
from pathlib import Path

import mlx.core as mx

from longctx.kernels import _prelude

_ENABLED = [True]  # `disable()`

# mlx versions whose custom-kernel source layout, module naming and NVRTC options this
# reproduces (checked on an H100: tests/test_cuda_cache.py, test_cuda_kernel_cache_file_is_loaded)
MLX_VERSIONS = ("0.32.4",)
MAX_FILE_NAME = 245  # mlx get_ptx_path: longer module names become nested folders (not written)
HASH_SEED = 0xC70F6907  # libstdc++'s seed for std::hash<std::string>

CUDA_TYPES = {
    mx.bool_: "bool",
    mx.int8: "int8_t",
    mx.int16: "int16_t",
    mx.int32: "int32_t",
    mx.int64: "int64_t",
    mx.uint8: "uint8_t",
    mx.uint16: "uint16_t",
    mx.uint32: "uint32_t",
    mx.uint64: "uint64_t",
    mx.float16: "__half",
    mx.bfloat16: "__nv_bfloat16",
    mx.float32: "float",
}
# the names mlx's template hash gives dtypes (its own type names for the two half types)
TYPE_STRINGS = {**CUDA_TYPES, mx.float16: "float16_t", mx.bfloat16: "bfloat16_t"}

# What MLX's device header gives the generated signature (mlx/backend/cuda/device/utils.cuh,
# config.h: MAX_NDIM 10); our kernel bodies use nothing else of it.
DEVICE_HEADER = r"""#pragma once
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda/std/array>
#include <cuda/std/limits>
#define MAX_NDIM 10
namespace mlx::core::cu {
using Shape = cuda::std::array<int32_t, MAX_NDIM>;
using Strides = cuda::std::array<int64_t, MAX_NDIM>;
}
"""
DEVICE_HEADER_NAME = "mlx/backend/cuda/device/utils.cuh"

# counts and seconds of this process: hits (file there), writes (compiled here), skips
STATS = {"hit": 0, "write": 0, "skip": 0, "compile_s": 0.0, "last_skip": ""}
_LOCK = threading.Lock()


def enabled() -> bool:
    return sys.platform.startswith("linux") and mx.__version__ in MLX_VERSIONS and _ENABLED[0]


def disable() -> None:
    """Stop writing and loading longctx's kernel files in this process: MLX compiles the kernels
    itself, as without longctx's files (`benchmarks/diagnostics/first_step.py` compares)."""
    _ENABLED[0] = False


def install() -> None:
    """Have the kernels' dispatcher call `prepare` before each variant's first CUDA launch."""
    _prelude.CUDA_PREPARE = prepare


def mlx_source(kernel_name: str, header: str, body: str, input_names, inputs, output_names, output_dtypes, template) -> str:
    """The source `mx.fast.cuda_kernel` generates for this launch (mlx 0.32 `build_kernel`)."""
    parts = [
        '\n#include "mlx/backend/cuda/device/utils.cuh"\n\n#include <cooperative_groups.h>\n\n',
        header,
        "namespace mlx::core::cu {\n\nnamespace cg = cooperative_groups;\n\n",
        "__global__ void ",
        kernel_name,
        "(\n",
    ]
    for name, arr in zip(input_names, inputs):
        parts += ["    const ", CUDA_TYPES[arr.dtype], "* ", name, ",\n"]
        if arr.ndim > 0:
            if name + "_shape" in body:
                parts += ["    const __grid_constant__ Shape ", name, "_shape,\n"]
            if name + "_strides" in body:
                parts += ["    const __grid_constant__ Strides ", name, "_strides,\n"]
            if name + "_ndim" in body:
                parts += ["    const __grid_constant__ int ", name, "_ndim,\n"]
    outs = list(zip(output_names, output_dtypes))
    for i, (name, dtype) in enumerate(outs):
        parts += ["    ", CUDA_TYPES[dtype], "* ", name, ",\n" if i < len(outs) - 1 else ") {\n"]
    if template:
        for name, value in template:
            if isinstance(value, mx.Dtype):
                parts.append(f"  using {name} = {CUDA_TYPES[value]};\n")
            else:
                parts.append(f"  constexpr int {name} = {int(value)};\n")
        parts.append("\n")
    parts += [body, "\n}\n\n} // namespace mlx::core::cu\n"]
    return "".join(parts)


def template_suffix(template) -> str:
    """mlx's `template_arguments_hash` (ints and dtypes)."""
    return "".join(f"_{TYPE_STRINGS[v]}" if isinstance(v, mx.Dtype) else f"_{int(v)}" for _, v in template)


ARCH_LINE = "arch "  # the .txt's line naming the cubin's architecture (no tab: MLX skips it)


_HASH = []


def std_hash(data: bytes) -> int:
    """std::hash<std::string> of libstdc++ (what MLX's module name carries, in hex)."""
    if not _HASH:
        lib = ctypes.CDLL(ctypes.util.find_library("stdc++") or "libstdc++.so.6")
        fn = lib._ZSt11_Hash_bytesPKvmm
        fn.restype, fn.argtypes = ctypes.c_size_t, [ctypes.c_char_p, ctypes.c_size_t, ctypes.c_size_t]
        _HASH.append(fn)
    return _HASH[0](data, len(data), HASH_SEED)


def module_name(kernel_name: str, source: str) -> str:
    return f"{kernel_name}_{std_hash(source.encode()):x}"


def cache_dir() -> Path:
    """Where MLX looks: `MLX_PTX_CACHE_DIR`, else `<temp>/mlx/<version>/ptx`
    (std::filesystem::temp_directory_path: TMPDIR, TMP, TEMP, TEMPDIR, else /tmp)."""
    env = os.environ.get("MLX_PTX_CACHE_DIR")
    if env:
        return Path(env)
    tmp = next(
        (os.environ[k] for k in ("TMPDIR", "TMP", "TEMP", "TEMPDIR") if os.environ.get(k)),
        "/tmp" if sys.platform != "win32" else tempfile.gettempdir(),
    )
    return Path(tmp) / "mlx" / mx.__version__ / "ptx"


def _loaded_library(stem: str) -> str | None:
    """The path of a shared library this process has loaded (`libnvrtc`: MLX links it)."""
    try:
        with open("/proc/self/maps") as f:
            for line in f:
                fields = line.rstrip("\n").split(None, 5)
                path = fields[5].removesuffix(" (deleted)") if len(fields) == 6 else ""
                if os.path.basename(path).startswith(stem + ".so"):
                    return path
    except OSError:
        pass
    return None


class _Nvrtc:
    """NVRTC through ctypes: the library MLX loaded (or `path`), MLX's include paths (or
    `includes`: `benchmarks/diagnostics/nvrtc_compile.py` compiles on a machine without a GPU)."""

    def __init__(self, path: str | None = None, includes: list[str] | None = None):
        path = path or _loaded_library("libnvrtc") or ctypes.util.find_library("nvrtc")
        if path is None:
            raise OSError("no libnvrtc")
        self.lib = ctypes.CDLL(path)
        self.path = path
        self.includes = includes if includes is not None else _include_paths(Path(path))

    def compile(self, source: str, name: str, kernel: str, arch: str) -> tuple[bytes, str]:
        """(cubin, mangled name of `kernel`) of `source`; raises with NVRTC's log."""
        lib, prog = self.lib, ctypes.c_void_p()
        headers = (ctypes.c_char_p * 1)(DEVICE_HEADER.encode())
        names = (ctypes.c_char_p * 1)(DEVICE_HEADER_NAME.encode())
        if lib.nvrtcCreateProgram(ctypes.byref(prog), source.encode(), (name + ".cu").encode(), 1, headers, names):
            raise RuntimeError("nvrtcCreateProgram failed")
        try:
            if lib.nvrtcAddNameExpression(prog, kernel.encode()):
                raise RuntimeError("nvrtcAddNameExpression failed")
            opts = [b"--device-as-default-execution-space", f"--gpu-architecture={arch}".encode()]
            opts += [f"--include-path={p}".encode() for p in self.includes]
            arr = (ctypes.c_char_p * len(opts))(*opts)
            if lib.nvrtcCompileProgram(prog, len(opts), arr):
                size = ctypes.c_size_t()
                lib.nvrtcGetProgramLogSize(prog, ctypes.byref(size))
                log = ctypes.create_string_buffer(size.value + 1)
                lib.nvrtcGetProgramLog(prog, log)
                raise RuntimeError("NVRTC: " + log.value.decode(errors="replace")[-400:])
            mangled = ctypes.c_char_p()
            if lib.nvrtcGetLoweredName(prog, kernel.encode(), ctypes.byref(mangled)):
                raise RuntimeError("nvrtcGetLoweredName failed")
            size = ctypes.c_size_t()
            if lib.nvrtcGetCUBINSize(prog, ctypes.byref(size)) or size.value == 0:
                raise RuntimeError("no cubin for " + arch)
            cubin = ctypes.create_string_buffer(size.value)
            lib.nvrtcGetCUBIN(prog, cubin)
            return cubin.raw, mangled.value.decode()
        finally:
            lib.nvrtcDestroyProgram(ctypes.byref(prog))


def _include_paths(nvrtc: Path) -> list[str]:
    """MLX's NVRTC include paths: its bundled headers (`mlx/include`, `mlx/include/cccl`), then
    the CUDA runtime's headers (the pip `nvidia` package beside mlx or beside libnvrtc, then
    CUDA_HOME / CUDA_PATH, then /usr/local/cuda)."""
    root = Path(mx.__file__).resolve().parent
    found = [str(p) for p in (root / "include", root / "include" / "cccl") if p.is_dir()]
    candidates = [nvrtc.parent.parent / "include"] if nvrtc.is_absolute() else []
    for base in [root.parent, *map(Path, sys.path)]:
        candidates += [base / "nvidia" / "cu13" / "include", base / "nvidia" / "cuda_runtime" / "include"]
    for env in ("CUDA_HOME", "CUDA_PATH"):
        if os.environ.get(env):
            candidates.append(Path(os.environ[env]) / "include")
    candidates.append(Path("/usr/local/cuda/include"))
    cuda = next((c for c in candidates if (c / "cuda_fp16.h").is_file()), None)
    if cuda is not None:
        found.append(str(cuda))
        if (
            not any(Path(p, "cuda", "std", "array").is_file() for p in found)
            and (cuda / "cccl" / "cuda" / "std" / "array").is_file()
        ):
            found.append(str(cuda / "cccl"))  # (CUDA 13's pip headers keep CCCL there)
    return found


_STATE: dict = {}


def _nvrtc_and_arch():
    if "nvrtc" not in _STATE:
        try:
            info = mx.device_info()
            major, minor = int(info["compute_capability_major"]), int(info["compute_capability_minor"])
            _STATE["arch"] = f"sm_{major}{minor}{'a' if major >= 9 else ''}"
            _STATE["nvrtc"] = _Nvrtc()
        except Exception as err:  # noqa: BLE001 - no NVRTC / no device info: MLX compiles itself
            _STATE["nvrtc"] = None
            _STATE["why"] = f"{type(err).__name__}: {err}"[:200]
    return _STATE["nvrtc"], _STATE.get("arch")


def _skip(why: str) -> str:
    STATS["skip"] += 1
    STATS["last_skip"] = why
    return "skip"


def prepare(name: str, header: str, body: str, input_names, output_names, launch) -> str:
    """Make sure MLX finds this launch's compiled module on disk: "hit" (already there),
    "write" (compiled and written now) or "skip" (left to MLX; STATS["last_skip"] says why).
    Never raises: whatever goes wrong leaves the kernel to MLX's own compilation."""
    try:
        return _prepare(name, header, body, input_names, output_names, launch)
    except Exception as err:  # noqa: BLE001 - a launch must never fail for its file
        return _skip(f"{type(err).__name__}: {err}"[:300])


_FAILED: set = set()  # modules this process could not compile or write (not tried again)


def _prepare(name, header, body, input_names, output_names, launch) -> str:
    if not enabled():
        return _skip(f"off (cuda_kernels.disable()), not Linux, or an mlx version other than {', '.join(MLX_VERSIONS)}")
    template = list(launch.template)
    if any(isinstance(v, bool) or not isinstance(v, (int, mx.Dtype)) for _, v in template):
        return _skip("template value that is not an int or a dtype")
    if not all(isinstance(a, mx.array) for a in launch.inputs):
        return _skip("an input that is not an array")
    kernel = "custom_kernel_" + name + template_suffix(template)
    source = mlx_source(kernel, header, body, input_names, launch.inputs, output_names, launch.output_dtypes, template)
    module = module_name(kernel, source)
    if len(module) > MAX_FILE_NAME:
        return _skip("module name longer than one file name")
    if module in _FAILED:
        return _skip("failed earlier in this process")
    nvrtc, arch = _nvrtc_and_arch()
    if nvrtc is None:
        return _skip(_STATE.get("why", "no NVRTC"))
    folder = cache_dir()
    path = folder / (module + ".ptx")
    with _LOCK:
        if _complete(path, arch):
            STATS["hit"] += 1
            return "hit"
        try:
            folder.mkdir(parents=True, exist_ok=True)
            if not os.access(folder, os.W_OK):
                raise PermissionError(f"{folder} is not writable")
            start = time.perf_counter()
            try:
                cubin, mangled = nvrtc.compile(source, module, "mlx::core::cu::" + kernel, arch)
            finally:
                STATS["compile_s"] += time.perf_counter() - start
            tag = f".{os.getpid()}.{threading.get_ident()}.tmp"
            txt = f"mlx::core::cu::{kernel}\t{mangled}\n{ARCH_LINE}{arch}\n".encode()
            for suffix, data in ((".txt", txt), (".ptx", cubin)):  # the .ptx last: it marks
                tmp = path.with_suffix(suffix + tag)  # the pair complete
                try:
                    tmp.write_bytes(data)
                    os.replace(tmp, path.with_suffix(suffix))
                finally:
                    tmp.unlink(missing_ok=True)
        except Exception:
            _FAILED.add(module)  # (MLX compiles it; this process does not try again)
            raise
        STATS["write"] += 1
    return "write"


def _complete(path: Path, arch: str) -> bool:
    """Whether the pair at `path` is there and compiled for `arch`."""
    try:
        if not path.is_file():
            return False
        return f"{ARCH_LINE}{arch}" in path.with_suffix(".txt").read_text().splitlines()
    except (OSError, UnicodeDecodeError):
        return False
