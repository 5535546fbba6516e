"""The workload: a fixed prompt sample, a streaming replay client, and metrics from its per-request records.

``spec`` (what each trial replays), ``records`` (what a replay saw), ``sse`` (one stream's chunks into a record),
``client`` (the replay over HTTP), ``settle`` (per-slice tokens for the settle rule), ``metrics`` (the window's
figures). The names other modules use are re-exported here.
"""

from autotune.harness.workload.client import ReplayProgress, replay, thread_busy_s
from autotune.harness.workload.metrics import metrics_from_records
from autotune.harness.workload.records import (
    CUT,
    ReplayRecords,
    RequestRecord,
    SimPace,
    repeated_prompt_share,
    window_drift,
)
from autotune.harness.workload.settle import (
    Settler,
    SettleRule,
    Settling,
    SliceTally,
    settle,
    settling_figures,
)
from autotune.harness.workload.spec import ENDPOINTS, RequestBody, WorkloadSpec, request_body
from autotune.harness.workload.sse import SseStream
from autotune.prompts import PromptRow, PromptSample

__all__ = [
    "CUT",
    "ENDPOINTS",
    "PromptRow",
    "PromptSample",
    "ReplayProgress",
    "ReplayRecords",
    "RequestBody",
    "RequestRecord",
    "SettleRule",
    "Settler",
    "Settling",
    "SimPace",
    "SliceTally",
    "SseStream",
    "WorkloadSpec",
    "metrics_from_records",
    "repeated_prompt_share",
    "replay",
    "request_body",
    "settle",
    "settling_figures",
    "thread_busy_s",
    "window_drift",
]
