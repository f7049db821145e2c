"""The embedded model of long-term memory (pipeline/embeddings.py): loaded from its wheel with
no network and no download, and vectors stored as the search reads them."""

from __future__ import annotations

import json
import os
import struct
import subprocess
import sys
from pathlib import Path

import numpy as np

from runloop_proxy.pipeline.embeddings import EMBEDDED_DIM, KEY_BYTES, block, unblocked, unit

_OFFLINE = r"""
import json, socket, sys
def refuse(*args, **kwargs):
    raise OSError("no network in this test")
socket.socket.connect = refuse
socket.create_connection = refuse
from runloop_proxy.pipeline.embeddings import StaticEmbedder
e = StaticEmbedder()
rows = e.embed(["a reimbursement of order #W5102934", "the refund we discussed",
                "the weather in Lisbon tomorrow", ""])
print(json.dumps({"shape": list(rows.shape), "norms": [float(n) for n in (rows ** 2).sum(1)],
                  "near": float(rows[0] @ rows[1]), "far": float(rows[0] @ rows[2])}))
"""


def test_the_embedded_model_loads_with_no_network_and_writes_no_cache(tmp_path: Path) -> None:
    """A fresh process with every connection refused and an empty home: the model loads from
    the wheel's files and tells a refund from the weather. Catches: loading through
    wordllama's own loader (planted: ``WordLlama.load(disable_download=True)``, red: its
    tokenizer is looked for under a folder the wheel lacks) and a download fallback (planted:
    ``disable_download=False``, red: the refused connection)."""
    home = tmp_path / "home"
    home.mkdir()
    env = {**os.environ, "HOME": str(home), "HF_HUB_OFFLINE": "1",
           "XDG_CACHE_HOME": str(home / ".cache")}
    out = subprocess.run([sys.executable, "-c", _OFFLINE], env=env, capture_output=True,
                         text=True, timeout=120, check=True)
    got = json.loads(out.stdout.strip().splitlines()[-1])
    assert got["shape"] == [4, EMBEDDED_DIM]
    assert [round(n, 3) for n in got["norms"]] == [1.0, 1.0, 1.0, 0.0]  # no token: zero
    assert got["near"] > got["far"] + 0.15
    assert list(home.rglob("*")) == []


def test_a_block_of_vectors_reads_back_as_it_was_kept() -> None:
    """Keys and rows in one value, read back without a copy; a block of another model's
    size reads as empty. Catches: a key cut to fewer bytes than the field (planted:
    ``KEY_BYTES = 8`` in ``block`` alone, red), big-endian rows (planted ``>f4``, red), a
    wrong-sized block read (planted: the size check gone, red: numpy raises)."""
    rng = np.random.default_rng(7)
    rows = unit(rng.standard_normal((3, EMBEDDED_DIM)).astype(np.float32))
    keys = ["0f3a9c2e71b4d865", "9b1e07c4aa25f310", "5d6e2f0a8c1b4937"]
    data = block(keys, rows)
    assert len(data) == 3 * (KEY_BYTES + EMBEDDED_DIM * 4)
    # the layout other replicas (and versions) read: the key, then float32 little-endian
    assert data[:KEY_BYTES] == keys[0].encode()
    assert data[KEY_BYTES:KEY_BYTES + 4] == struct.pack("<f", float(rows[0, 0]))
    got_keys, got_rows = unblocked(data, EMBEDDED_DIM)
    assert [k.decode() for k in got_keys] == keys
    assert np.array_equal(got_rows, rows)
    empty_keys, empty_rows = unblocked(data[:-1], EMBEDDED_DIM)
    assert len(empty_keys) == 0 and empty_rows.shape == (0, EMBEDDED_DIM)
