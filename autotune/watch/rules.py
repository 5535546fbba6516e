"""The drift rules: each compares one server's rolling window with what the tuning assumed and, when they
disagree, says so with the evidence and the reason it matters. Pure functions of the window, so every rule is
tested without a server.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

from autotune.watch.metrics import Histogram
from autotune.watch.reference import Tuned
from autotune.watch.window import ServerMemory, Window

RULES = ("prompt_length", "output_length", "kv_pressure", "binding_moved", "acceptance", "throughput")


@dataclass(frozen=True, kw_only=True)
class Limits:
    kv_full: float = 0.90  # KV usage above this is "the pool runs dry"
    idle: float = 0.50  # a pool below this while the other is full is "idle"
    beyond_share: float = 0.20  # share of requests outside the tuned range that counts as a shift
    min_requests: int = 5  # finished requests a length rule needs in the window
    accept_drop: float = 0.10  # relative fall of the speculative accept length
    sustain_s: float = 90.0  # how long throughput must stay low (and demand waiting)


@dataclass(frozen=True, kw_only=True)
class Finding:
    server: str
    rule: str
    evidence: str
    reason: str
    fix: list[str] = field(default_factory=list)

    def line(self) -> str:
        fix = f" Fix: {' '.join(self.fix)}" if self.fix else ""
        return f"{self.server} [{self.rule}] {self.evidence}: {self.reason}.{fix}"


@dataclass(frozen=True, kw_only=True)
class Context:
    """One server as the rules see it: its window, the reference, and its capacity facts from ``/server_info``."""

    url: str
    window: Window
    memory: ServerMemory
    tuned: Tuned | None
    limits: Limits
    binding: str | None = None  # which cap binds max_running_requests (inspect's explain_capacity)
    hybrid: bool = False  # the model has a Mamba pool


def _pct(x: float) -> str:
    return f"{100 * x:.0f} %"


def _beyond(h: Histogram, low: int, high: int) -> float:
    """Share of the window's requests in buckets wholly outside [low, high] (bucket edges never over-count)."""
    out = sum(n for lo, up, n in h.buckets() if lo >= high or up < low)
    return out / h.count if h.count else 0.0


def _length_rule(ctx: Context, name: str, rule: str, what: str, rng: tuple[int, int] | None) -> Finding | None:
    h = ctx.window.histogram(name)
    if rng is None or h is None or h.count < ctx.limits.min_requests:
        return None
    share = _beyond(h, *rng)
    if share <= ctx.limits.beyond_share:
        return None
    median, mean = h.quantile(0.5) or 0.0, h.mean or 0.0
    direction = "longer" if median > rng[1] else "shorter"
    return Finding(
        server=ctx.url,
        rule=rule,
        evidence=(
            f"{what} lengths median ≈ {median:,.0f}, mean {mean:,.0f} tokens over {h.count:.0f} requests "
            f"in the last {ctx.window.seconds:.0f} s; {_pct(share)} outside the tuned {rng[0]:,}–{rng[1]:,}"
        ),
        reason=f"the workload is {direction} than the one this config was tuned on, so its memory split and "
        "running cap no longer fit it",
    )


def prompt_length(ctx: Context) -> Finding | None:
    return _length_rule(
        ctx, "prompt_tokens_histogram", "prompt_length", "prompt", ctx.tuned.prompt_range if ctx.tuned else None
    )


def output_length(ctx: Context) -> Finding | None:
    return _length_rule(
        ctx, "generation_tokens_histogram", "output_length", "output", ctx.tuned.output_range if ctx.tuned else None
    )


def _kv_usage(ctx: Context) -> float | None:
    s = ctx.window.latest
    if s is None:
        return None
    return s.gauges.get("full_token_usage", s.gauges.get("token_usage"))


def _retracted(w: Window) -> float:
    """Requests retracted inside the window: SGLang's counter when exported, else its per-interval gauge."""
    delta = w.counter_delta("num_retracted_requests_total")
    if delta is not None:
        return max(0.0, delta)
    return max(w.gauge("num_retracted_reqs")[1:] or [0.0])  # the first sample may predate the window


