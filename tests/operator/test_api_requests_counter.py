"""Every Kubernetes API call the reconcile loops make goes through kube._api and is counted by
client method (diloco_operator_api_requests_total): the figure the huge-units bench divides by
reconcile passes."""

from __future__ import annotations

import asyncio
from typing import Any

from diloco_operator.k8s import kube
from prometheus_client import REGISTRY


def counted(call: str) -> float:
    value = REGISTRY.get_sample_value("diloco_operator_api_requests_total", {"call": call})
    return value or 0.0


def test_each_call_through_the_wrapper_is_counted_by_method() -> None:
    seen: list[Any] = []

    def read_namespaced_widget(*args: Any, **kwargs: Any) -> str:
        seen.append((args, kwargs))
        return "widget"

    before = counted("read_namespaced_widget")
    assert asyncio.run(kube._api(read_namespaced_widget, "w", "ns")) == "widget"
    assert asyncio.run(kube._api(read_namespaced_widget, "v", "ns")) == "widget"
    assert counted("read_namespaced_widget") == before + 2
    assert seen[0] == (("w", "ns"), {"_request_timeout": kube.REQUEST_TIMEOUT})
