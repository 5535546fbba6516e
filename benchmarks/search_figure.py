"""The search-efficiency figure: best config found so far against modelled GPU-hours, one panel per case ×
workload (``results/search_efficiency.html``, generated rather than tracked)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
from strategies import PROPOSALS, best_so_far

MAX_HTML_BYTES = 5_000_000  # plotly.js inlined is ~4.6 MB; past 5 MB the figure is kept as JSON instead


def curves(result: dict[str, Any], name: str, top: int) -> tuple[np.ndarray, np.ndarray]:
    """Median best-so-far (% of optimum) against GPU-hours spent, on a common grid over seeds."""
    runs = result["runs"][name, top]
    horizon = max(sum(x.cost_s for x in r) for rs in result["runs"].values() for r in rs) / 3600
    grid = np.linspace(0, horizon, 120)
    ys = []
    for launches in runs:
        spent = np.cumsum([x.cost_s for x in launches]) / 3600
        best = 100 * np.asarray(best_so_far(launches)) / result["optimum"]
        idx = np.searchsorted(spent, grid, side="right") - 1
        y = np.where(idx >= 0, best[np.clip(idx, 0, None)], 0.0)
        y[grid > spent[-1]] = np.nan  # this seed's run had ended
        ys.append(y)
    return grid, np.nanmedian(np.vstack(ys), axis=0)


def figure(results: list[dict[str, Any]], budgets: list[int], path: Path) -> None:
    import warnings

    import plotly.graph_objects as go
    from plotly.subplots import make_subplots

    top = max(budgets)
    fig = make_subplots(rows=1, cols=len(results), subplot_titles=[r["name"] for r in results])
    palette = [
        "#d62728",
        "#ff9896",
        "#e377c2",
        "#f7b6d2",
        "#c49c94",
        "#bcbd22",
        "#1f77b4",
        "#7f7f7f",
        "#2ca02c",
        "#9467bd",
        "#ff7f0e",
        "#8c564b",
        "#17becf",
    ]
    names = results[0]["names"]
    colors = {name: palette[i % len(palette)] for i, name in enumerate(names)}
    for col, res in enumerate(results, start=1):
        for name in names:
            with warnings.catch_warnings():
                warnings.simplefilter("ignore", RuntimeWarning)  # all-NaN columns after every seed ended
                x, y = curves(res, name, top)
            fig.add_trace(
                go.Scatter(
                    x=np.round(x, 3),
                    y=np.round(y, 2),
                    mode="lines",
                    name=name,
                    line={"color": colors[name], "shape": "hv", "dash": "dot" if name in PROPOSALS else "solid"},
                    showlegend=col == 1,
                    legendgroup=name,
                ),
                row=1,
                col=col,
            )
        fig.update_xaxes(title_text="modelled GPU-hours", row=1, col=col)
        fig.update_yaxes(title_text="best so far, % of optimum" if col == 1 else None, range=[0, 102], row=1, col=col)
    fig.update_layout(
        title=f"Best config found vs GPU time (median of seeds, {top}-trial runs)", height=450, width=420 * len(results)
    )
    fig.write_html(path, include_plotlyjs=True, full_html=True)
    if path.stat().st_size > MAX_HTML_BYTES:  # too big to commit: the figure as JSON, and a page without plotly.js
        path.with_suffix(".json").write_text(fig.to_json(), encoding="utf-8")
        fig.write_html(path, include_plotlyjs=False, full_html=True)
