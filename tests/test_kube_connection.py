"""Finding the API server: kubeconfig files and the in-cluster service account."""

from __future__ import annotations

import base64
from pathlib import Path

import pytest
import yaml

from detector.kube.api import ApiError, KubeApi
from detector.kube.connection import ConfigError, from_kubeconfig, in_cluster
from kube_emulator import Emulator
from detector.daemon.local import REPO_DEPLOY


def kubeconfig(tmp_path: Path, user: dict, cluster: dict | None = None) -> Path:
    doc = {"apiVersion": "v1", "kind": "Config", "current-context": "c",
           "contexts": [{"name": "c", "context": {"cluster": "k", "user": "u"}}],
           "clusters": [{"name": "k", "cluster": cluster or {"server": "https://10.0.0.1:6443/"}}],
           "users": [{"name": "u", "user": user}]}
    path = tmp_path / "kubeconfig"
    path.write_text(yaml.safe_dump(doc))
    return path


def test_token_ca_data_and_relative_files(tmp_path):
    pem = b"-----BEGIN CERTIFICATE-----\nMIIB\n-----END CERTIFICATE-----\n"
    path = kubeconfig(tmp_path, {"tokenFile": "tok", "client-certificate": "c.pem", "client-key": "/abs/k.pem"},
                      {"server": "https://10.0.0.1:6443/", "certificate-authority-data": base64.b64encode(pem).decode()})
    (tmp_path / "tok").write_text("secret\n")
    c = from_kubeconfig(path)
    assert c.server == "https://10.0.0.1:6443" and c.bearer() == "secret"
    assert Path(c.ca_file).read_bytes() == pem
    assert c.cert_file == str(tmp_path / "c.pem") and c.key_file == "/abs/k.pem"
    (tmp_path / "tok").write_text("rotated")
    assert c.bearer() == "rotated"                       # projected tokens rotate: read each time


@pytest.mark.parametrize("user, cluster, expected", [
    ({"exec": {"command": "aws"}}, None, "exec plugin"),
    ({"token": "t"}, {"insecure-skip-tls-verify": True}, "has no server"),
])
def test_unusable_kubeconfigs_say_why(tmp_path, user, cluster, expected):
    with pytest.raises(ConfigError, match=expected):
        from_kubeconfig(kubeconfig(tmp_path, user, cluster))


def test_missing_context_and_unreadable_file(tmp_path):
    path = tmp_path / "k"
    path.write_text("current-context: nope\ncontexts: []\n")
    with pytest.raises(ConfigError, match="no context named 'nope'"):
        from_kubeconfig(path)
    with pytest.raises(ConfigError, match="cannot read"):
        from_kubeconfig(tmp_path / "absent")


def test_in_cluster(tmp_path, monkeypatch):
    monkeypatch.delenv("KUBERNETES_SERVICE_HOST", raising=False)
    with pytest.raises(ConfigError, match="not running in a pod"):
        in_cluster(tmp_path)
    (tmp_path / "token").write_text("sa-token")
    monkeypatch.setenv("KUBERNETES_SERVICE_HOST", "fd00::1")
    monkeypatch.setenv("KUBERNETES_SERVICE_PORT", "443")
    c = in_cluster(tmp_path)
    assert c.server == "https://[fd00::1]:443" and c.bearer() == "sa-token"
    assert c.ca_file == str(tmp_path / "ca.crt")


def test_calls_reach_the_emulator_and_errors_are_specific(tmp_path):
    with Emulator(rbac_paths=(REPO_DEPLOY,)) as emu:
        emu.create_node("n1")
        api = KubeApi.from_kubeconfig(str(emu.write_kubeconfig(tmp_path / "kc")))
        assert api.get_node("n1")["metadata"]["name"] == "n1"
        with pytest.raises(ApiError) as e:
            api.get_node("absent")
        assert e.value.status == 404 and not e.value.retryable
        emu.fail(429, count=1, retry_after=7)
        with pytest.raises(ApiError) as e:
            api.get_node("n1")
        assert e.value.status == 429 and e.value.retry_after_s == 7.0 and e.value.retryable
        emu.down()
        with pytest.raises(ApiError) as e:
            api.get_node("n1")
        assert e.value.status == 0 and e.value.retryable
        assert api.counts.counts[("get", "nodes", "200")] == 1
        assert api.counts.counts[("get", "nodes", "error")] == 1
