"""Where the API server is and who we are: in-cluster service account or a kubeconfig file.

gpu-npd makes four kinds of request, so it speaks HTTP through urllib3 instead of the official
client, whose generated models cost about 35 MiB of memory just to import: more than half of the
daemon's 60 MiB budget. Supported kubeconfig credentials: bearer token (inline or tokenFile) and
client certificates, with the cluster's CA or insecure-skip-tls-verify. exec and auth-provider
plugins are refused with a clear message: on a node, the in-cluster service account is the way.
"""

from __future__ import annotations

import base64
import os
import ssl
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import urllib3
import yaml

SERVICE_ACCOUNT_DIR = Path("/var/run/secrets/kubernetes.io/serviceaccount")


class ConfigError(Exception):
    """No usable API server configuration; the message says what to do."""


@dataclass(frozen=True)
class Connection:
    server: str                            # https://host:port or http://127.0.0.1:port
    token: str | None = None
    token_file: Path | None = None         # re-read on each request: projected tokens rotate
    ca_file: str | None = None
    cert_file: str | None = None
    key_file: str | None = None
    insecure: bool = False

    def bearer(self) -> str | None:
        if self.token_file is not None:
            try:
                return self.token_file.read_text().strip()
            except OSError:
                return self.token
        return self.token

    def pool(self, maxsize: int = 4) -> urllib3.PoolManager:
        """A connection pool; the caller's own backoff does the retrying."""
        kwargs: dict[str, Any] = {"maxsize": maxsize, "retries": False, "block": False}
        if self.server.startswith("https"):
            kwargs["cert_reqs"] = ssl.CERT_NONE if self.insecure else ssl.CERT_REQUIRED
            if self.ca_file:
                kwargs["ca_certs"] = self.ca_file
            if self.cert_file:
                kwargs["cert_file"], kwargs["key_file"] = self.cert_file, self.key_file
        return urllib3.PoolManager(**kwargs)


def load_connection(kubeconfig: str | None, context: str | None = None) -> Connection:
    """A kubeconfig when given (its `context`, else its current one), else the pod's service account."""
    if context and not kubeconfig:
        raise ConfigError(f"--context {context}: contexts are a kubeconfig's, and none was given")
    return from_kubeconfig(Path(kubeconfig), context) if kubeconfig else in_cluster()


def user_kubeconfig(given: str | None = None, environ: dict[str, str] | None = None,
                    home: Path | None = None) -> str | None:
    """The kubeconfig a command run by a person uses, as kubectl finds it: the one given, else the first
    file $KUBECONFIG lists that exists, else ~/.kube/config if there is one; None: in-cluster."""
    env = os.environ if environ is None else environ
    if given:
        return given
    for entry in (env.get("KUBECONFIG") or "").split(os.pathsep):
        if entry and Path(entry).is_file():
            return entry
    default = (home or Path.home()) / ".kube" / "config"
    return str(default) if default.is_file() else None


def in_cluster(sa_dir: Path = SERVICE_ACCOUNT_DIR) -> Connection:
    host, port = os.environ.get("KUBERNETES_SERVICE_HOST"), os.environ.get("KUBERNETES_SERVICE_PORT", "443")
    token = sa_dir / "token"
    if not host or not token.exists():
        raise ConfigError("not running in a pod (no KUBERNETES_SERVICE_HOST or service-account token) and no "
                          "--kubeconfig given")
    host = f"[{host}]" if ":" in host else host
    return Connection(f"https://{host}:{port}", token_file=token, ca_file=str(sa_dir / "ca.crt"))


def from_kubeconfig(path: Path, context: str | None = None) -> Connection:
    try:
        doc = yaml.safe_load(path.read_text()) or {}
    except (OSError, yaml.YAMLError) as e:
        raise ConfigError(f"kubeconfig {path}: cannot read it: {e}") from None
    context_name = context or doc.get("current-context")
    context = _named(doc, "contexts", context_name, path).get("context") or {}
    cluster = _named(doc, "clusters", context.get("cluster"), path).get("cluster") or {}
    user = _named(doc, "users", context.get("user"), path).get("user") or {}
    if not cluster.get("server"):
        raise ConfigError(f"kubeconfig {path}: cluster {context.get('cluster')!r} has no server")
    for plugin in ("exec", "auth-provider"):
        if plugin in user:
            raise ConfigError(f"kubeconfig {path}: user {context.get('user')!r} authenticates through an {plugin} "
                              "plugin, which gpu-npd does not run; use a token, client certificates, or the "
                              "in-cluster service account")
    base = path.parent
    return Connection(
        server=cluster["server"].rstrip("/"),
        token=user.get("token"),
        token_file=_path(user.get("tokenFile"), base),
        ca_file=_material(cluster, "certificate-authority", base),
        cert_file=_material(user, "client-certificate", base),
        key_file=_material(user, "client-key", base),
        insecure=bool(cluster.get("insecure-skip-tls-verify")),
    )


def _named(doc: dict[str, Any], section: str, name: str | None, path: Path) -> dict[str, Any]:
    for item in doc.get(section) or []:
        if item.get("name") == name:
            return item
    known = ", ".join(str(item.get("name")) for item in doc.get(section) or []) or "none"
    raise ConfigError(f"kubeconfig {path}: no {section[:-1]} named {name!r} (current-context "
                      f"{doc.get('current-context')!r}; {section}: {known})")


def _path(value: str | None, base: Path) -> Path | None:
    return None if not value else (base / value if not os.path.isabs(value) else Path(value))


def _material(section: dict[str, Any], key: str, base: Path) -> str | None:
    """A file path, or inline `<key>-data` written to a private temporary file (ssl wants files)."""
    data = section.get(f"{key}-data")
    if data:
        fd, name = tempfile.mkstemp(prefix="gpu-npd-", suffix=".pem")
        with os.fdopen(fd, "wb") as f:
            f.write(base64.b64decode(data))
        return name
    found = _path(section.get(key), base)
    return str(found) if found else None
