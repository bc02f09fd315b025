"""An optional native helper: `Tape`, a captured MLX graph replayed on new inputs (replay.cpp).

The decode step replays its kept plan through it instead of `mx.compile`'s call where it is built
(`attend_step`): the same primitives over the same inputs, in less host time per layer and token
(`benchmarks/diagnostics/plan_call.py`, docs/performance.md). Without it everything works
as before, through `mx.compile`.

It is built once, by `scripts/setup.sh` (`python -m longctx.native build`), against the installed
MLX and the `nanobind` whose ABI MLX's Python module was built with (nanobind's internals must
match for mx.array to pass between the two modules), into `_build/` beside this file, under a name
that carries MLX's version, the Python ABI and the source's hash: a build for another MLX or
source is never loaded. Nothing is built at run time.
"""

from __future__ import annotations

import hashlib
import importlib.util
import os
import platform
import shlex
import subprocess
import sys
import sysconfig
from pathlib import Path

from longctx import config

HERE = Path(__file__).resolve().parent
SOURCE = HERE / "replay.cpp"
BUILD = HERE / "_build"
# MLX 0.32's Python module is built with nanobind 3 (internals v22, backend ABI 1): the version
# installed for the build must share them (`build` checks it against MLX's binary)
NANOBIND = "nanobind>=3,<4"

_MODULE: list = []  # [module or None] once looked up


def _key() -> str:
    import mlx.core as mx

    h = hashlib.sha256(SOURCE.read_bytes())
    h.update(f"{mx.__version__} {sys.implementation.cache_tag} {platform.machine()}".encode())
    return h.hexdigest()[:16]


def _path() -> Path:
    return BUILD / f"_replay_{_key()}{sysconfig.get_config_var('EXT_SUFFIX')}"


def load():
    """The built module, or None (not built for this MLX and source, or it does not work)."""
    if _MODULE:
        return _MODULE[0]
    mod = None
    try:
        path = _path()
        if path.exists():
            spec = importlib.util.spec_from_file_location("_replay", path)
            mod = importlib.util.module_from_spec(spec)
            spec.loader.exec_module(mod)
            mod = mod if _works(mod) else None
    except (ImportError, OSError):
        mod = None
    _MODULE.append(mod)
    return mod


def _works(mod) -> bool:
    """Whether mx.array passes into the module (nanobind's internals shared with MLX's) and a
    replay computes what the graph does."""
    import mlx.core as mx

    try:
        a, b = mx.array([1.0, 2.0]), mx.array([3.0, 4.0])
        t = mod.Tape([a, b], [a * b + 1], [0, 1])
        return t.replay([b, b])[0].tolist() == [10.0, 17.0]
    except (TypeError, ValueError, RuntimeError):
        return False


def Tape(inputs, outputs, varying=None):  # noqa: N802 - the class's constructor
    """A `_replay.Tape` over `inputs` -> `outputs` (lists of mx.array), replayed with new arrays
    at the positions `varying` (default: all); needs `load()`."""
    inputs = list(inputs)
    return load().Tape(inputs, list(outputs),
                       list(range(len(inputs))) if varying is None else list(varying))


