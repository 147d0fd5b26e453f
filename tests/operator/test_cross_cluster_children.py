"""The children of a run that crosses clusters: the home syncer serves HTTPS from its certificate
Secret and is exposed through an internal load balancer; learners get the CA alone; an away
run's units join the home syncer with tokens derived from its join credential; and an away
run's status says how the home syncer answers."""

from __future__ import annotations

import ssl
import subprocess
from pathlib import Path
from typing import Any
from urllib.parse import urlparse

import aiohttp
import pytest
import yaml
from diloco_operator.api import DilocoRunStatus, UnitStatus, parse_spec
from diloco_operator.k8s import builders, run_secrets
from diloco_operator.k8s.away import (
    away_status,
    error_reason,
    heard_since_the_link_returned,
    refusal_reason,
)
from diloco_operator.k8s.netpolicy import OperatorIdentity, run_objects_with_policy
from diloco_operator.k8s.state import Reach
from diloco_operator.planner import CreateUnit
from diloco_operator.planner.failure import failure_signal
from diloco_operator.planner.model import ObservedUnit
from diloco_trainer.auth import unit_token
from diloco_trainer.join_credentials import (
    mint_join_credential,
    parse_join_credential,
    unit_token_from_credential,
)
from diloco_trainer.status import FragmentStatus, LearnerStatus, SyncerStatus

OBJCHECK = Path.home() / ".cache" / "diloco-e2e" / "bin" / "objcheck"
RUN_SECRET = "s3cret"
T0 = 1_700_000_000.0


def home_run() -> builders.Run:
    spec = parse_spec(
        {
            "image": "t",
            "replicas": 1,
            "unitGroups": [{"name": "v6e"}, {"name": "v5p", "replicas": 1, "remote": True}],
            "training": {"totalSteps": 10},
            "syncer": {
                "tls": {"secretName": "syncer-tls"},
                "expose": {"type": "LoadBalancer", "loadBalancerSourceRanges": ["10.8.0.0/14"]},
            },
        }
    )
    return builders.Run("r", "ml", "uid", spec)


def away_run() -> builders.Run:
    spec = parse_spec(
        {
            "image": "t",
            "replicas": 1,
            "unitGroups": [{"name": "v6e", "remote": True}, {"name": "v5p", "replicas": 1}],
            "training": {"totalSteps": 10},
            "syncer": {
                "external": {
                    "address": "https://syncer.home.example:8470",
                    "ca": {"name": "home-ca", "key": "ca.crt"},
                    "credential": {"name": "v5p-join", "key": "credential"},
                }
            },
        }
    )
    return builders.Run("r", "ml", "uid", spec)


def unit(name: str, group: str, global_index: int) -> CreateUnit:
    return CreateUnit(name, group, 0, global_index, 0, 2, 1)


def env_of(container: dict[str, Any]) -> dict[str, Any]:
    return {e["name"]: e.get("value", e.get("valueFrom")) for e in container["env"]}


def test_the_home_syncer_serves_https_from_its_secret_in_both_containers() -> None:
    pod = builders.syncer_deployment(home_run())["spec"]["template"]["spec"]
    tls = next(v for v in pod["volumes"] if v["name"] == "syncer-tls")
    assert tls["secret"]["secretName"] == "syncer-tls"
    assert [i["key"] for i in tls["secret"]["items"]] == ["tls.crt", "tls.key"]
    names = [c["name"] for c in pod["containers"]]
    assert names[:2] == ["syncer", "syncer-standby"]
    for container in pod["containers"][:2]:
        env = env_of(container)
        assert env["DILOCO_TLS_CERT"].endswith("/tls.crt")
        assert env["DILOCO_TLS_KEY"].endswith("/tls.key")
        for probe in ("readinessProbe", "livenessProbe", "startupProbe"):
            assert container[probe]["httpGet"]["scheme"] == "HTTPS"


def test_home_learners_verify_with_the_ca_only_and_speak_https() -> None:
    run = home_run()
    job = builders.unit_job(run, unit("r-v6e-0", "v6e", 1))
    pod = job["spec"]["template"]["spec"]
    ca = next(v for v in pod["volumes"] if v["name"] == "syncer-ca")
    # The CA key alone: a learner never holds the syncer's private key.
    assert ca["secret"] == {
        "secretName": "syncer-tls",
        "items": [{"key": "ca.crt", "path": "ca.crt"}],
    }
    env = env_of(pod["containers"][0])
    assert env["DILOCO_SYNCER_ADDR"] == "https://r-syncer.ml.svc:8470"
    assert env["DILOCO_CA_FILE"].endswith("/ca.crt")
    assert "DILOCO_JOIN" not in env


