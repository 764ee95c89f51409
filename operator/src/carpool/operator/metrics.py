"""The operator's own Prometheus metrics, defined once; `carpool operator --metrics-port` serves them."""

from __future__ import annotations

from prometheus_client import Counter, Gauge, Histogram

RECONCILES = Counter(
    "carpool_operator_reconciles_total",
    "Reconciliations of BatchedModels, by trigger (create, update, resume, child) and result.",
    ["trigger", "result"],
)
ERRORS = Counter(
    "carpool_operator_reconcile_errors_total",
    "Reconciliations that failed, by reason (InvalidSpec, ApiError, ...).",
    ["reason"],
)
DURATION = Histogram(
    "carpool_operator_reconcile_duration_seconds",
    "Time to reconcile one BatchedModel: build, compare, apply children and write status.",
    buckets=(0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0),
)
CHILD_WRITES = Counter(
    "carpool_operator_child_writes_total",
    "Writes to children, by kind and action (create, apply, delete).",
    ["kind", "action"],
)
WATCH_ERRORS = Counter(
    "carpool_operator_watch_errors_total",
    "Watch streams that ended on an API error and were started again, by reason "
    "(Forbidden, ApiServerError, WatchErrorEvent, ...).",
    ["reason"],
)
LEADER = Gauge(
    "carpool_operator_leader",
    "1 while this replica holds the leader-election Lease (`--leader-elect`), else 0.",
)
