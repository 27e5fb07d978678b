"""HTTPS for the emulator: a throwaway certificate authority (made with `trustme`) and a serving
certificate for the loopback names, so kubectl and client-go verify the server as they would a
real cluster's (the kubeconfig carries the CA as certificate-authority-data). Nothing is written to
disk unless asked: the CA lives as long as the emulator.
"""

from __future__ import annotations

import ssl
from pathlib import Path
from typing import Iterable

LOOPBACK_NAMES = ("127.0.0.1", "localhost", "::1")


class ServerTls:
    """A new CA and a certificate it signed for `hosts` (names or IP addresses) plus the loopback names."""

    def __init__(self, hosts: Iterable[str] = ()):
        try:
            import trustme
        except ImportError:   # a test dependency (pyproject's [test] extra), not a runtime one
            raise RuntimeError("HTTPS needs the trustme package: pip install trustme "
                               "(or pip install 'gpu-npd[test]')") from None
        names = list(dict.fromkeys([*(h.strip("[]") for h in hosts if h), *LOOPBACK_NAMES]))
        names = [n for n in names if n not in ("0.0.0.0", "::")]   # wildcard binds are no certificate names
        self._ca = trustme.CA(organization_name="kube-emulator")
        self._cert = self._ca.issue_cert(*names)
        self.names = tuple(names)

    @property
    def ca_pem(self) -> bytes:
        """The CA certificate (PEM): what a client trusts."""
        return self._ca.cert_pem.bytes()

    def write_ca(self, path: Path | str) -> Path:
        path = Path(path)
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_bytes(self.ca_pem)
        return path

    def server_context(self) -> ssl.SSLContext:
        context = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
        context.minimum_version = ssl.TLSVersion.TLSv1_2
        self._cert.configure_cert(context)
        context.set_alpn_protocols(["http/1.1"])   # no HTTP/2: Go clients then speak HTTP/1.1, as they do to any such server
        return context
