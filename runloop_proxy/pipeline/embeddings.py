"""Text to vectors for long-term memory: the embedded static model, in this process.

The default needs no network and no download: ``wordllama`` ships its 256-dimension token
embeddings (l2_supercat) and its tokenizer inside its wheel, and a text's vector is the mean of
its tokens' rows — no torch, no GPU. It is loaded once, on first use, in a worker thread (16 MB
of weights), and every call runs in a worker thread too: nothing here touches the event loop.
"""

from __future__ import annotations

import threading
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol

from ..errors import EmbeddingError

if TYPE_CHECKING:  # numpy is imported where it is used: a proxy without memory never loads it
    import numpy as np
    import numpy.typing as npt

    Vectors = npt.NDArray[np.float32]
EMBEDDED = "wordllama-l2_supercat-256"  # the model's name, as its vectors are kept under
EMBEDDED_DIM = 256
_WEIGHTS, _TOKENIZER = "l2_supercat_256.safetensors", "l2_supercat_tokenizer_config.json"


class Embedder(Protocol):
    name: str
    dim: int

    def embed(self, texts: list[str]) -> Vectors:
        """Unit vectors, a row per text (blocking: call it in a worker thread)."""


class StaticEmbedder:
    """wordllama's static embeddings, from the files its wheel carries."""

    name = EMBEDDED
    dim = EMBEDDED_DIM

    def __init__(self) -> None:
        self._model: Any = None
        self._lock = threading.Lock()

    def _loaded(self) -> Any:
        with self._lock:
            if self._model is None:
                try:
                    self._model = _load_shipped()
                except Exception as exc:  # noqa: BLE001 - whatever loading raises
                    raise EmbeddingError(f"the embedded model did not load: "
                                         f"{type(exc).__name__}: {exc}") from exc
            return self._model

    def embed(self, texts: list[str]) -> Vectors:
        import numpy as np

        if not texts:
            return np.zeros((0, self.dim), np.float32)
        model = self._loaded()
        try:
            out = np.asarray(model.embed(texts, norm=False), np.float32)
        except Exception as exc:  # noqa: BLE001 - the model's own failure, as ours
            raise EmbeddingError(f"the embedded model failed: {type(exc).__name__}: "
                                 f"{exc}") from exc
        return unit(out)


def _load_shipped() -> Any:
    """The model from the files inside the installed package, by path: wordllama's own
    loader (0.4.0.post1) looks for its tokenizer under a folder name its wheel does not use,
    then falls back to a download, so it is not asked."""
    import wordllama
    from safetensors import safe_open
    from tokenizers import Tokenizer
    from wordllama.inference import WordLlamaInference

    root = Path(wordllama.__file__).parent
    with safe_open(str(root / "weights" / _WEIGHTS), framework="np", device="cpu") as f:
        table = f.get_tensor("embedding.weight")
    tokenizer = Tokenizer.from_file(str(root / "tokenizers" / _TOKENIZER))
    return WordLlamaInference(table, tokenizer)


def unit(rows: Vectors) -> Vectors:
    """Rows scaled to length 1 (a row of zeros — a text of no known token — stays zero)."""
    import numpy as np

    norms = np.linalg.norm(rows, axis=1, keepdims=True)
    out: Vectors = np.divide(rows, norms, out=np.zeros_like(rows), where=norms > 0)
    return out


KEY_BYTES = 16  # of a segment's key, in front of its vector in a block


def block(keys: list[str], rows: Vectors) -> bytes:
    """Segments' keys and vectors as one stored value: each key (``KEY_BYTES`` of ASCII)
    followed by its row, float32 little-endian (1 KB for 256 dimensions). A search reads a
    session's few blocks, not a value per segment (10,000 fields cost 130 ms to read)."""
    import numpy as np

    out = np.zeros(len(keys), _entry(rows.shape[1]))
    out["key"] = [k.encode()[:KEY_BYTES] for k in keys]
    out["vector"] = rows
    return out.tobytes()


def unblocked(data: bytes, dim: int) -> tuple[Any, Vectors]:
    """A block read back, without a copy: its keys (bytes) and its rows. A block of another
    model's size reads as empty."""
    import numpy as np

    entry = _entry(dim)
    if len(data) % entry.itemsize:
        return np.zeros(0, f"S{KEY_BYTES}"), np.zeros((0, dim), np.float32)
    got = np.frombuffer(data, entry)
    rows: Vectors = got["vector"]
    return got["key"], rows


def _entry(dim: int) -> Any:
    import numpy as np

    return np.dtype([("key", f"S{KEY_BYTES}"), ("vector", "<f4", (dim,))])