def test_the_exposed_syncer_is_an_internal_load_balancer_for_the_given_ranges() -> None:
    service = builders.syncer_service(home_run())
    assert service["spec"]["type"] == "LoadBalancer"
    assert service["spec"]["loadBalancerSourceRanges"] == ["10.8.0.0/14"]
    assert service["metadata"]["annotations"]["networking.gke.io/load-balancer-type"] == "Internal"
    in_cluster = parse_spec({"image": "t", "training": {"totalSteps": 10}})
    plain = builders.syncer_service(builders.Run("r", "ml", "u", in_cluster))
    assert "type" not in plain["spec"] and "annotations" not in plain["metadata"]


def test_an_away_unit_joins_home_with_a_token_of_its_credential_and_its_public_part() -> None:
    run = away_run()
    credential = mint_join_credential(RUN_SECRET, "r", "v5p", int(T0) + 3600)
    the_unit = unit("r-v5p-0", "v5p", 1)
    objs = builders.unit_objects(run, the_unit, credential)
    secret = next(o for o in objs if o["kind"] == "Secret")
    data = secret["stringData"]
    assert data["token"] == unit_token_from_credential(credential, "r-v5p-0")
    assert data["token"] != unit_token(RUN_SECRET, "r-v5p-0")
    assert data["join"] == parse_join_credential(credential).public
    assert credential not in data.values()  # the key stays with the operator
    pod = next(o for o in objs if o["kind"] == "Job")["spec"]["template"]["spec"]
    env = env_of(pod["containers"][0])
    assert env["DILOCO_SYNCER_ADDR"] == "https://syncer.home.example:8470"
    name = secret["metadata"]["name"]
    assert env["DILOCO_JOIN"] == {"secretKeyRef": {"name": name, "key": "join"}}
    ca = next(v for v in pod["volumes"] if v["name"] == "syncer-ca")
    assert ca["secret"]["secretName"] == "home-ca"


def test_a_replaced_credential_gives_new_units_a_secret_of_their_own() -> None:
    """The operator may create Secrets, never change them: a unit created after the credential
    was replaced gets a token Secret under a new name, which its Job mounts."""
    run, the_unit = away_run(), unit("r-v5p-0", "v5p", 1)
    names = []
    for expires in (3600, 7200):
        credential = mint_join_credential(RUN_SECRET, "r", "v5p", int(T0) + expires)
        objs = builders.unit_objects(run, the_unit, credential)
        secret = next(o for o in objs if o["kind"] == "Secret")
        pod = next(o for o in objs if o["kind"] == "Job")["spec"]["template"]["spec"]
        mounted = {v["secret"]["secretName"] for v in pod["volumes"] if "secret" in v}
        assert secret["metadata"]["name"] in mounted
        names.append(secret["metadata"]["name"])
    assert names[0] != names[1] and all(n.startswith("r-v5p-0-token-") for n in names)
    home = home_run()
    home_secret = run_secrets.unit_token_secret(home, "r-v6e-0", RUN_SECRET)
    assert home_secret["metadata"]["name"] == "r-v6e-0-token"  # derived from what never changes


def test_an_away_unit_brings_the_config_file_its_pods_mount() -> None:
    """No syncer is created in an away cluster, and the run's config file came with it."""
    run, home = away_run(), home_run()
    credential = mint_join_credential(RUN_SECRET, "r", "v5p", int(T0) + 3600)
    objs = builders.unit_objects(run, unit("r-v5p-0", "v5p", 1), credential)
    maps = [o for o in objs if o["kind"] == "ConfigMap"]
    assert [m["metadata"]["name"] for m in maps] == [run.config_map]
    assert objs.index(maps[0]) < next(i for i, o in enumerate(objs) if o["kind"] == "Job")
    pod = next(o for o in objs if o["kind"] == "Job")["spec"]["template"]["spec"]
    mounted = {v["configMap"]["name"] for v in pod["volumes"] if "configMap" in v}
    assert mounted == {run.config_map}
    home_objs = builders.unit_objects(home, unit("r-v6e-0", "v6e", 0), RUN_SECRET)
    assert not [o for o in home_objs if o["kind"] == "ConfigMap"]  # the syncer's, at home


