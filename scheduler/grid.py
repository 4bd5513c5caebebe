"""Step x stage text grid of a schedule's clock table, as in the tables of
"On Optimizing the Communication of Model Parallelism" (MLSys 2023).

One row per clock, one column per stage, each cell the compute run there (``F3``, ``B0``) or ``.``
when the stage idles. A marked cell is bracketed (``[F3]``) and its row starts with ``>>``; error
messages use a window of rows (and of stages, for wide pipelines) around the mark.
"""

from __future__ import annotations

from collections.abc import Sequence

IDLE = "."


def render_grid(
    clock_table: Sequence[Sequence[object | None]],
    n_stages: int,
    mark: tuple[int, int] | None = None,
    context: int | None = None,
    max_stages: int | None = None,
) -> str:
    """Render a clock table: `clock_table[c][s]` is what stage s runs at clock c (None = idle).

    mark: (clock, stage) to bracket and flag. context: with a mark, show only clocks within this
    distance of it. max_stages: show at most this many stage columns (a window around the mark).
    """
    table = clock_table
    n = n_stages
    stages = list(range(n))
    if max_stages is not None and n > max_stages:
        centre = mark[1] if mark is not None else 0
        first = min(max(0, centre - max_stages // 2), n - max_stages)
        stages = stages[first : first + max_stages]
    clocks = list(range(len(table)))
    if mark is not None and context is not None:
        clocks = [c for c in clocks if abs(c - mark[0]) <= context]

    def cell(c: int, s: int) -> str:
        action = table[c][s]
        text = IDLE if action is None else str(action)
        return f"[{text}]" if mark == (c, s) else text

    headers = [f"stage{s}" for s in stages]
    widths = [max([len(h)] + [len(cell(c, s)) for c in clocks]) for h, s in zip(headers, stages, strict=True)]
    clk_width = max(3, len(str(len(table))))
    left = "... " if stages and stages[0] > 0 else ""
    right = " ..." if stages and stages[-1] < n - 1 else ""

    def line(prefix: str, first: str, cells: list[str]) -> str:
        body = "  ".join(t.ljust(w) for t, w in zip(cells, widths, strict=True))
        return f"{prefix}{first.rjust(clk_width)}  {left}{body}{right}".rstrip()

    lines = [line("  ", "clk", headers)]
    if clocks and clocks[0] > 0:
        lines.append("  " + "...".rjust(clk_width))
    for c in clocks:
        prefix = ">>" if mark is not None and mark[0] == c else "  "
        lines.append(line(prefix, str(c), [cell(c, s) for s in stages]))
    if clocks and clocks[-1] < len(table) - 1:
        lines.append("  " + "...".rjust(clk_width))
    if mark is not None and not 0 <= mark[0] < len(table):
        lines.append(f">> stage {mark[1]} never reaches its next compute (clock {mark[0]})")
    return "\n".join(lines)
