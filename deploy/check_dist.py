"""Check what `python -m build` made, as a package index would read it, before it ships.

    python -m build --outdir dist . && python deploy/check_dist.py dist

One wheel and one sdist of the same version; the wheel holds the package data the proxy
reads at run time (the price table, the sample session `demo` and `replay --sample` use) and
the dashboard and alert rules under share/runloop-proxy/; its metadata has what an index
shows (a readme as markdown, a license expression and file, classifiers, the Python it needs;
project URLs only where the project has them: a link a user cannot follow is worse than none,
so any given must be https). Exits 1 naming each problem.
"""

from __future__ import annotations

import email.parser
import sys
import tarfile
import zipfile
from pathlib import Path

WHEEL_FILES = ("runloop_proxy/prices.toml", "runloop_proxy/samples/support_agent.jsonl",
               "runloop_proxy/py.typed", "runloop_proxy/cli.py")
WHEEL_DATA = ("share/runloop-proxy/grafana/runloop-proxy.json",
              "share/runloop-proxy/prometheus/alerts.yml",
              "share/runloop-proxy/prometheus/prometheus.yml")
SDIST_FILES = ("LICENSE", "README.md", "pyproject.toml", "runloop_proxy/prices.toml",
               "runloop_proxy/samples/support_agent.jsonl",
               "deploy/grafana/dashboards/runloop-proxy.json", "deploy/prometheus/alerts.yml")


def check_metadata(text: str) -> list[str]:
    meta = email.parser.Parser().parsestr(text)
    problems = []
    for field in ("Name", "Version", "Summary", "License-Expression", "Requires-Python",
                  "Description-Content-Type"):
        if not meta.get(field):
            problems.append(f"metadata: no {field}")
    if meta.get("Description-Content-Type", "") != "text/markdown":
        problems.append("metadata: the readme is not declared as markdown")
    if len(meta.get_payload() or "") < 1000:
        problems.append("metadata: no readme as the long description")
    for url in meta.get_all("Project-URL") or []:
        label, _, address = url.partition(",")
        if not address.strip().startswith("https://"):
            problems.append(f"metadata: Project-URL {label.strip()} is not an https address")
    classifiers = meta.get_all("Classifier") or []
    running = f"Programming Language :: Python :: {sys.version_info[0]}.{sys.version_info[1]}"
    if running not in classifiers:  # the Python this was built and checked with
        problems.append(f"metadata: no classifier {running!r}")
    if any(c.startswith("License ::") for c in classifiers):
        problems.append("metadata: a License classifier beside License-Expression (PEP 639)")
    if "LICENSE" not in (meta.get_all("License-File") or []):
        problems.append("metadata: no License-File")
    return problems


def check(dist: Path) -> list[str]:
    wheels = sorted(dist.glob("*.whl"))
    sdists = sorted(dist.glob("*.tar.gz"))
    if len(wheels) != 1 or len(sdists) != 1:
        return [f"{dist}: expected one wheel and one sdist, found {len(wheels)} and "
                f"{len(sdists)}"]
    problems = []
    with zipfile.ZipFile(wheels[0]) as whl:
        names = set(whl.namelist())
        info = next(n for n in names if n.endswith(".dist-info/METADATA"))
        stem = info.split("/")[0].removesuffix(".dist-info")
        problems += [f"wheel: no {f}" for f in WHEEL_FILES if f not in names]
        problems += [f"wheel: no {f}" for f in WHEEL_DATA
                     if f"{stem}.data/data/{f}" not in names]
        problems += check_metadata(whl.read(info).decode())
        version = stem.split("-", 1)[1]
    with tarfile.open(sdists[0]) as sdist:
        top = sdists[0].name.removesuffix(".tar.gz")
        members = set(sdist.getnames())
        problems += [f"sdist: no {f}" for f in SDIST_FILES if f"{top}/{f}" not in members]
    if not top.endswith(f"-{version}"):
        problems.append(f"the sdist ({top}) and the wheel ({version}) differ in version")
    return problems


def main(argv: list[str]) -> int:
    if len(argv) != 1:
        print(__doc__, file=sys.stderr)
        return 2
    problems = check(Path(argv[0]))
    for p in problems:
        print(p, file=sys.stderr)
    if not problems:
        print(f"{argv[0]}: the wheel and the sdist hold what they must")
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
