"""Plotly figure builders for the console: pure functions from plain data to figure dicts.

Every builder takes already-read data (no database access), returns
`{"data": [...], "layout": {...}}` as built by `plotly.graph_objects.Figure.to_plotly_json()`,
and never mutates its arguments. Times are sent as naive ISO-8601 strings in UTC (plotly.js
ignores offsets), so every time axis is labelled UTC. `layout.uirevision` is fixed per chart so
that a live refresh through `Plotly.react` keeps the operator's zoom and hidden traces.

The SLO and target lines are layout shapes (`layout.shapes`, horizontal, `y0 == y1`), which the
browser tests read back from the rendered plot.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from datetime import UTC, datetime
from typing import Any

import plotly.graph_objects as go

GIB = 1024**3

# One palette for the whole console (colour-blind friendly, Okabe-Ito order).
PALETTE = ("#0072B2", "#E69F00", "#009E73", "#D55E00", "#CC79A7", "#56B4E9", "#F0E442", "#000000")
MEMORY_COLOURS = {
    "Weights": "#6b7280",
    "KV cache in use": "#0072B2",
    "Lent to finetuning": "#E69F00",
    "Free": "#d1d5db",
}
SLO_COLOUR = "#b91c1c"
TARGET_COLOUR = "#b91c1c"

Figure = dict[str, Any]


@dataclass(frozen=True)
class TimeSeries:
    """One named line: `ts[i]` (aware or naive UTC datetimes) pairs with `values[i]`."""

    name: str
    ts: Sequence[datetime]
    values: Sequence[float | None]

    def __post_init__(self) -> None:
        if len(self.ts) != len(self.values):
            raise ValueError(
                f"series {self.name!r}: {len(self.ts)} timestamps but {len(self.values)} values"
            )


@dataclass(frozen=True)
class MemorySplit:
    """A host's GPU memory at one instant, in bytes; the four parts add up to what it has."""

    host: str
    weights_bytes: int
    kv_used_bytes: int
    finetune_lent_bytes: int
    free_bytes: int


@dataclass(frozen=True)
class LatencyPairs:
    """Predicted and observed decode iteration latencies (ms) of one host, index-aligned."""

    label: str
    predicted_ms: Sequence[float]
    observed_ms: Sequence[float]

    def __post_init__(self) -> None:
        if len(self.predicted_ms) != len(self.observed_ms):
            raise ValueError(
                f"{self.label!r}: {len(self.predicted_ms)} predictions but "
                f"{len(self.observed_ms)} observations"
            )


def iso_utc(ts: datetime) -> str:
    """`ts` as a naive ISO string in UTC (an aware datetime is converted first)."""
    if ts.tzinfo is not None:
        ts = ts.astimezone(UTC).replace(tzinfo=None)
    return ts.isoformat(timespec="milliseconds")


def _base_layout(*, uirevision: str, y_title: str, x_title: str = "time (UTC)") -> dict[str, Any]:
    return {
        "template": "none",
        "uirevision": uirevision,
        "margin": {"l": 60, "r": 24, "t": 16, "b": 48},
        "font": {"family": "system-ui, -apple-system, Segoe UI, Roboto, sans-serif", "size": 12},
        "legend": {
            "orientation": "h",
            "x": 0,
            "y": 1.02,
            "yanchor": "bottom",
            "traceorder": "normal",
        },
        "hovermode": "x unified",
        "xaxis": {"title": {"text": x_title}, "gridcolor": "#eef0f3", "zeroline": False},
        "yaxis": {"title": {"text": y_title}, "gridcolor": "#eef0f3", "zeroline": False},
        "paper_bgcolor": "rgba(0,0,0,0)",
        "plot_bgcolor": "rgba(0,0,0,0)",
    }


def _line(series: TimeSeries, colour: str, **extra: Any) -> go.Scatter:
    return go.Scatter(
        name=series.name,
        x=[iso_utc(t) for t in series.ts],
        y=list(series.values),
        mode="lines+markers",
        marker={"size": 4},
        line={"color": colour, "width": 2},
        **extra,
    )


def _hline(figure: go.Figure, *, y: float, label: str, colour: str) -> None:
    figure.add_hline(
        y=y,
        line={"color": colour, "width": 2, "dash": "dash"},
        annotation={"text": label, "font": {"color": colour}},
        annotation_position="top left",
    )


def _as_dict(figure: go.Figure) -> Figure:
    result: Figure = figure.to_plotly_json()
    # Python-side template "none" only stops plotly.py's default theme; plotly.js needs nothing.
    result["layout"].pop("template", None)
    return result


