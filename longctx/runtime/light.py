"""Loading a model for `ask` without transformers: the start-up path of a question.

`import mlx_lm` runs mlx-lm's package `__init__`, which imports its converter and tokenizer
utilities and through them transformers: about 2.5 s of a 4 s `longctx ask` on the development
machine, and building the transformers tokenizer costs another 0.5 s. Answering from a cache needs
neither: the model class (`mlx_lm.models.<type>`), the weights, and a tokenizer that encodes the
question and decodes the answer, which the `tokenizers` library does from `tokenizer.json` alone.

- `defer_mlx_lm_init()` registers the `mlx_lm` package without running its `__init__` (the
  submodules import as usual); the first access to a name the `__init__` defines runs it then.
  Only the CLI's process entry calls it (`longctx.cli.main`), before anything imports mlx-lm.
- `load_model(path)` builds the mlx-lm model from `config.json` and `*.safetensors` the way
  mlx-lm does, for plain configs (no custom model file; mlx-lm's own `quantization` block with
  optional per-layer settings); None otherwise, and the caller takes mlx-lm's loader.
- `TextTokenizer` encodes and decodes with `tokenizers`. Its encodings are checked against the
  transformers tokenizer at ingest (`matches`); a cache whose check failed, or that predates it,
  is answered through transformers as before.
"""

from __future__ import annotations

import importlib
import importlib.util
import json
import sys
from pathlib import Path
from longctx.runtime import distributed

# Model types mlx-lm maps to another module (mlx_lm.utils.MODEL_REMAPPING, the common ones);
# an unknown type that has no module of its own falls back to mlx-lm's loader.
_REMAP = {"mistral": "llama", "iquestcoder": "llama", "xverse": "llama", "falcon_mamba": "mamba"}

# Strings whose encodings must agree between `tokenizers` and transformers for a cache's
# questions to be encoded without transformers (numbers, accents, CJK, whitespace runs, markup).
PROBES = (
    " What does the document say about the chief engineer?",
    " Who signed it, and on which date (e.g. 12 March 2024)?  List 3 numbers: 1,234.5; 0.07; -42%.",
    " Ça coûte 12 €? naïve café – “quoted” ‘text’ … 日本語のテキスト 😀\n\tTabs\n\n",
    " <b>markup</b> & code: `x = f(y)[0]` // C:\\path\\file.txt",
)


def defer_mlx_lm_init() -> bool:
    """Register `mlx_lm` without running its `__init__` (which imports transformers).

    Returns:
        False if mlx-lm was already imported or is not installed (nothing changed).
    """
    if "mlx_lm" in sys.modules:
        return False
    spec = importlib.util.find_spec("mlx_lm")
    if spec is None or spec.loader is None or not spec.submodule_search_locations:
        return False
    module = importlib.util.module_from_spec(spec)
    state = {"done": False}

    def __getattr__(name: str):
        if name.startswith("__") or state["done"]:
            raise AttributeError(name)
        state["done"] = True
        del module.__dict__["__getattr__"]
        spec.loader.exec_module(module)  # the real __init__, into the same module object
        return getattr(module, name)

    module.__getattr__ = __getattr__
    sys.modules["mlx_lm"] = module
    return True


def load_model(path: Path) -> tuple[object, dict] | None:
    """The mlx-lm model in `path` with its weights evaluated, or None for configs this loader
    leaves to mlx-lm (custom model files, quantization beyond {group_size, bits})."""
    import mlx.core as mx
    import mlx.nn as nn

    config = json.loads((path / "config.json").read_text())
    quant = config.get("quantization")
    per_layer = {k: v for k, v in (quant or {}).items() if k not in ("group_size", "bits", "mode")}
    if (
        config.get("model_file")
        or config.get("quantization_config")
        or (quant is not None and not all(isinstance(v, (dict, bool)) for v in per_layer.values()))
    ):
        return None
    model_type = config.get("model_type", "")
    try:
        arch = importlib.import_module(f"mlx_lm.models.{_REMAP.get(model_type, model_type)}")
    except ImportError:
        return None
    weights = {}
    for f in sorted(path.glob("model*.safetensors")):
        weights.update(mx.load(str(f)))
    if not weights:
        return None
    model = arch.Model(arch.ModelArgs.from_dict(config))
    if hasattr(model, "sanitize"):
        weights = model.sanitize(weights)
    if quant is not None:

        def predicate(p, m):  # as mlx-lm: per-layer settings first, then layers with scales
            if p in per_layer:
                return per_layer[p]
            return hasattr(m, "to_quantized") and f"{p}.scales" in weights

        nn.quantize(
            model, group_size=quant["group_size"], bits=quant["bits"], mode=quant.get("mode", "affine"), class_predicate=predicate
        )
    model.load_weights(list(weights.items()), strict=True)
    model.eval()

    if not distributed.launched():  # a rank reads only its share, once split (`distributed.split`)
        mx.eval(model.parameters())
    return model, config


def _token_content(value) -> str | None:
    if isinstance(value, dict):
        return value.get("content")
    return value if isinstance(value, str) else None


class TextTokenizer:
    """Encode and decode with the `tokenizers` library from a model directory's tokenizer.json.

    Offers what answering needs: `encode`, `decode`, `eos_token_ids`, `bos_token`.
    """

    def __init__(self, path: Path):
        from tokenizers import Tokenizer

        self.path = path
        self._tok = Tokenizer.from_file(str(path / "tokenizer.json"))
        cfg = _read_json(path / "tokenizer_config.json")
        self.bos_token = _token_content(cfg.get("bos_token"))
        # As mlx-lm: generation_config.json's eos_token_id, else config.json's, plus the tokenizer's.
        ids = _read_json(path / "generation_config.json").get("eos_token_id") or _read_json(path / "config.json").get(
            "eos_token_id"
        )
        eos = set(ids if isinstance(ids, list) else [ids] if isinstance(ids, int) else [])
        name = _token_content(cfg.get("eos_token"))
        if name is not None and self._tok.token_to_id(name) is not None:
            eos.add(self._tok.token_to_id(name))
        self.eos_token_ids = eos

    @classmethod
    def load(cls, path: Path) -> "TextTokenizer | None":
        if not (path / "tokenizer.json").is_file():
            return None
        try:
            return cls(path)
        except Exception:  # an unreadable tokenizer.json: the caller uses transformers
            return None

    def encode(self, text: str, add_special_tokens: bool = False) -> list[int]:
        return self._tok.encode(text, add_special_tokens=add_special_tokens).ids

    def decode(self, ids: list[int]) -> str:
        return self._tok.decode(ids, skip_special_tokens=False)

    def matches(self, reference, texts: tuple[str, ...] = PROBES) -> bool:
        """Whether this tokenizer encodes `texts` (without special tokens) and decodes them back
        exactly as `reference` (the transformers/mlx-lm tokenizer) does, and has its EOS ids."""
        for text in texts:
            ids = list(reference.encode(text, add_special_tokens=False))
            if self.encode(text) != ids or self.decode(ids) != reference.decode(ids):
                return False
        ref_eos = set(getattr(reference, "eos_token_ids", None) or [])
        return not ref_eos or ref_eos == self.eos_token_ids


def _read_json(path: Path) -> dict:
    try:
        value = json.loads(path.read_text())
    except (OSError, ValueError):
        return {}
    return value if isinstance(value, dict) else {}
