"""`diloco-operator`: run the DilocoRun operator (kopf) in a cluster or against a kubeconfig.

diloco-operator --namespace team-a --namespace team-b     # namespaced
diloco-operator -n team-a --peering diloco --priority auto  # HA: N replicas, the oldest active
"""

from __future__ import annotations

import argparse
import asyncio
import json
import logging
import os
import random
import time

import kopf
from diloco_trainer.logfmt import FORMATS, LOG_FORMAT_ENV, configure_logging, resolve_log_format
from prometheus_client import start_http_server

from diloco_operator.k8s import handlers, kube, state
from diloco_operator.k8s.netpolicy import OperatorIdentity


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="diloco-operator", description=__doc__.splitlines()[0])
    scope = p.add_mutually_exclusive_group()
    scope.add_argument(
        "-n",
        "--namespace",
        action="append",
        default=[],
        help="watch this namespace (repeatable; glob patterns allowed)",
    )
    scope.add_argument(
        "-A", "--all-namespaces", action="store_true", help="watch the whole cluster"
    )
    _add_peering(p)
    p.add_argument(
        "--syncer-network-policy",
        action="store_true",
        help="create a NetworkPolicy per run: only its learners and this operator reach the syncer",
    )
    p.add_argument(
        "--operator-namespace",
        default="",
        help="with --syncer-network-policy: the namespace of the operator's pods",
    )
    p.add_argument(
        "--operator-pod-labels",
        type=_labels,
        default={},
        help="with --syncer-network-policy: labels of the operator's pods, as JSON or k=v,k=v",
    )
    p.add_argument(
        "--liveness",
        default="http://0.0.0.0:8080/healthz",
        help="kopf liveness endpoint URL (empty to disable)",
    )
    p.add_argument("--metrics-port", type=int, default=9090, help="Prometheus port (0: off)")
    p.add_argument("--poll-interval", type=float, default=5.0, help="seconds between passes")
    p.add_argument(
        "--syncer-url",
        default=state.Options.syncer_url,
        help="how to reach a run's syncer; fields {name} {namespace} {port}",
    )
    p.add_argument(
        "--enable-chaos",
        action="store_true",
        help="deliver the faults of each run's spec.chaos (pod kills, syncer kills, nodes made "
        "NotReady); off by default: fault injection is the cluster owner's choice",
    )
    p.add_argument(
        "--manage-crd",
        action="store_true",
        help="at start, replace the cluster's DilocoRun CRD with this operator's when it is of "
        "an older version (needs get and update on that CRD); Helm never upgrades a chart's CRDs",
    )
    p.add_argument(
        "--release-runs",
        action="store_true",
        help="remove the operator's finalizer from every DilocoRun in scope and exit (use before "
        "uninstalling the operator, or when runs/namespaces hang in Terminating without it)",
    )
    p.add_argument("-v", "--verbose", action="store_true")
    p.add_argument(
        "--log-format", choices=FORMATS, default=None, help=f"text or json (else {LOG_FORMAT_ENV})"
    )
    return _checked(p, p.parse_args(argv))


def _add_peering(p: argparse.ArgumentParser) -> None:
    """HA: replicas that share a kopf peering object, the oldest acting."""
    p.add_argument(
        "--peering",
        metavar="NAME",
        help="kopf peering object for HA replicas (only the highest priority one acts); "
        "default: standalone",
    )
    p.add_argument(
        "--priority",
        type=_priority,
        default=None,
        help="peering priority of this replica, or 'auto' (the default with --peering): "
        "from the start time, so the oldest live replica leads and no two replicas tie "
        "(kopf pauses every replica of a tied priority)",
    )
    p.add_argument(
        "--peering-lifetime",
        type=int,
        default=15,
        help="seconds after its last keep-alive that a silent (killed) peer is presumed dead "
        "and a paused replica takes over",
    )


def _checked(p: argparse.ArgumentParser, args: argparse.Namespace) -> argparse.Namespace:
    """Refuse contradictory flags (argparse exits with the message) and resolve the defaults
    that depend on the time or the environment."""
    if args.poll_interval <= 0:
        p.error("--poll-interval: must be > 0")
    if args.peering_lifetime < 2:
        p.error("--peering-lifetime: at least 2 seconds")
    if args.syncer_network_policy and not (args.operator_namespace and args.operator_pod_labels):
        p.error("--syncer-network-policy: needs --operator-namespace and --operator-pod-labels")
    if args.priority is None or args.priority == "auto":
        args.priority = auto_priority(time.time(), random.randrange(1000))
    try:
        args.log_format = resolve_log_format(args.log_format, os.environ)
    except ValueError as exc:
        p.error(str(exc))
    return args


def _priority(text: str) -> int | str:
    if text == "auto":
        return text
    try:
        return int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r}: an integer or 'auto'") from None


def _labels(text: str) -> dict[str, str]:
    try:
        loaded = json.loads(text) if text.lstrip().startswith("{") else None
        pairs = loaded if loaded is not None else dict(kv.split("=", 1) for kv in text.split(","))
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r}: JSON or k=v,k=v") from None
    if not isinstance(pairs, dict) or not pairs:
        raise argparse.ArgumentTypeError(f"{text!r}: JSON or k=v,k=v")
    return {str(k): str(v) for k, v in pairs.items()}


def auto_priority(started: float, jitter: int) -> int:
    """kopf runs only the highest-priority peer and pauses every peer of a tied priority. From
    the start time (in ms, older = higher) plus a jitter below 1000 for replicas started in the
    same millisecond: replicas never tie, and a new replica (a restart, a rollout) never
    preempts the one already leading. Fits an int64 until the year 2262."""
    return -(int(started * 1000) * 1000 + jitter)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    configure_logging(logging.DEBUG if args.verbose else logging.INFO, args.log_format)
    state.STATE.options = state.Options(
        poll_interval=args.poll_interval,
        syncer_url=args.syncer_url,
        chaos=args.enable_chaos,
        manage_crd=args.manage_crd,
        peering_lifetime=args.peering_lifetime,
        network_policy=(
            OperatorIdentity(args.operator_namespace, args.operator_pod_labels)
            if args.syncer_network_policy
            else None
        ),
    )
    if args.release_runs:
        kube.load_config()
        released = kube.release_runs(
            None if args.all_namespaces or not args.namespace else args.namespace,
            handlers.FINALIZER,
        )
        print(f"released {released} DilocoRun(s)")
        return 0
    if args.metrics_port:
        start_http_server(args.metrics_port)
    clusterwide = args.all_namespaces or not args.namespace
    logging.getLogger("diloco_operator").info(
        "starting scope=%s peering=%s priority=%s",
        "cluster" if clusterwide else ",".join(args.namespace),
        args.peering or "standalone",
        args.priority,
    )
    asyncio.run(
        kopf.operator(
            clusterwide=clusterwide,
            namespaces=[] if clusterwide else args.namespace,
            standalone=args.peering is None,
            peering_name=args.peering,
            priority=args.priority,
            liveness_endpoint=args.liveness or None,
        )
    )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
