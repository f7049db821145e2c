"""deploy/Dockerfile builds what the package needs (no docker here: it is read, not run).

Each stage's instructions are parsed as docker reads them (continuation lines joined,
comments dropped); the build stage must copy in every file pyproject.toml names for the
build (the readme, the license files, the package, the data files' sources) and build a
wheel; the image must install that wheel (not the source tree), run as a user other than
root, expose the port it serves on and check /healthz on it, and start `runloop-proxy serve`.
"""

from __future__ import annotations

import glob
import json
import re
import tomllib
from pathlib import Path, PurePosixPath

import pytest

ROOT = Path(__file__).resolve().parent.parent
DOCKERFILE = ROOT / "deploy" / "Dockerfile"


def instructions(text: str) -> list[list[tuple[str, str]]]:
    """The Dockerfile's stages, each a list of (INSTRUCTION, arguments)."""
    joined = re.sub(r"\\\n", " ", "\n".join(
        line for line in text.split("\n") if not line.lstrip().startswith("#")))
    stages: list[list[tuple[str, str]]] = []
    for line in joined.split("\n"):
        if not line.strip():
            continue
        word, _, rest = line.strip().partition(" ")
        word = word.upper()
        if word == "FROM":
            stages.append([])
        assert stages, f"an instruction before FROM: {line!r}"
        stages[-1].append((word, " ".join(rest.split())))
    return stages


def copied(stage: list[tuple[str, str]]) -> dict[str, str]:
    """What a stage's COPY instructions take from the build context, and where each lands
    relative to the work directory: source -> its path there."""
    out = {}
    for word, args in stage:
        if word != "COPY" or args.startswith("--from"):
            continue
        *sources, dest = args.split()
        into = dest.endswith("/") or len(sources) > 1  # a directory: each keeps its name
        for src in sources:
            src = src.rstrip("/")
            landing = PurePosixPath(dest.removeprefix("./")) / PurePosixPath(src).name \
                if into else PurePosixPath(dest.removeprefix("./"))
            out[src] = str(landing)
    return out


def in_build_context(stage: list[tuple[str, str]], path: str) -> bool:
    """Whether ``path`` (relative to the repository) is in the stage's work tree at the same
    relative place: copied itself, or inside a directory copied, so that it lands where
    pyproject.toml names it."""
    return any((path == src or path.startswith(src + "/")) and landing == src
               for src, landing in copied(stage).items())


def build_inputs() -> list[str]:
    """Every file the wheel's build reads, by pyproject.toml."""
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())
    files = ["pyproject.toml", project["project"]["readme"], *project["project"]["license-files"],
             "runloop_proxy/__init__.py"]
    data = project["tool"]["setuptools"].get("data-files", {})
    for patterns in data.values():
        for pattern in patterns:
            matches = glob.glob(pattern, root_dir=ROOT)
            assert matches, f"pyproject's data-files pattern {pattern} matches nothing"
            files += matches
    return files


STAGES = instructions(DOCKERFILE.read_text())


def test_instructions_join_continuations_and_split_stages() -> None:
    """Bug class: an instruction read wrong, so a check passes on what docker never sees.
    Planted: continuation lines left unjoined (the RUN's second half a bogus instruction),
    comments kept (a commented-out COPY counted as copied)."""
    text = ("FROM a AS b\n# COPY secret ./\nRUN x \\\n    && y\nFROM c\nCOPY --from=b /d /e\n"
            "COPY f g/ ./\n")
    assert instructions(text) == [[("FROM", "a AS b"), ("RUN", "x && y")],
                                  [("FROM", "c"), ("COPY", "--from=b /d /e"),
                                   ("COPY", "f g/ ./")]]
    assert copied(instructions(text)[1]) == {"f": "f", "g": "g"}


@pytest.mark.parametrize(("copy", "path", "expected"), [
    ("COPY pyproject.toml README.md LICENSE ./", "LICENSE", True),
    ("COPY pyproject.toml README.md ./", "LICENSE", False),
    ("COPY runloop_proxy ./runloop_proxy", "runloop_proxy/samples/support_agent.jsonl", True),
    ("COPY runloop_proxy ./pkg", "runloop_proxy/cli.py", False),
    ("COPY deploy/prometheus ./deploy/prometheus", "deploy/prometheus/alerts.yml", True),
    ("COPY deploy/prometheus ./", "deploy/prometheus/alerts.yml", False),
])
def test_in_build_context_follows_where_a_copy_puts_it(copy: str, path: str,
                                                       expected: bool) -> None:
    """Planted: any copied source counted whatever its destination (rows 4 and 6 pass)."""
    assert in_build_context(instructions(f"FROM x\n{copy}\n")[0], path) is expected


def test_the_build_stage_has_every_file_the_build_reads_and_builds_a_wheel() -> None:
    """Planted: the LICENSE left out of the COPY (setuptools refuses a license-files
    pattern that matches nothing: the image's build broke so), the dashboard's directory
    left out (a data file)."""
    build = STAGES[0]
    missing = [f for f in build_inputs() if not in_build_context(build, f)]
    assert not missing, f"the build stage does not copy in {missing}"
    runs = [args for word, args in build if word == "RUN"]
    assert any("-m build" in r and "--wheel" in r for r in runs), runs


def test_the_image_installs_the_wheel_and_serves_as_a_user_with_a_healthcheck() -> None:
    """Planted: `pip install .` of a copied source tree in the last stage, USER root, the
    healthcheck on another port than the one exposed."""
    final = STAGES[-1]
    words = [w for w, _ in final]
    assert words.count("FROM") == 1 and final[0][1].startswith("python:3.1")
    runs = " ".join(args for word, args in final if word == "RUN")
    assert re.search(r"pip install [^&]*\.whl", runs), runs
    assert not copied(final), "the image copies sources from the context: install the wheel"
    assert any(w == "COPY" and a.startswith("--from=build") for w, a in final)
    users = [args for word, args in final if word == "USER"]
    assert users and users[-1] not in ("root", "0")
    env = " ".join(args for word, args in final if word == "ENV")
    port = re.search(r"RUNLOOP_PORT=(\d+)", env)
    assert port, env
    assert ("EXPOSE", port[1]) in final
    health = next(args for word, args in final if word == "HEALTHCHECK")
    assert f"127.0.0.1:{port[1]}/healthz" in health
    host = re.search(r"RUNLOOP_HOST=(\S+)", env)
    assert host and host[1] == "0.0.0.0"  # reachable from outside the container
    cmd = next(args for word, args in final if word == "CMD")
    assert json.loads(cmd) == ["runloop-proxy", "serve"]


def test_every_file_the_dockerfile_copies_exists() -> None:
    for stage in STAGES:
        for src in copied(stage):
            assert (ROOT / src).exists(), f"COPY {src}: not in the repository"
