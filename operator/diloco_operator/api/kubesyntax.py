"""Kubernetes syntax the DilocoRun models enforce, so that a manifest the models accept never
makes children the API server refuses: names, label keys and values, quantities, and the CEL
rules that check what a structural schema cannot (map keys, int-or-string values)."""

from __future__ import annotations

from typing import Any

from diloco_trainer.config import INT64_MAX, MIN_PERIOD_SECONDS

__all__ = ["INT64_MAX", "MIN_PERIOD_SECONDS"]

# Service names are RFC 1035 labels (a letter first): the run name prefixes the syncer Service.
RUN_NAME = r"^[a-z]([-a-z0-9]*[a-z0-9])?$"
_SUBDOMAIN = r"[a-z0-9]([-a-z0-9]*[a-z0-9])?(\.[a-z0-9]([-a-z0-9]*[a-z0-9])?)*"
DNS_SUBDOMAIN = f"^{_SUBDOMAIN}$"
# Label keys, toleration keys and extended resource names: [dns-subdomain/]name.
_QUALIFIED = f"({_SUBDOMAIN}/)?[A-Za-z0-9]([-A-Za-z0-9_.]{{0,61}}[A-Za-z0-9])?"
QUALIFIED_NAME = f"^{_QUALIFIED}$"
OPTIONAL_QUALIFIED_NAME = f"^({_QUALIFIED})?$"
LABEL_VALUE = r"^(([A-Za-z0-9][-A-Za-z0-9_.]{0,61})?[A-Za-z0-9])?$"
# Container, volume and unit group names (RFC 1123 labels).
DNS_LABEL = r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?$"
# Environment variable names as the API server accepts them in a container spec.
ENV_NAME = r"^[-._a-zA-Z][-._a-zA-Z0-9]*$"
# An absolute path with no empty, "." or ".." segment and no trailing slash, so that comparing
# strings is comparing paths (the pod template's mount overlap rule relies on it).
NORMAL_PATH = r"^(/([^/.][^/]*|\.[^/.][^/]*|\.\.[^/]+))+$"
# Resource names: the standard ones, or an extended resource with a domain (nvidia.com/gpu).
RESOURCE_NAME = f"^(cpu|memory|ephemeral-storage|hugepages-[A-Za-z0-9.]+|{_SUBDOMAIN}/[A-Za-z0-9]([-A-Za-z0-9_.]{{0,61}}[A-Za-z0-9])?)$"
# A non-negative Kubernetes quantity in its canonical spellings (500m, 2Gi, 1.5, 1e3).
QUANTITY = r"^([0-9]+(\.[0-9]*)?|\.[0-9]+)([numkMGTPE]|[KMGTPE]i|e[-+]?[0-9]+)?$"
CHECKPOINT_PATH = f"^(gs://[a-z0-9]([-a-z0-9_.]{{0,61}}[a-z0-9])?(/[^\\s]*)?|{_SUBDOMAIN})$"
IMAGE = r"^[^\s]+$"
# The status lists every unit (status.units): the run is bounded so that the status always fits.
MAX_UNITS = 1000
# Learners heartbeat this many times within offlineAfterSeconds, so one late heartbeat is no
# false alarm.
HEARTBEATS_PER_OFFLINE = 3


def keys_rule(pattern: str, what: str) -> dict[str, Any]:
    # Map keys have no schema of their own in a structural CRD: CEL checks them.
    return {
        "x-kubernetes-validations": [
            {"rule": f"self.all(k, k.matches(r'{pattern}'))", "message": f"keys: {what}"}
        ]
    }
