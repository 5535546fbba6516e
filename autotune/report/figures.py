"""DataFrames from ``report_data`` → plotly figures. Drawing only: every number was computed (and tested) there.

Failed trials get their own marks instead of disappearing; SVG traces with modest opacity stay legible at a
few hundred trials, and the latency figure draws precomputed quantiles, never raw samples.
"""

from __future__ import annotations

import html
import math

import pandas as pd
import plotly.graph_objects as go
from plotly.subplots import make_subplots

from autotune.report.data import PARAM_PREFIX, param_columns

TEMPLATE = "plotly_white"
FONT = dict(family="Inter, -apple-system, 'Segoe UI', Roboto, Helvetica, Arial, sans-serif", size=13)
ROLE_STYLE = {  # role → (colour, marker)
    "baseline": ("#6b7280", "star"),
    "enqueued": ("#9333ea", "diamond"),
    "prior": ("#0d9488", "triangle-up"),  # the planner's starting points on the memory wall
    "search": ("#2563eb", "circle"),
}
GROUP_STYLE = {  # outcome group other than "ok" → (colour, marker, legend name)
    "slo": ("#9ca3af", "circle-open", "measured, violates an SLO"),
    "oom": ("#dc2626", "x", "OOM (startup or under load)"),
    "infeasible": ("#f59e0b", "x-thin-open", "infeasible (planner pre-check)"),
    "failed": ("#111827", "triangle-down-open", "crash / timeout / interrupted"),
}
MEMORY_STYLE = {
    "weights": ("weights", "#1e3a8a"),
    "kv": ("KV cache", "#2563eb"),
    "mamba_states": ("Mamba states", "#0d9488"),
    "spec_intermediates": ("speculative intermediates", "#5eead4"),
    "graphs": ("CUDA graphs", "#a855f7"),
    "activations": ("activations", "#f472b6"),
    "other": ("context / runtime", "#9ca3af"),
    "headroom": ("headroom", "#d1fae5"),
}
# Legends of subplot figures go below the axes, where they cannot cover the subplot titles.
BOTTOM = dict(legend=dict(orientation="h", yanchor="top", y=-0.16, x=0), margin=dict(l=60, r=20, t=40, b=100))
SERIES = ["#2563eb", "#dc2626", "#059669", "#d97706", "#7c3aed", "#0891b2"]


def _layout(fig: go.Figure, *, height: int = 420, **kwargs) -> go.Figure:
    settings = dict(
        template=TEMPLATE,
        font=FONT,
        height=height,
        margin=dict(l=60, r=20, t=30, b=50),
        legend=dict(orientation="h", yanchor="bottom", y=1.02, x=0),
        hovermode="closest",
    )
    fig.update_layout(**{**settings, **kwargs})
    return fig


def _hover(frame: pd.DataFrame) -> list[str]:
    texts = []
    for _, row in frame.iterrows():
        # Labels and log lines are user/SGLang text: escape them, plotly renders a subset of HTML in hovers.
        text = f"trial {row['trial']} — {html.escape(str(row['label']))}<br>{row['outcome']}"
        if row["tok_s"] > 0:
            text += f": {row['tok_s']:,.0f} tok/s"
            if row.get("gpus", 1) > 1:  # a server over several GPUs: the per-GPU score it was ranked by
                text += f" on {row['gpus']} GPUs ({row['tok_s_per_gpu']:,.0f} tok/s per GPU)"
        if row.get("numerics"):
            text += "<br>outputs vs baseline: " + html.escape(str(row["numerics"]))
        if row.get("reason"):
            text += "<br>" + html.escape(str(row["reason"])[:120])
        texts.append(text)
    return texts


def _failure_traces(
    fig: go.Figure,
    frame: pd.DataFrame,
    x: str,
    *,
    pos: dict | None = None,
    showlegend: bool = True,
    as_text: bool = False,
) -> None:
    """Trials that are not candidates, in their own marks: those that never measured sit at 0 tok/s so the
    wall they hit stays visible; SLO violators at what they measured."""
    for group, (colour, symbol, name) in GROUP_STYLE.items():
        part = frame[(frame["group"] == group) & frame[x].notna()]
        if part.empty:
            continue
        fig.add_trace(
            go.Scatter(
                x=part[x].astype(str) if as_text else part[x],
                y=part["tok_s"].fillna(0.0),
                mode="markers",
                name=name,
                hovertext=_hover(part),
                hoverinfo="text",
                legendgroup=group,
                marker=dict(color=colour, symbol=symbol, size=9, line_width=1.5),
                showlegend=showlegend,
            ),
            **(pos or {}),
        )