def kv_pressure(ctx: Context) -> Finding | None:
    kv = _kv_usage(ctx)
    retracted = _retracted(ctx.window)
    if (kv is None or kv <= ctx.limits.kv_full) and retracted <= 0:
        return None
    parts = [] if kv is None else [f"KV {_pct(kv)} used"]
    tokens = (ctx.window.latest.gauges if ctx.window.latest else {}).get("max_total_num_tokens")
    if tokens and parts:
        parts[0] += f" of {tokens:,.0f} tokens"
    if retracted > 0:
        parts.append(f"{retracted:.0f} request(s) retracted in the last {ctx.window.seconds:.0f} s")
    return Finding(
        server=ctx.url,
        rule="kv_pressure",
        evidence=", ".join(parts),
        reason="the KV pool runs dry: SGLang retracts requests and recomputes them, so throughput falls while "
        "the server stays healthy (the memory this config gave to Mamba slots no longer pays)",
    )


def binding_moved(ctx: Context) -> Finding | None:
    s = ctx.window.latest
    if not ctx.hybrid or s is None or "mamba_usage" not in s.gauges:
        return None
    kv, mamba = _kv_usage(ctx), s.gauges["mamba_usage"]
    queued = s.gauges.get("num_queue_reqs", 0.0)
    if kv is None:
        return None
    if kv > ctx.limits.kv_full and mamba < ctx.limits.idle:
        return Finding(
            server=ctx.url,
            rule="binding_moved",
            evidence=f"KV {_pct(kv)} used while the Mamba slots are {_pct(mamba)} used"
            + (f" (tuned to bind on {ctx.binding})" if ctx.binding else ""),
            reason="the KV cache now limits how many requests run, not the Mamba slots: slots sit idle while "
            "requests wait for KV",
        )
    if mamba >= ctx.limits.kv_full and kv < ctx.limits.idle and queued > 0:
        return Finding(
            server=ctx.url,
            rule="binding_moved",
            evidence=f"Mamba slots {_pct(mamba)} used, KV only {_pct(kv)}, {queued:.0f} request(s) queued",
            reason="the Mamba slots now cap concurrency while the KV pool has room: the traffic got shorter",
        )
    return None


def acceptance(ctx: Context) -> Finding | None:
    live = [v for v in ctx.window.gauge("spec_accept_length") if v > 0]
    if not live:
        return None
    ref = ctx.tuned.accept_length if ctx.tuned and ctx.tuned.accept_length else ctx.memory.first_accept
    if not ref:
        return None
    now = sum(live) / len(live)
    if now >= (1 - ctx.limits.accept_drop) * ref:
        return None
    origin = "the study measured" if ctx.tuned and ctx.tuned.accept_length else "watch first saw"
    return Finding(
        server=ctx.url,
        rule="acceptance",
        evidence=f"speculative accept length {now:.2f} over the window, {origin} {ref:.2f} "
        f"({100 * (1 - now / ref):.0f} % lower)",
        reason="each speculative step now yields fewer tokens, so the draft work and its Mamba scratch may no "
        "longer pay for themselves",
    )


def throughput(ctx: Context) -> Finding | None:
    if ctx.tuned is None or ctx.tuned.tok_s_ci is None or ctx.window.latest is None:
        return None
    low, high = ctx.tuned.tok_s_ci
    since = ctx.window.latest.t - ctx.limits.sustain_s
    if not ctx.window.samples or ctx.window.samples[0].t > since:
        return None  # the window does not yet cover the sustain period
    recent = [s for s in ctx.window.samples if s.t >= since]
    rates = [s.gauges["gen_throughput"] for s in recent if "gen_throughput" in s.gauges]
    waiting = all(s.gauges.get("num_queue_reqs", 0.0) > 0 for s in recent)
    if not waiting or len(rates) < len(recent) or any(r >= low for r in rates):
        return None  # without waiting demand a slower server is just a quieter one
    return Finding(
        server=ctx.url,
        rule="throughput",
        evidence=f"generation {min(rates):,.0f}–{max(rates):,.0f} tok/s for {ctx.limits.sustain_s:.0f} s with "
        f"requests queued; the confirmed figure is {ctx.tuned.tok_s or 0:,.0f} tok/s "
        f"(95 % CI {low:,.0f}–{high:,.0f})",
        reason="the server is saturated yet slower than the tuning measured: the config no longer suits the traffic",
    )


CHECKS: dict[str, Callable[[Context], Finding | None]] = {
    "prompt_length": prompt_length,
    "output_length": output_length,
    "kv_pressure": kv_pressure,
    "binding_moved": binding_moved,
    "acceptance": acceptance,
    "throughput": throughput,
}


def evaluate(ctx: Context) -> list[Finding]:
    """Every rule's finding for one server, in ``RULES`` order."""
    return [f for rule in RULES if (f := CHECKS[rule](ctx)) is not None]
