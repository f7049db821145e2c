"""Prompt tokens per request as an inline SVG chart (pure: points in, markup out).

Two lines — what the client sent, what went upstream — over the session's requests, with a
legend, a token axis and a request axis. Only the lines' ``points`` depend on the counts:
tick marks sit at fixed fractions of the plot and carry the values as text, so no other
attribute is ever made from data.
"""

from __future__ import annotations

import math

from .views import saving, tokens

WIDTH, HEIGHT = 760, 250  # the whole chart
LEFT, RIGHT, TOP, BOTTOM = 70, 20, 34, 46  # room for the axes' labels and the legend
PLOT_W, PLOT_H = WIDTH - LEFT - RIGHT, HEIGHT - TOP - BOTTOM
Y_TICKS = 4
X_TICKS = 10  # at most
CLIENT, FORWARDED = "#9aa3af", "#2563eb"


def nice_top(value: int) -> int:
    """The smallest round number (1, 2, 2.5 or 5 times a power of ten, times ``Y_TICKS``,
    each tick a whole number) at or above ``value``: the token axis ends there."""
    if value <= 0:
        return Y_TICKS
    raw = value / Y_TICKS
    power = 10 ** max(0, math.floor(math.log10(raw)))
    steps = (1, 2, 2.5, 5, 10) if power >= 10 else (1, 2, 5, 10)  # whole ticks
    return int(next(m * power for m in steps if m * power >= raw) * Y_TICKS)


def request_ticks(n: int) -> list[int]:
    """Which requests (0-based) get a tick: the first, the last, and round steps between."""
    if n <= 1:
        return [0] if n else []
    step = next(s for s in (1, 2, 5, 10, 20, 25, 50, 100, 200, 250, 500)
                if (n - 1) // s + 1 <= X_TICKS)
    ticks = list(range(0, n, step))
    if ticks[-1] != n - 1:
        if n - 1 - ticks[-1] <= step / 2:
            ticks.pop()
        ticks.append(n - 1)
    return ticks


MARK = "#b45309"  # a compaction's mark
MARKS_LISTED = 12


def compactions(points: list[dict[str, int]]) -> list[int]:
    """The requests (indexes) whose forwarded prompt shrank from the one before: where the
    window compacted (the provider's cache still serves what it kept: ``savings``)."""
    return [i for i in range(1, len(points))
            if points[i]["forwarded"] < points[i - 1]["forwarded"]]


def chart(points: list[dict[str, int]]) -> str:
    """The chart, or a line saying there is nothing to chart yet."""
    points = [p for p in points if isinstance(p.get("client"), int)
              and isinstance(p.get("forwarded"), int)]
    if not points:
        return "<p class='muted'>No requests recorded yet.</p>"
    top = nice_top(max(max(p["client"], p["forwarded"]) for p in points))
    n = len(points)

    def x(i: int) -> float:
        return LEFT + (i / (n - 1) * PLOT_W if n > 1 else PLOT_W / 2)

    def line(key: str) -> str:
        ys = [f"{TOP + PLOT_H - p[key] / top * PLOT_H:.1f}" for p in points]
        if n == 1:  # one request: a short level stroke, a line of one point draws nothing
            return f"{x(0) - 12:.1f},{ys[0]} {x(0) + 12:.1f},{ys[0]}"
        return " ".join(f"{x(i):.1f},{y}" for i, y in enumerate(ys))

    out = [f"<svg class='chart' role='img' aria-label='prompt tokens per request: what the "
           f"client sent and what went upstream' width='{WIDTH}' height='{HEIGHT}' "
           f"viewBox='0 0 {WIDTH} {HEIGHT}' xmlns='http://www.w3.org/2000/svg'>"]
    for k in range(Y_TICKS + 1):  # the token axis: grid lines at fixed heights
        y = TOP + PLOT_H - k * PLOT_H // Y_TICKS
        out.append(f"<line x1='{LEFT}' y1='{y}' x2='{LEFT + PLOT_W}' y2='{y}' "
                   f"stroke='{'#9ca3af' if k == 0 else '#e5e7eb'}'/><text x='{LEFT - 8}' "
                   f"y='{y + 4}' text-anchor='end'>{top * k // Y_TICKS:,}</text>")
    out.append(f"<text x='14' y='{TOP + PLOT_H // 2}' text-anchor='middle' "
               f"transform='rotate(-90 14 {TOP + PLOT_H // 2})'>tokens</text>")
    for i in request_ticks(n):  # the request axis
        out.append(f"<line x1='{x(i):.1f}' y1='{TOP + PLOT_H}' x2='{x(i):.1f}' "
                   f"y2='{TOP + PLOT_H + 5}' stroke='#9ca3af'/><text x='{x(i):.1f}' "
                   f"y='{TOP + PLOT_H + 18}' text-anchor='middle'>{i + 1}</text>")
    out.append(f"<text x='{LEFT + PLOT_W // 2}' y='{HEIGHT - 6}' text-anchor='middle'>"
               f"request (oldest first)</text>")
    marks = compactions(points)
    for i in marks:  # where the window compacted: the forwarded prompt shrank
        before, after = points[i - 1]["forwarded"], points[i]["forwarded"]
        out.append(f"<line class='compaction' x1='{x(i):.1f}' y1='{TOP}' x2='{x(i):.1f}' "
                   f"y2='{TOP + PLOT_H}' stroke='{MARK}' stroke-width='1.5' "
                   f"stroke-dasharray='4 3'><title>request {i + 1}: the window compacted, "
                   f"forwarded {before:,} → {after:,} tokens</title></line>")
    for key, colour, label, at in (("client", CLIENT, "sent by the client", LEFT),
                                   ("forwarded", FORWARDED, "forwarded upstream", LEFT + 190)):
        out.append(f"<polyline fill='none' stroke='{colour}' stroke-width='2.5' "
                   f"points='{line(key)}'><title>{label}</title></polyline>"
                   f"<line x1='{at}' y1='12' x2='{at + 26}' y2='12' stroke='{colour}' "
                   f"stroke-width='3'/><text x='{at + 32}' y='16'>{label}</text>")
    out.append("</svg>")
    if marks:
        out.insert(-1, f"<line x1='{LEFT + 380}' y1='12' x2='{LEFT + 406}' y2='12' "
                       f"stroke='{MARK}' stroke-width='1.5' stroke-dasharray='4 3'/>"
                       f"<text x='{LEFT + 412}' y='16'>window compacted</text>")
    last = points[-1]
    out.append(f"<p class='muted'>{n} request{'s' if n != 1 else ''} · the last: client "
               f"{tokens(last['client'])} tokens, forwarded {tokens(last['forwarded'])} "
               f"({saving(last['client'], last['forwarded'])} saved). Whole prompts as the "
               f"proxy counts them (messages, tool schemas, reply priming; forwarded "
               f"includes the proxy's own tools when it added them).</p>")
    if marks:
        out.append(f"<p class='muted'>The window compacted at {len(marks)} request"
                   f"{'s' if len(marks) != 1 else ''} (dashed: "
                   f"{', '.join(str(i + 1) for i in marks[:MARKS_LISTED])}"
                   f"{' …' if len(marks) > MARKS_LISTED else ''}): the forwarded prompt shrank "
                   f"there.</p>")
    return "".join(out)