def tpot_figure(*, p50: TimeSeries, p99: TimeSeries, tpot_slo_ms: float) -> Figure:
    """TPOT p50 and p99 over time with the deployment's SLO as a dashed horizontal line."""
    figure = go.Figure(layout=_base_layout(uirevision="tpot", y_title="TPOT (ms)"))
    figure.add_trace(_line(p50, PALETTE[0]))
    figure.add_trace(_line(p99, PALETTE[3]))
    _hline(figure, y=tpot_slo_ms, label=f"SLO {tpot_slo_ms:g} ms", colour=SLO_COLOUR)
    figure.update_yaxes(rangemode="tozero")
    return _as_dict(figure)


def attainment_figure(*, series: Sequence[TimeSeries], target_pct: float | None) -> Figure:
    """SLO attainment in percent, one line per series; `target_pct` draws the target line.

    Values are fractions 0..1 (as reported) and are plotted as percentages.
    """
    figure = go.Figure(layout=_base_layout(uirevision="attainment", y_title="SLO attainment (%)"))
    for index, one in enumerate(series):
        pct = TimeSeries(
            name=one.name,
            ts=one.ts,
            values=[None if v is None else round(100.0 * v, 4) for v in one.values],
        )
        figure.add_trace(_line(pct, PALETTE[index % len(PALETTE)]))
    if target_pct is not None:
        _hline(figure, y=target_pct, label=f"target {target_pct:g}%", colour=TARGET_COLOUR)
    figure.update_yaxes(range=[min(_lowest_pct(series, target_pct) - 1.0, 99.0), 100.5])
    return _as_dict(figure)


def _lowest_pct(series: Sequence[TimeSeries], target_pct: float | None) -> float:
    values = [100.0 * v for one in series for v in one.values if v is not None]
    if target_pct is not None:
        values.append(target_pct)
    return max(0.0, min(values, default=0.0))


def goodput_figure(*, goodput: TimeSeries, request_rate: TimeSeries) -> Figure:
    """Decode goodput (tokens/s of requests that met the SLO) and request rate, on two axes."""
    layout = _base_layout(uirevision="goodput", y_title="goodput (tokens/s)")
    layout["yaxis2"] = {
        "title": {"text": "requests/s"},
        "overlaying": "y",
        "side": "right",
        "showgrid": False,
        "rangemode": "tozero",
        "tickformat": ".1f",
    }
    layout["margin"]["r"] = 60
    figure = go.Figure(layout=layout)
    figure.add_trace(_line(goodput, PALETTE[2]))
    figure.add_trace(_line(request_rate, PALETTE[4], yaxis="y2"))
    figure.update_yaxes(rangemode="tozero", selector={"title": {"text": "goodput (tokens/s)"}})
    return _as_dict(figure)


def iteration_latency_figure(*, predicted: TimeSeries, observed: TimeSeries) -> Figure:
    """Predicted and observed decode iteration latency over time."""
    figure = go.Figure(layout=_base_layout(uirevision="iteration", y_title="iteration (ms)"))
    figure.add_trace(_line(observed, PALETTE[0]))
    figure.add_trace(_line(predicted, PALETTE[1], line_dash="dot"))
    figure.update_yaxes(rangemode="tozero")
    return _as_dict(figure)


def memory_split_figure(*, hosts: Sequence[MemorySplit]) -> Figure:
    """One horizontal stacked bar per host: weights, KV in use, lent to finetuning, free (GiB)."""
    layout = _base_layout(uirevision="memory", y_title="", x_title="GPU memory (GiB)")
    layout.update(barmode="stack", hovermode="y unified")
    layout["yaxis"]["autorange"] = "reversed"
    layout["margin"]["l"] = 110
    figure = go.Figure(layout=layout)
    parts = (
        ("Weights", lambda h: h.weights_bytes),
        ("KV cache in use", lambda h: h.kv_used_bytes),
        ("Lent to finetuning", lambda h: h.finetune_lent_bytes),
        ("Free", lambda h: h.free_bytes),
    )
    names = [h.host for h in hosts]
    for label, part in parts:
        figure.add_trace(
            go.Bar(
                name=label,
                orientation="h",
                y=names,
                x=[round(part(h) / GIB, 3) for h in hosts],
                marker={"color": MEMORY_COLOURS[label]},
                hovertemplate="%{x:.2f} GiB",
            )
        )
    return _as_dict(figure)


