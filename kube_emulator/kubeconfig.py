"""Kubeconfig files that reach an emulator: one cluster (with the CA's certificate when it serves
HTTPS), and one user and one context per identity, each user holding its bearer token.

Context names are the identities without the service-account prefix: `admin`, `gpu-npd:gpu-npd`
(for system:serviceaccount:gpu-npd:gpu-npd), so `kubectl --context admin ...` switches identity.
Contexts name no namespace: every resource the daemon touches is cluster-scoped or names its own,
and kubectl warns about a context namespace on cluster-scoped resources (`auth can-i patch nodes`).
"""

from __future__ import annotations

import base64
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Sequence

import yaml

from kube_emulator.rbac import SA_PREFIX

CLUSTER = "kube-emulator"


@dataclass(frozen=True)
class Identity:
    user: str       # "admin", "system:serviceaccount:<namespace>:<name>", or any user name
    token: str

    @property
    def context(self) -> str:
        return self.user[len(SA_PREFIX):] if self.user.startswith(SA_PREFIX) else self.user


def build_kubeconfig(server: str, identities: Sequence[Identity], ca_pem: bytes | None = None) -> dict[str, Any]:
    """The kubeconfig document; the first identity's context is the current one."""
    if not identities:
        raise ValueError("a kubeconfig needs at least one identity")
    cluster: dict[str, Any] = {"server": server}
    if ca_pem is not None:
        cluster["certificate-authority-data"] = base64.b64encode(ca_pem).decode()
    contexts = []
    for identity in identities:
        contexts.append({"name": identity.context, "context": {"cluster": CLUSTER, "user": identity.user}})
    return {
        "apiVersion": "v1", "kind": "Config", "preferences": {},
        "clusters": [{"name": CLUSTER, "cluster": cluster}],
        "users": [{"name": i.user, "user": {"token": i.token}} for i in identities],
        "contexts": contexts,
        "current-context": identities[0].context,
    }


def write_kubeconfig(path: Path | str, config: dict[str, Any]) -> Path:
    """Write a kubeconfig with mode 0600 (it holds tokens)."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "w") as f:
        yaml.safe_dump(config, f, sort_keys=False)
    os.chmod(path, 0o600)   # an existing file keeps its mode through O_CREAT
    return path
