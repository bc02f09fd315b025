"""Write an mlx-lm model directory atomically: build it in a temp directory, then rename it."""

from __future__ import annotations

import json
import os
import shutil
import tempfile
from pathlib import Path


def write_model_dir(out_dir: Path, weights: dict, json_files: dict[str, dict], copy_files: tuple[Path, ...] = ()) -> Path:
    """Create `out_dir` with `model.safetensors`, the JSON files and copies of `copy_files`.

    Concurrent writers are fine: if another process renamed its finished copy into place first,
    that copy is kept and this one discarded.
    """
    import mlx.core as mx

    out_dir.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=".build-", dir=out_dir.parent))
    try:
        mx.save_safetensors(str(tmp / "model.safetensors"), weights, {"format": "mlx"})
        for name, obj in json_files.items():
            (tmp / name).write_text(json.dumps(obj, indent=1, ensure_ascii=False))
        for f in copy_files:
            shutil.copy2(f, tmp / f.name)
        try:
            os.replace(tmp, out_dir)
        except OSError:
            if not (out_dir / "model.safetensors").exists():
                raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return out_dir