def memory_over_time_figure(
    *,
    weights: TimeSeries,
    kv_used: TimeSeries,
    lent: TimeSeries,
    free: TimeSeries,
) -> Figure:
    """One host's GPU memory over time, stacked (values in bytes, plotted in GiB): weights at the
    bottom, then KV cache in use, memory lent to finetuning, and free on top."""
    layout = _base_layout(uirevision="host-memory", y_title="GPU memory (GiB)")
    figure = go.Figure(layout=layout)
    for series in (weights, kv_used, lent, free):
        colour = MEMORY_COLOURS[series.name]
        in_gib = TimeSeries(
            name=series.name,
            ts=series.ts,
            values=[None if v is None else round(v / GIB, 3) for v in series.values],
        )
        figure.add_trace(
            go.Scatter(
                name=in_gib.name,
                x=[iso_utc(t) for t in in_gib.ts],
                y=list(in_gib.values),
                mode="lines",
                line={"color": colour, "width": 1},
                fillcolor=colour,
                stackgroup="memory",
                hovertemplate="%{y:.1f} GiB",
            )
        )
    return _as_dict(figure)


def finetune_throughput_figure(*, per_host: Sequence[TimeSeries]) -> Figure:
    """Harvested finetune tokens/s per host, stacked, so the top edge is the fleet-wide total."""
    figure = go.Figure(
        layout=_base_layout(uirevision="finetune", y_title="finetune tokens/s (stacked)")
    )
    for index, one in enumerate(per_host):
        figure.add_trace(_line(one, PALETTE[index % len(PALETTE)], stackgroup="hosts"))
    return _as_dict(figure)


def loss_figure(
    *,
    train_steps: Sequence[int],
    train_loss: Sequence[float],
    valid_steps: Sequence[int],
    valid_loss: Sequence[float],
) -> Figure:
    """Training and validation loss against the optimizer step."""
    if len(train_steps) != len(train_loss) or len(valid_steps) != len(valid_loss):
        raise ValueError("loss_figure: steps and losses must have the same length")
    layout = _base_layout(uirevision="loss", y_title="loss", x_title="step")
    layout["hovermode"] = "x"
    figure = go.Figure(layout=layout)
    figure.add_trace(
        go.Scatter(
            name="train loss",
            x=list(train_steps),
            y=list(train_loss),
            mode="lines",
            line={"color": PALETTE[0], "width": 2},
        )
    )
    figure.add_trace(
        go.Scatter(
            name="validation loss",
            x=list(valid_steps),
            y=list(valid_loss),
            mode="lines+markers",
            line={"color": PALETTE[1], "width": 2},
            marker={"size": 6},
        )
    )
    return _as_dict(figure)


def throughput_figure(*, tokens_per_s: TimeSeries) -> Figure:
    """Training throughput (tokens/s) over time: a job's, or the finetuning a host harvests."""
    figure = go.Figure(layout=_base_layout(uirevision="job-throughput", y_title="tokens/s"))
    figure.add_trace(_line(tokens_per_s, PALETTE[2]))
    figure.update_yaxes(rangemode="tozero")
    return _as_dict(figure)


def predictor_scatter_figure(*, per_host: Sequence[LatencyPairs]) -> Figure:
    """Predicted (x) against observed (y) iteration latency, one trace per host, and y = x."""
    layout = _base_layout(uirevision="predictor", y_title="observed (ms)", x_title="predicted (ms)")
    layout["hovermode"] = "closest"
    figure = go.Figure(layout=layout)
    values: list[float] = []
    for index, one in enumerate(per_host):
        figure.add_trace(
            go.Scatter(
                name=one.label,
                x=list(one.predicted_ms),
                y=list(one.observed_ms),
                mode="markers",
                marker={"color": PALETTE[index % len(PALETTE)], "size": 6, "opacity": 0.75},
            )
        )
        values += [*one.predicted_ms, *one.observed_ms]
    if values:
        low, high = min(values), max(values)
        figure.add_shape(
            type="line",
            x0=low,
            y0=low,
            x1=high,
            y1=high,
            line={"color": "#9ca3af", "dash": "dot", "width": 1},
        )
    return _as_dict(figure)


def token_usage_figure(*, prompt: TimeSeries, completion: TimeSeries, per: str) -> Figure:
    """A tenant's prompt and completion tokens per bucket (`per`: "minute" or "hour"),
    stacked bars at each bucket's start, so a bar's top is the bucket's total."""
    layout = _base_layout(uirevision=f"tokens-{per}", y_title=f"tokens per {per}")
    layout.update(barmode="stack")
    figure = go.Figure(layout=layout)
    for series, colour in ((prompt, PALETTE[0]), (completion, PALETTE[1])):
        figure.add_trace(
            go.Bar(
                name=series.name,
                x=[iso_utc(t) for t in series.ts],
                y=list(series.values),
                marker={"color": colour},
                hovertemplate="%{y:,.0f}",
            )
        )
    figure.update_yaxes(rangemode="tozero")
    return _as_dict(figure)


def point_counts(figure: Figure) -> dict[str, int]:
    """Points per trace, keyed by trace name (what the browser tests compare against)."""
    return {str(trace.get("name")): len(trace.get("x") or ()) for trace in figure["data"]}
