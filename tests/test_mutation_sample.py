"""bench/mutation_sample.py's scratch copy: the project's coverage config with what the tool
needs added once."""

from __future__ import annotations

import importlib.util
import shutil
import sys
import tomllib
from pathlib import Path

BENCH = Path(__file__).resolve().parent.parent / "bench" / "mutation_sample.py"


def test_the_scratch_copy_measures_subprocesses_with_a_config_that_parses() -> None:
    """The copy's pyproject gets ``patch`` and ``parallel`` under ``[tool.coverage.run]`` only
    where the project's lacks them. Found: the project's config came to set ``patch`` itself,
    the copy wrote a second one, the TOML no longer parsed, and every test file mapped to no
    test — every mutant "uncovered", the score 0 (a run of seed 3907's survivors).

    Bug class: a tool that edits a config by text. Planted: the keys added unconditionally
    (the tool as it was); the project's own ``patch`` list replaced by the tool's (its
    ``_exit`` lost)."""
    spec = importlib.util.spec_from_file_location("mutation_sample", BENCH)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules["mutation_sample"] = module
    try:
        spec.loader.exec_module(module)
        scratch = module.Scratch()
    finally:
        sys.modules.pop("mutation_sample", None)
    try:
        run = tomllib.loads((scratch.repo / "pyproject.toml").read_text())["tool"][
            "coverage"]["run"]
        assert run["concurrency"] == ["thread"] and run["parallel"] is True
        own = tomllib.loads((BENCH.parent.parent / "pyproject.toml").read_text())["tool"][
            "coverage"]["run"].get("patch", [])
        assert "subprocess" in run["patch"] and set(own) <= set(run["patch"])
    finally:
        shutil.rmtree(scratch.dir)
