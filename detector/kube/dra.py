"""Which resource.k8s.io versions the cluster serves, and for which DRA resources: discovered, never assumed.

/apis/resource.k8s.io lists the served versions, preferred first; each version's APIResourceList says which
resources it serves. DRA's resources moved between versions (ResourceSlices at v1alpha3 in 1.31-1.32, v1beta1,
v1beta2 and v1 later; DeviceTaintRules only at v1alpha3 and v1beta2), so each resource takes the first
version serving it. Discovery needs no RBAC rule: every authenticated user may read it (system:discovery).
Shared by the node watch (ResourceSlices) and the DRA device taints (both).
"""

from __future__ import annotations

from dataclasses import dataclass, field

from detector.kube.api import ApiError, KubeApi
from detector.kube.shapes import objects, text

GROUP = "resource.k8s.io"


@dataclass(frozen=True)
class DraApi:
    versions: tuple[str, ...] = ()                          # served, preferred first; () when the group is not
    resources: dict[str, str] = field(default_factory=dict)  # resource -> the first version serving it

    def version_of(self, resource: str) -> str | None:
        return self.resources.get(resource)


def discover(api: KubeApi) -> DraApi:
    """The cluster's resource.k8s.io versions and resources. A group or version not served (404) is left
    out; any other failure raises ApiError (the caller retries)."""
    try:
        group = api.get_api_group(GROUP)
    except ApiError as e:
        if e.status != 404:
            raise
        group = {}
    versions = tuple(v for v in (text(g.get("version")) for g in objects(group.get("versions"))) if v)
    resources: dict[str, str] = {}
    for version in versions:
        try:
            served = objects(api.get_api_resources(GROUP, version).get("resources"))
        except ApiError as e:
            if e.status == 404:
                continue
            raise
        for r in served:
            name = text(r.get("name"))
            if name and "/" not in name:
                resources.setdefault(name, version)
    return DraApi(versions, resources)