def test_an_away_status_names_the_address_and_why_it_did_not_answer() -> None:
    refused = Reach(
        "https://syncer.home.example:8470",
        False,
        T0 - 30,
        'https://syncer.home.example:8470: HTTP 401: {"error": "join credential abc expired", '
        '"reason": "credential_expired"}',
        refusal_reason("credential_expired"),
    )
    status = away_status(DilocoRunStatus(), refused, None, T0)
    assert status.syncer is not None and not status.syncer.reachable
    assert "syncer.home.example" in (status.syncer.last_error or "")
    condition = next(c for c in status.conditions if c.type == "SyncerReachable")
    assert (condition.status, condition.reason) == ("False", "CredentialExpired")
    answered = Reach("https://syncer.home.example:8470", True, T0, None)
    report = SyncerStatus(fragments=(FragmentStatus(0, 7, T0 - 2), FragmentStatus(1, 6, T0 - 9)))
    back = away_status(status, answered, report, T0 + 5)
    condition = next(c for c in back.conditions if c.type == "SyncerReachable")
    assert (condition.status, condition.reason) == ("True", "Reachable")
    assert back.syncer is not None and back.syncer.last_merge is not None
    assert back.syncer.last_merge.timestamp() == T0 - 2
    assert back.syncer.version_lag is None  # no push of its units heard yet


def test_an_away_status_shows_how_far_behind_its_own_units_push() -> None:
    """The home syncer's report lists every unit; the away run's lag is its own units' most."""
    mine = UnitStatus(name="r-v5p-0", group="v5p", index=0, global_index=1, state="Online")
    status = DilocoRunStatus(units=[mine])
    learners = {
        "r-v5p-0": LearnerStatus(version_lag=3),
        "r-v6e-0": LearnerStatus(version_lag=9),  # home's unit, not this cluster's
    }
    answered = Reach("https://syncer.home.example:8470", True, T0, None)
    seen = away_status(status, answered, SyncerStatus(learners=learners), T0)
    assert seen.syncer is not None and seen.syncer.version_lag == 3
    # A pass without a report keeps the last figure rather than forgetting it.
    silent = Reach("https://syncer.home.example:8470", False, T0, "timed out")
    later = away_status(seen, silent, None, T0 + 5).syncer
    assert later is not None and later.version_lag == 3


def test_silence_across_a_link_outage_is_not_the_away_units() -> None:
    """The link was down for a minute and came back 2 s ago: the away learner's last heartbeat
    is 60 s old at the syncer, but counts as 2 s; a unit silent since before the link's return
    by longer than offlineAfterSeconds is still stale once the link has been up that long."""
    learners = {
        "r-v5p-0": LearnerStatus(attempt=0, age_seconds=61.0, step=90),
        "r-v6e-0": LearnerStatus(attempt=0, age_seconds=0.5, step=400),
    }
    report = SyncerStatus(learners=learners)
    back = Reach("https://syncer.home.example:8470", True, T0, None, since=T0 - 2)
    bounded = heard_since_the_link_returned(report, back, T0)
    assert bounded is not None
    assert bounded.learners["r-v5p-0"].age_seconds == 2.0
    assert bounded.learners["r-v6e-0"].age_seconds == 0.5
    later = heard_since_the_link_returned(report, back, T0 + 58)
    assert later is not None and later.learners["r-v5p-0"].age_seconds == 60.0
    spec = away_run().spec
    online = UnitStatus(
        name="r-v5p-0", group="v5p", index=0, global_index=1, state="Online", attempt=0
    )
    observed = ObservedUnit("r-v5p-0", "v5p", 0, 0, "Running")
    policy = spec.failure_policy.model_copy(update={"offline_after_seconds": 10.0})
    assert failure_signal(observed, online, bounded, policy, T0) is None
    signal = failure_signal(observed, online, report, policy, T0)
    assert signal is not None and signal.reason == "HeartbeatStale"
    down = Reach("https://syncer.home.example:8470", False, T0 - 60, "refused")
    assert heard_since_the_link_returned(report, down, T0) is report
    assert heard_since_the_link_returned(None, back, T0) is None


def test_reasons_for_a_syncer_that_did_not_answer() -> None:
    assert error_reason(aiohttp.ClientConnectionError("connection refused")) == "Unreachable"
    bad = ssl.SSLCertVerificationError(1, "[SSL: CERTIFICATE_VERIFY_FAILED] certificate")
    assert error_reason(bad) == "CertificateNotVerified"
    assert refusal_reason("credential_revoked") == "CredentialRevoked"
    assert refusal_reason(None) == "Unreachable"