def command(out: Path) -> list[str]:
    """The compiler call that builds the module into `out` ($CXX, default c++; $CXXFLAGS added)."""
    import mlx.core as mx
    import nanobind

    mlx_dir = Path(mx.__file__).resolve().parent
    nb = Path(nanobind.__file__).resolve().parent
    cxx = os.environ.get("CXX", "c++")
    # (nanobind's own CMake builds its library with -fno-strict-aliasing: Python's type punning)
    cmd = [*shlex.split(cxx), "-O2", "-std=c++20", "-shared", "-fPIC", "-fvisibility=hidden",
           "-fno-strict-aliasing", "-DNDEBUG", f"-I{sysconfig.get_paths()['include']}",
           f"-I{nb / 'include'}", f"-I{nb / 'ext' / 'robin_map' / 'include'}",
           f"-I{mlx_dir / 'include'}",
           str(SOURCE), str(nb / "src" / "nb_combined.cpp"),
           f"-L{mlx_dir / 'lib'}", "-lmlx", f"-Wl,-rpath,{mlx_dir / 'lib'}", "-o", str(out)]
    # MLX builds its module in nanobind's domain "mlx", and under Python's limited API where its
    # module is an abi3 one: nanobind's internals key carries both, and must match MLX's
    cmd[1:1] = ["-DNB_DOMAIN=mlx"]
    if ".abi3." in Path(mx.__file__).name:
        cmd[1:1] = ["-DPy_LIMITED_API=0x030C0000"]
    if sysconfig.get_config_var("Py_GIL_DISABLED"):  # a free-threaded Python: nanobind's "_ft"
        cmd[1:1] = ["-DNB_FREE_THREADED"]
    if sys.platform == "darwin":
        cmd[1:1] = ["-undefined", "dynamic_lookup"]
    return cmd + shlex.split(os.environ.get("CXXFLAGS", ""))


def build() -> Path:
    """Build the module for the installed MLX (a C++20 compiler, Python's headers and nanobind
    are needed); returns its path. Raises RuntimeError with the compiler's message."""
    out = _path()
    BUILD.mkdir(exist_ok=True)
    tmp = out.with_name(out.name + f".{os.getpid()}.tmp")
    try:
        done = subprocess.run(command(tmp), capture_output=True, text=True)
    except OSError as err:
        raise RuntimeError(f"no C++ compiler ({err})") from err
    if done.returncode != 0:
        raise RuntimeError("the native helper did not compile:\n" + done.stderr[-4000:])
    os.replace(tmp, out)
    for old in BUILD.glob("_replay_*"):
        if old != out:
            old.unlink(missing_ok=True)
    _MODULE.clear()
    if load() is None:
        out.unlink(missing_ok=True)
        _MODULE.clear()
        raise RuntimeError(f"built {out.name}, but mx.array does not pass into it (nanobind's "
                           f"ABI differs from MLX's: install {NANOBIND!r}); removed")
    return out


class Replayed:
    """A function of arrays returning a tuple of arrays (typically `mx.compile`d), called through
    a `Tape` of its graph where the helper is built and `LONGCTX_NATIVE` is on: the first call at
    a first argument's shape and dtype runs `fn` and captures its (unevaluated) graph, later ones
    replay it (a compiled call's fused kernels are nodes like any other). Arguments whose shapes
    or dtypes differ from the captured ones are captured again. `fn` must compute its outputs
    from its arguments without evaluating them or writing into its arguments (a write would be
    captured as done); a capture whose outputs were evaluated is not kept."""

    def __init__(self, fn):
        self.fn = fn
        self.tapes: dict = {}

    def __call__(self, *args):
        if not config.get("native") or load() is None:
            return self.fn(*args)
        a0 = args[0]
        tape = self.tapes.get((a0.shape, a0.dtype))
        if tape is not None:
            try:
                return tuple(tape.replay(list(args)))
            except ValueError:  # another argument's shape or dtype: capture again
                pass
        out = self.fn(*args)
        tape = Tape(args, out)
        if len(self.tapes) > 64:
            self.tapes.clear()
        if tape.frozen_outputs:
            self.tapes.pop((a0.shape, a0.dtype), None)
        else:
            self.tapes[(a0.shape, a0.dtype)] = tape
        return out


def window_write(buf_k, buf_v, k, v, lo: int):
    """`buf[:, :, lo:hi] = x` for both window buffers (in place: the objects take the new arrays)
    and the windows `buf[:, :, :hi]`, hi = lo + k.shape[2], in one native call; None where the
    helper is not built or `LONGCTX_NATIVE` is off (the caller indexes in Python)."""
    mod = load()
    if mod is None or not config.get("native"):
        return None
    return tuple(mod.window_write(buf_k, buf_v, k, v, lo))
