"""`carpool_requests_total` counts each request under its own status and protocol, in whatever order the
statuses come (the front keeps each label set's counter, so a later status must not land on an earlier
one's)."""

from __future__ import annotations

from prometheus_client import CollectorRegistry

from carpool.runtime.metrics import RuntimeMetrics


def test_each_status_and_protocol_counts_apart() -> None:
    metrics = RuntimeMetrics("m", CollectorRegistry())
    for status, protocol in [(200, "http"), (400, "http"), (200, "http"), (200, "grpc"), (429, "grpc")]:
        metrics.count_request(status, protocol)
    metrics.count_request(200)

    def count(status: str, protocol: str) -> float | None:
        return metrics.registry.get_sample_value(
            "carpool_requests_total", {"model": "m", "status": status, "protocol": protocol}
        )

    assert count("200", "http") == 3
    assert count("400", "http") == 1
    assert count("200", "grpc") == 1
    assert count("429", "grpc") == 1
    assert count("400", "grpc") is None