def _numerics_marks(fig: go.Figure, frame: pd.DataFrame, x: str) -> None:
    """A ring around every trial whose greedy outputs differ from the baseline's (the fidelity probe measured it)."""
    if "outputs_differ" not in frame:
        return
    part = frame[frame["outputs_differ"].astype(bool) & frame[x].notna()]
    if part.empty:
        return
    fig.add_trace(
        go.Scatter(
            x=part[x],
            y=part["tok_s"].fillna(0.0),
            mode="markers",
            name="outputs differ from the baseline",
            hovertext=_hover(part),
            hoverinfo="text",
            marker=dict(symbol="circle-open", size=20, color="#b45309", line_width=2.5),
        )
    )


def history_figure(frame: pd.DataFrame) -> go.Figure:
    """Every trial's tok/s in order, the best-so-far line, and failures in their own marks."""
    fig = go.Figure()
    ok = frame[frame["group"] == "ok"]
    for role, (colour, symbol) in ROLE_STYLE.items():
        part = ok[ok["role"] == role]
        if part.empty:
            continue
        fig.add_trace(
            go.Scatter(
                x=part["trial"],
                y=part["tok_s"],
                mode="markers",
                name=role,
                hovertext=_hover(part),
                hoverinfo="text",
                marker=dict(color=colour, symbol=symbol, opacity=0.75, size=12 if role != "search" else 8),
            )
        )
    _failure_traces(fig, frame, "trial")
    _numerics_marks(fig, frame, "trial")
    best = frame.dropna(subset=["best_so_far"])
    fig.add_trace(
        go.Scatter(
            x=best["trial"],
            y=best["best_so_far"],
            mode="lines",
            name="best so far",
            line=dict(color="#059669", width=2.5, shape="hv"),
        )
    )
    fig.update_xaxes(title="trial")
    fig.update_yaxes(title="output tok/s", rangemode="tozero")
    return _layout(fig)


def capacity_figure(frame: pd.DataFrame) -> go.Figure:
    """Throughput against the concurrency SGLang actually allowed, coloured by speculative steps."""
    fig = go.Figure()
    ok = frame[frame["group"] == "ok"]
    fig.add_trace(
        go.Scatter(
            x=ok["max_running_requests"],
            y=ok["tok_s"],
            mode="markers",
            name="measured",
            hovertext=_hover(ok),
            hoverinfo="text",
            marker=dict(
                color=ok["spec_steps"],
                colorscale="Viridis",
                size=9,
                opacity=0.8,
                showscale=True,
                colorbar=dict(title="spec.<br>steps", thickness=14),
            ),
        )
    )
    _failure_traces(fig, frame, "max_running_requests")
    _numerics_marks(fig, frame, "max_running_requests")
    fig.update_xaxes(title="effective max running requests (per GPU)")
    fig.update_yaxes(title="output tok/s", rangemode="tozero")
    return _layout(fig)


