"""Charts as Markdown text, for asset metadata: the Dagster UI renders them on the asset page, next to the
numeric metadata it plots over time. Standard library only (used on both sides)."""

from __future__ import annotations

BLOCKS = "▁▂▃▄▅▆▇█"


def bars(rows: list[tuple[str, float | None]], vmax: float = 1.0, width: int = 30, fmt: str = "{:.3f}") -> str:
    """Horizontal bars, one per (label, value), in a code block so they line up."""
    label_w = max((len(label) for label, _ in rows), default=0)
    lines = []
    for label, value in rows:
        if value is None:
            lines.append(f"{label:<{label_w}}  {'·' * width}  n/a")
            continue
        filled = int(round(width * max(0.0, min(value / vmax, 1.0)))) if vmax > 0 else 0
        lines.append(f"{label:<{label_w}}  {'█' * filled}{'░' * (width - filled)}  {fmt.format(value)}")
    return "```\n" + "\n".join(lines) + "\n```"


def sparkline(values: list[float], width: int = 60) -> str:
    """Values resampled to at most `width` points, drawn with eighth-blocks between their min and max."""
    if not values:
        return ""
    if len(values) > width:
        step = len(values) / width
        values = [values[int(i * step)] for i in range(width)]
    lo, hi = min(values), max(values)
    span = (hi - lo) or 1.0
    return "".join(BLOCKS[min(len(BLOCKS) - 1, int((v - lo) / span * (len(BLOCKS) - 1) + 0.5))] for v in values)


def curves(series: dict[str, list[float]], x_label: str = "step") -> str:
    """Several named series as labelled sparklines with their first, last, min and max values."""
    w = max((len(name) for name in series), default=0)
    lines = []
    for name, values in series.items():
        if values:
            lines.append(f"{name:<{w}}  {sparkline(values)}  first {values[0]:.4g}, last {values[-1]:.4g}, "
                         f"min {min(values):.4g}, max {max(values):.4g}")
    return "```\n" + "\n".join(lines) + f"\n(x: {x_label})\n```"