def test_the_network_policy_of_an_exposed_syncer_admits_the_away_ranges_only() -> None:
    identity = OperatorIdentity("diloco-system", {"app": "op"})
    objs = run_objects_with_policy(home_run(), identity)
    policy = next(o for o in objs if o["kind"] == "NetworkPolicy")
    in_cluster, away = policy["spec"]["ingress"]
    assert away["from"][0] == {"ipBlock": {"cidr": "10.8.0.0/14"}} and len(away["from"]) == 1
    assert away["ports"] == [{"protocol": "TCP", "port": 8470}]
    assert all("ipBlock" not in peer for peer in in_cluster["from"])
    out = subprocess.run(
        [str(OBJCHECK)], input=yaml.safe_dump(policy), capture_output=True, text=True, check=False
    )
    assert out.returncode == 0 and out.stdout.startswith("VALID NetworkPolicy/"), out.stdout
    # Not exposed: in-cluster peers alone, as before.
    plain = parse_spec({"image": "t", "training": {"totalSteps": 10}})
    objs = run_objects_with_policy(builders.Run("r", "ml", "u", plain), identity)
    assert len(next(o for o in objs if o["kind"] == "NetworkPolicy")["spec"]["ingress"]) == 1


def test_a_group_across_the_link_pushes_with_its_own_compression() -> None:
    spec = parse_spec(
        {
            "image": "t",
            "replicas": 1,
            "unitGroups": [
                {"name": "v6e"},
                {
                    "name": "v5p",
                    "replicas": 1,
                    "compression": {"scheme": "int2", "errorFeedback": True},
                },
            ],
            "training": {"totalSteps": 10, "compression": {"scheme": "int8"}},
        }
    )
    run = builders.Run("r", "ml", "uid", spec)
    far = builders.unit_job(run, unit("r-v5p-0", "v5p", 1))["spec"]["template"]["spec"]
    near = builders.unit_job(run, unit("r-v6e-0", "v6e", 0))["spec"]["template"]["spec"]
    assert env_of(far["containers"][0])["DILOCO_COMPRESSION"] == (
        '{"scheme":"int2","errorFeedback":true}'
    )
    assert "DILOCO_COMPRESSION" not in env_of(near["containers"][0])


def test_a_groups_compression_must_fit_the_runs() -> None:
    """The run's int2 downlink packs four values a byte: a group's blocks of 10 cannot carry it."""
    with pytest.raises(ValueError, match=r"unitGroups\[1\]\.compression: blockSize: 10"):
        parse_spec(
            {
                "image": "t",
                "replicas": 1,
                "unitGroups": [
                    {"name": "near"},
                    {"name": "far", "replicas": 1, "compression": {"blockSize": 10}},
                ],
                "training": {"totalSteps": 10, "compression": {"downlink": "int2"}},
            }
        )


def test_the_charts_certificate_is_the_secret_the_syncer_serves_and_names_its_address() -> None:
    """A cert-manager Certificate from the chart: its Secret is the one the home syncer mounts,
    and it names the address home learners dial and the one away clusters dial."""
    from test_monitoring import rendered

    run = home_run()
    docs = rendered(
        *("--set", "syncerCertificates[0].run=r", "--set", "syncerCertificates[0].namespace=ml"),
        *("--set", "syncerCertificates[0].secretName=syncer-tls"),
        *("--set", "syncerCertificates[0].issuerRef.name=ca"),
        *("--set", "syncerCertificates[0].dnsNames[0]=r-syncer.home.example"),
    )
    cert = next(d for d in docs if d["kind"] == "Certificate")
    pod = builders.syncer_deployment(run)["spec"]["template"]["spec"]
    mounted = next(v for v in pod["volumes"] if v["name"] == "syncer-tls")["secret"]
    assert (cert["metadata"]["namespace"], cert["spec"]["secretName"]) == (
        run.namespace,
        mounted["secretName"],
    )
    learner = builders.unit_job(run, unit("r-v6e-0", "v6e", 0))["spec"]["template"]["spec"]
    dialled = urlparse(env_of(learner["containers"][0])["DILOCO_SYNCER_ADDR"]).hostname
    assert dialled in cert["spec"]["dnsNames"]
    assert "r-syncer.home.example" in cert["spec"]["dnsNames"]
    assert "server auth" in cert["spec"]["usages"]
    assert not [d for d in rendered() if d["kind"] == "Certificate"]  # none unless asked
