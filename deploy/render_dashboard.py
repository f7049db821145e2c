"""Render the dashboard's panels from a Prometheus to one PNG (for the README and reviews).

    python deploy/render_dashboard.py --prometheus http://127.0.0.1:9090 --minutes 10 \
        --out docs/dashboard.png

Needs matplotlib (pip install matplotlib). Grafana draws the real thing; this is a faithful
sketch of the same queries over the same time range.
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path
from typing import Any

import httpx

HERE = Path(__file__).parent


def query_range(prom: str, expr: str, start: float, end: float, step: float) -> list[Any]:
    expr = expr.replace("$__rate_interval", "1m").replace('"$tenant"', '".*"')
    r = httpx.get(f"{prom}/api/v1/query_range", params={
        "query": expr, "start": start, "end": end, "step": step}, timeout=30)
    r.raise_for_status()
    return list(r.json()["data"]["result"])


def legend(fmt: str, metric: dict[str, str]) -> str:
    out = fmt
    for k, v in metric.items():
        out = out.replace("{{" + k + "}}", v)
    return out


def main() -> int:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--prometheus", default="http://127.0.0.1:9090")
    parser.add_argument("--minutes", type=float, default=10)
    parser.add_argument("--out", default="docs/dashboard.png")
    args = parser.parse_args()
    board = json.loads((HERE / "grafana/dashboards/runloop-proxy.json").read_text())
    panels = [p for p in board["panels"] if p["type"] != "row"]
    end = time.time()
    start = end - args.minutes * 60
    step = max(5.0, (end - start) / 120)
    cols = 4
    rows = (len(panels) + cols - 1) // cols
    fig, axes = plt.subplots(rows, cols, figsize=(cols * 4.6, rows * 2.6))
    for ax, panel in zip(axes.flat, panels, strict=False):
        for target in panel["targets"]:
            for series in query_range(args.prometheus, target["expr"], start, end, step):
                xs = [(float(t) - end) / 60 for t, _ in series["values"]]
                ys = [float(v) for _, v in series["values"]]
                ax.plot(xs, ys, linewidth=1.2,
                        label=legend(target.get("legendFormat", ""), series["metric"])[:28])
        ax.set_title(panel["title"], fontsize=9)
        ax.tick_params(labelsize=7)
        ax.set_xlabel("minutes", fontsize=7)
        if ax.get_legend_handles_labels()[0]:
            ax.legend(fontsize=6, loc="upper left")
    for ax in list(axes.flat)[len(panels):]:
        ax.axis("off")
    fig.suptitle("runloop-proxy", fontsize=12)
    fig.tight_layout()
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(args.out, dpi=90)
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