def slices_figure(frame: pd.DataFrame) -> go.Figure:
    """One panel per tuned flag: tok/s against that flag's value, coloured by trial order."""
    columns = param_columns(frame)
    cols = min(3, max(len(columns), 1))
    rows = max(math.ceil(len(columns) / cols), 1)
    titles = [c.removeprefix(PARAM_PREFIX) for c in columns]
    fig = make_subplots(rows=rows, cols=cols, subplot_titles=titles, horizontal_spacing=0.07, vertical_spacing=0.16)
    ok = frame[frame["group"] == "ok"]
    for i, column in enumerate(columns):
        pos = dict(row=i // cols + 1, col=i % cols + 1)
        as_text = bool(frame[column].map(lambda v: isinstance(v, str)).any())
        x = ok[column].astype(str) if as_text else ok[column]
        fig.add_trace(
            go.Scatter(
                x=x,
                y=ok["tok_s"],
                mode="markers",
                name="measured",
                showlegend=i == 0,
                hovertext=_hover(ok),
                hoverinfo="text",
                legendgroup="ok",
                marker=dict(
                    color=ok["trial"],
                    colorscale="Blues",
                    size=7,
                    opacity=0.75,
                    line=dict(width=0.5, color="#1e3a8a"),
                    showscale=i == 0,
                    colorbar=dict(title="trial", thickness=14),
                ),
            ),
            **pos,
        )
        _failure_traces(fig, frame, column, pos=pos, showlegend=i == 0, as_text=as_text)
        fig.update_yaxes(rangemode="tozero", **pos)
    fig.update_yaxes(title="tok/s", col=1)
    return _layout(fig, height=300 * rows + 90, **BOTTOM)


def importance_figure(importance: pd.DataFrame) -> go.Figure:
    ordered = importance.sort_values("importance")
    fig = go.Figure(
        go.Bar(
            x=ordered["importance"],
            y=ordered["param"],
            orientation="h",
            marker_color="#2563eb",
            text=[f"{v:.0%}" for v in ordered["importance"]],
            textposition="outside",
        )
    )
    fig.update_xaxes(title="importance for reaching the top tok/s", tickformat=".0%", range=[0, 1.08])
    return _layout(fig, height=max(220, 60 + 40 * len(ordered)), showlegend=False)


def parallel_figure(frame: pd.DataFrame) -> go.Figure:
    """All measured configurations as lines across the tuned flags, coloured by tok/s (OOMs at 0)."""
    done = frame[frame["state"] == "COMPLETE"]
    dimensions = []
    for column in param_columns(frame):
        values = done[column]
        if values.map(lambda v: isinstance(v, str) or v is None).any():
            labels = sorted({str(v) for v in values})
            codes = values.map(lambda v, labels=labels: labels.index(str(v)))
            dimensions.append(
                dict(
                    label=column.removeprefix(PARAM_PREFIX),
                    values=codes,
                    tickvals=list(range(len(labels))),
                    ticktext=labels,
                )
            )
        else:
            dimensions.append(dict(label=column.removeprefix(PARAM_PREFIX), values=values.astype(float)))
    dimensions.append(dict(label="tok/s", values=done["tok_s"]))
    fig = go.Figure(
        go.Parcoords(
            line=dict(
                color=done["tok_s"], colorscale="Viridis", showscale=True, colorbar=dict(title="tok/s", thickness=14)
            ),
            dimensions=dimensions,
        )
    )
    return _layout(fig, height=440, margin=dict(l=70, r=40, t=60, b=30))


def memory_figure(memory: pd.DataFrame) -> go.Figure:
    """Planner's predicted split per trial (stacked, headroom below zero means a predicted OOM) beside the
    observed NVML peak."""
    fig = go.Figure()
    x = memory["trial"]
    for part, (name, colour) in MEMORY_STYLE.items():
        fig.add_trace(
            go.Bar(
                x=x,
                y=memory[part],
                name=name,
                marker_color=colour,
                marker_line_width=0,
                hovertemplate=f"trial %{{x}}<br>{name}: %{{y:.1f}} GiB<extra></extra>",
            )
        )
    fig.add_trace(
        go.Scatter(
            x=x,
            y=memory["observed_peak_gib"],
            mode="markers",
            name="observed peak (NVML)",
            marker=dict(symbol="line-ew-open", size=12, color="#111827", line_width=2.5),
            hovertemplate="trial %{x}<br>observed peak: %{y:.1f} GiB<extra></extra>",
        )
    )
    fig.add_trace(
        go.Scatter(
            x=x,
            y=memory["predicted_peak_gib"],
            mode="markers",
            name="predicted peak",
            marker=dict(symbol="circle", size=5, color="#dc2626"),
            hovertemplate="trial %{x}<br>predicted peak: %{y:.1f} GiB<extra></extra>",
        )
    )
    if len(memory):
        fig.add_hline(
            y=float(memory["total_gib"].max()),
            line_dash="dot",
            line_color="#6b7280",
            annotation_text="device memory",
            annotation_position="top left",
        )
    fig.update_xaxes(title="trial", type="category" if len(memory) <= 40 else "linear")
    fig.update_yaxes(title="GiB")
    return _layout(fig, height=460, barmode="relative", bargap=0.15)


def latency_figure(latency: pd.DataFrame) -> go.Figure:
    """TTFT and ITL for the baseline and the top trials: boxes from record quantiles (whiskers p5–p99), or the
    stored p50/p90/p99 when a trial kept no per-request records."""
    fig = make_subplots(
        rows=1, cols=2, subplot_titles=("time to first token (ms)", "inter-token latency (ms)"), horizontal_spacing=0.1
    )
    labels = list(dict.fromkeys(_name(t, lab) for t, lab in zip(latency["trial"], latency["label"], strict=True)))
    colours = {label: SERIES[i % len(SERIES)] for i, label in enumerate(labels)}
    for col, metric in enumerate(("ttft", "itl"), start=1):
        for _, row in latency[latency["metric"] == metric].iterrows():
            name = _name(row["trial"], row["label"])
            if row["source"] == "records":
                fig.add_trace(
                    go.Box(
                        name=name,
                        x=[name],
                        q1=[row["p25"]],
                        median=[row["p50"]],
                        q3=[row["p75"]],
                        lowerfence=[row["p5"]],
                        upperfence=[row["p99"]],
                        mean=[row["mean"]],
                        marker_color=colours[name],
                        legendgroup=name,
                        showlegend=col == 1,
                    ),
                    row=1,
                    col=col,
                )
            else:
                fig.add_trace(
                    go.Scatter(
                        x=[name] * 3,
                        y=[row["p50"], row["p90"], row["p99"]],
                        mode="markers+lines",
                        name=name,
                        marker=dict(color=colours[name], size=9, symbol=["circle", "diamond", "triangle-up"]),
                        text=["p50", "p90", "p99"],
                        legendgroup=name,
                        showlegend=col == 1,
                    ),
                    row=1,
                    col=col,
                )
    fig.update_yaxes(rangemode="tozero")
    return _layout(fig, height=440, **BOTTOM)


def _name(trial: int, label: str) -> str:
    return label if label == f"trial {trial}" else f"#{trial} {label}"


def pareto_figure(pareto: pd.DataFrame, second: str) -> go.Figure:
    fig = go.Figure()
    rest, front = pareto[~pareto["on_front"]], pareto[pareto["on_front"]].sort_values("tok_s")
    fig.add_trace(
        go.Scatter(
            x=rest["tok_s"],
            y=rest["second"],
            mode="markers",
            name="dominated",
            marker=dict(color="#93c5fd", size=8, opacity=0.7),
            text=rest["label"],
        )
    )
    fig.add_trace(
        go.Scatter(
            x=front["tok_s"],
            y=front["second"],
            mode="markers+lines",
            name="Pareto front",
            marker=dict(color="#dc2626", size=10),
            line=dict(shape="hv"),
            text=front["label"],
        )
    )
    fig.update_xaxes(title="output tok/s")
    fig.update_yaxes(title=second)
    return _layout(fig)


def compare_figure(frames: dict[str, pd.DataFrame]) -> go.Figure:
    """Several studies overlaid: the best-so-far curves, and throughput against effective concurrency."""
    fig = make_subplots(
        rows=1,
        cols=2,
        subplot_titles=("best tok/s so far", "tok/s vs effective max running requests"),
        horizontal_spacing=0.1,
    )
    for i, (name, frame) in enumerate(frames.items()):
        colour = SERIES[i % len(SERIES)]
        best = frame.dropna(subset=["best_so_far"])
        fig.add_trace(
            go.Scatter(
                x=best["trial"],
                y=best["best_so_far"],
                mode="lines",
                name=name,
                legendgroup=name,
                line=dict(color=colour, width=2.5, shape="hv"),
            ),
            row=1,
            col=1,
        )
        ok = frame[frame["group"] == "ok"]
        fig.add_trace(
            go.Scatter(
                x=ok["max_running_requests"],
                y=ok["tok_s"],
                mode="markers",
                name=name,
                legendgroup=name,
                showlegend=False,
                hovertext=_hover(ok),
                hoverinfo="text",
                marker=dict(color=colour, size=7, opacity=0.6),
            ),
            row=1,
            col=2,
        )
    fig.update_xaxes(title="trial", row=1, col=1)
    fig.update_xaxes(title="max running requests", row=1, col=2)
    fig.update_yaxes(title="tok/s", rangemode="tozero")
    return _layout(fig, height=440, **BOTTOM)


def stability_figure(stability: pd.DataFrame) -> go.Figure:
    """One strip per trial: each slice's tok/s over its window's mean (white = the trial's figure), a mark where its
    window began, and an unsettled trial named on its row."""
    trials = sorted(stability["trial"].unique())
    names = []
    for trial in trials:
        rows = stability[stability["trial"] == trial]
        settled = bool(rows["settled"].iloc[0])
        names.append(f"trial {trial}" + ("" if settled else " (unsettled)"))
    slice_s = float(stability["t_s"].iloc[1] - stability["t_s"].iloc[0]) if len(stability) > 1 else 1.0
    times = sorted(stability["t_s"].unique())
    grid = stability.pivot_table(index="trial", columns="t_s", values="relative").reindex(index=trials, columns=times)
    texts = (
        stability.assign(text=lambda f: f["phase"] + ": " + f["tok_s"].map("{:,.0f} tok/s".format))
        .pivot(index="trial", columns="t_s", values="text")
        .reindex(index=trials, columns=times)
    )
    fig = go.Figure(
        go.Heatmap(
            z=grid.to_numpy(),
            x=[t + slice_s / 2 for t in times],
            y=names,
            text=texts.to_numpy(),
            hoverinfo="text+x+y",
            colorscale="RdBu",
            zmid=1.0,
            zmin=0.5,
            zmax=1.5,
            colorbar=dict(title="÷ window mean", thickness=14),
        )
    )
    starts = stability[stability["phase"] == "window"].groupby("trial")["t_s"].min().reindex(trials)
    fig.add_trace(
        go.Scatter(
            x=starts.to_numpy(),
            y=names,
            mode="markers",
            name="window starts",
            hoverinfo="skip",
            marker=dict(symbol="line-ns-open", size=16, color="#111827", line=dict(width=2)),
        )
    )
    fig.update_xaxes(title="seconds since the replay started")
    return _layout(fig, height=max(220, 26 * len(trials) + 120))
