"""The operator command's flags for each job's NetworkPolicy: parsed into the peers it names, or
refused with a message naming the flag."""

from __future__ import annotations

import pytest
from liveshard_operator import main
from liveshard_operator.render import Isolation, IssuerRef


def isolation(monkeypatch: pytest.MonkeyPatch, *flags: str) -> Isolation | None:
    monkeypatch.delenv("POD_NAMESPACE", raising=False)
    monkeypatch.setattr(main, "SERVICE_ACCOUNT_NAMESPACE", main.Path("/nonexistent"))
    return main.isolation_of(main.parser().parse_args(["--all-namespaces", *flags]))


def test_the_operators_pods_named_make_a_policy_per_job(monkeypatch: pytest.MonkeyPatch) -> None:
    assert isolation(monkeypatch) is None  # outside a pod nothing names the operator
    named = isolation(monkeypatch, "--operator-pod-labels=app=op,tier=ctl",
                      "--operator-namespace=ops")  # fmt: skip
    assert named == Isolation("ops", {"app": "op", "tier": "ctl"}, [])
    monkeypatch.setenv("POD_NAMESPACE", "from-env")
    peers = '[{"namespaceSelector": {"matchLabels": {"name": "monitoring"}}}]'
    args = main.parser().parse_args(["--all-namespaces", "--operator-pod-labels=app=op",
                                     f"--job-metrics-from={peers}"])  # fmt: skip
    assert main.isolation_of(args) == Isolation(
        "from-env", {"app": "op"}, [{"namespaceSelector": {"matchLabels": {"name": "monitoring"}}}]
    )


@pytest.mark.parametrize(
    ("flags", "refusal"),
    [
        (["--operator-pod-labels=app", "--operator-namespace=ops"], "--operator-pod-labels"),
        (["--operator-pod-labels=app=op"], "needs --operator-namespace outside a pod"),
        (["--operator-pod-labels=a=b", "--operator-namespace=o", "--job-metrics-from={"],
         "--job-metrics-from: not JSON"),
        (["--operator-pod-labels=a=b", "--operator-namespace=o", "--job-metrics-from={}"],
         "a JSON list of NetworkPolicyPeer"),
        (["--cert-manager-issuer=corp-ca"], "--cert-manager-issuer: expected KIND/NAME"),
        (["--cert-manager-issuer=Issuer/a/b"], "--cert-manager-issuer: expected KIND/NAME"),
    ],
)  # fmt: skip
def test_malformed_flags_are_refused_naming_the_flag(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str], flags: list[str],
    refusal: str,
) -> None:  # fmt: skip
    monkeypatch.delenv("POD_NAMESPACE", raising=False)
    monkeypatch.setattr(main, "SERVICE_ACCOUNT_NAMESPACE", main.Path("/nonexistent"))
    monkeypatch.setattr(main.kopf, "run", lambda **_: pytest.fail("kopf ran"))
    with pytest.raises(SystemExit) as exited:
        main.main(["--all-namespaces", *flags])
    assert exited.value.code == 2
    assert refusal in capsys.readouterr().err


def test_a_users_issuer_is_named_by_kind_group_and_name(monkeypatch: pytest.MonkeyPatch) -> None:
    assert main.issuer_of(None) is None
    assert main.issuer_of("Issuer/corp") == IssuerRef("corp")
    assert main.issuer_of("ClusterIssuer/corp") == IssuerRef("corp", "ClusterIssuer")
    assert main.issuer_of("AWSPCAClusterIssuer.awspca.cert-manager.io/pca") == IssuerRef(
        "pca", "AWSPCAClusterIssuer", "awspca.cert-manager.io"
    )
    # The flag alone turns cert-manager on.
    monkeypatch.setattr(main.kopf, "run", lambda **_: None)
    monkeypatch.setattr(main.handlers, "OPTIONS", main.handlers.OPTIONS)  # put back after
    main.main(["--all-namespaces", "--metrics-port=0", "--cert-manager-issuer=ClusterIssuer/c"])
    options = main.handlers.OPTIONS
    assert options.cert_manager and options.cert_manager_issuer == IssuerRef("c", "ClusterIssuer")
