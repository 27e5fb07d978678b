"""Who is calling (bearer tokens) and what they may do (Kubernetes RBAC from the project's YAML).

Loading the real manifests means a test that passes here also passes against a cluster that was
given the same manifests: a missing verb in deploy/ shows up as the same 403 Kubernetes returns.
"""

from __future__ import annotations

import secrets
import threading
from dataclasses import dataclass, field
from importlib import resources
from pathlib import Path
from typing import Any, Iterable, Sequence

import yaml

MASTERS = "system:masters"
AUTHENTICATED = "system:authenticated"
ADMIN = "admin"
SA_PREFIX = "system:serviceaccount:"
RBAC_KINDS = ("ClusterRole", "ClusterRoleBinding", "Role", "RoleBinding")


@dataclass(frozen=True)
class User:
    name: str
    groups: tuple[str, ...] = ()


def default_groups(name: str) -> tuple[str, ...]:
    """The groups Kubernetes' authenticators put a user of this name in."""
    if name == ADMIN:
        return MASTERS, AUTHENTICATED
    if name.startswith(SA_PREFIX):
        namespace = name[len(SA_PREFIX):].split(":", 1)[0]
        return "system:serviceaccounts", f"system:serviceaccounts:{namespace}", AUTHENTICATED
    return (AUTHENTICATED,)


class Tokens:
    """Bearer tokens issued by one emulator; one token per user, stable for the emulator's life."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._by_token: dict[str, User] = {}
        self._by_user: dict[str, str] = {}

    def issue(self, name: str, groups: Sequence[str] | None = None) -> str:
        if not name:
            raise ValueError("a user needs a name")
        with self._lock:
            token = self._by_user.get(name)
            if token is None:
                token = secrets.token_urlsafe(24)
                self._by_user[name] = token
            self._by_token[token] = User(name, tuple(groups) if groups is not None else default_groups(name))
            return token

    def user(self, token: str | None) -> User | None:
        if not token:
            return None
        with self._lock:
            return self._by_token.get(token)


@dataclass(frozen=True)
class Attributes:
    """One request as the authorizer sees it; `path` is set for non-resource requests only."""

    user: User
    verb: str
    resource: str = ""
    subresource: str = ""
    namespace: str = ""
    name: str = ""
    api_group: str = ""
    path: str = ""

    @property
    def combined_resource(self) -> str:
        return f"{self.resource}/{self.subresource}" if self.subresource else self.resource


@dataclass(frozen=True)
class Rule:
    verbs: frozenset[str]
    api_groups: frozenset[str]
    resources: frozenset[str]
    resource_names: frozenset[str]
    non_resource_urls: frozenset[str]

    @classmethod
    def parse(cls, raw: dict[str, Any]) -> "Rule":
        def strings(key: str) -> frozenset[str]:
            return frozenset(str(v) for v in (raw.get(key) or []))
        return cls(strings("verbs"), strings("apiGroups"), strings("resources"), strings("resourceNames"),
                   strings("nonResourceURLs"))

    def allows(self, a: Attributes) -> bool:
        if "*" not in self.verbs and a.verb not in self.verbs:
            return False
        if a.path:
            return any(u == "*" or u == a.path or (u.endswith("*") and a.path.startswith(u[:-1]))
                       for u in self.non_resource_urls)
        if "*" not in self.api_groups and a.api_group not in self.api_groups:
            return False
        if not self._resource_matches(a):
            return False
        return not self.resource_names or a.name in self.resource_names

    def _resource_matches(self, a: Attributes) -> bool:
        combined = a.combined_resource
        for r in self.resources:
            if r == "*" or r == combined:
                return True
            if a.subresource and r == f"*/{a.subresource}":
                return True
        return False


@dataclass(frozen=True)
class Subject:
    kind: str
    name: str
    namespace: str = ""

    def matches(self, user: User) -> bool:
        if self.kind == "User":
            return user.name == self.name
        if self.kind == "Group":
            return self.name in user.groups
        if self.kind == "ServiceAccount":
            return user.name == f"{SA_PREFIX}{self.namespace}:{self.name}"
        return False


@dataclass(frozen=True)
class Binding:
    name: str
    namespace: str          # "" for a ClusterRoleBinding
    role_kind: str          # Role or ClusterRole
    role_name: str
    subjects: tuple[Subject, ...]


@dataclass
class Policy:
    """Roles and bindings, as Kubernetes' RBAC authorizer holds them."""

    cluster_roles: dict[str, tuple[Rule, ...]] = field(default_factory=dict)
    roles: dict[tuple[str, str], tuple[Rule, ...]] = field(default_factory=dict)
    bindings: list[Binding] = field(default_factory=list)

    def add(self, doc: dict[str, Any], source: str) -> None:
        kind, meta = doc.get("kind"), doc.get("metadata") or {}
        name, namespace = str(meta.get("name") or ""), str(meta.get("namespace") or "default")
        if not name:
            raise ValueError(f"{source}: {kind} without metadata.name")
        if kind in ("ClusterRole", "Role"):
            rules = tuple(Rule.parse(r) for r in doc.get("rules") or [])
            if kind == "ClusterRole":
                self.cluster_roles[name] = rules
            else:
                self.roles[(namespace, name)] = rules
            return
        ref = doc.get("roleRef") or {}
        if ref.get("kind") not in ("Role", "ClusterRole") or not ref.get("name"):
            raise ValueError(f"{source}: {kind} {name!r} needs roleRef kind Role or ClusterRole and a name")
        if kind == "ClusterRoleBinding" and ref["kind"] == "Role":
            raise ValueError(f"{source}: ClusterRoleBinding {name!r} cannot refer to a Role")
        bind_ns = namespace if kind == "RoleBinding" else ""
        subjects = tuple(Subject(str(s.get("kind", "")), str(s.get("name", "")),
                                 str(s.get("namespace") or bind_ns)) for s in doc.get("subjects") or [])
        self.bindings.append(Binding(name, bind_ns, ref["kind"], str(ref["name"]), subjects))


def packaged_deploy_dir() -> Path:
    """The RBAC of the repository's deploy/ directory as packaged with gpu-npd: `base/rbac.yaml` (the
    DaemonSet's) and `kwok/rbac.yaml` (the fleet simulator's), byte for byte the same files (a test keeps
    them so). With it the emulator enforces the deployed RBAC from any directory and from an installed
    package, where there is no deploy/ directory."""
    return Path(str(resources.files("kube_emulator") / "deploy"))


def deploy_rbac(part: str = "base", deploy_dir: Path | None = None) -> Path:
    """The RBAC directory `deploy/<part>` (`base`, `kwok` or `overlays/dra-taints`): under `deploy_dir` (a checkout's deploy/)
    when given, else the packaged copy."""
    return Path(deploy_dir if deploy_dir is not None else packaged_deploy_dir()) / part


def load_policy(paths: Iterable[Path]) -> Policy:
    """Every RBAC document in the YAML files given, or in the *.yaml/*.yml files of the directories given."""
    policy = Policy()
    for path in paths:
        path = Path(path)
        if path.is_dir():
            files = sorted(p for p in path.iterdir() if p.suffix in (".yaml", ".yml"))
        elif path.is_file():
            files = [path]
        else:
            raise FileNotFoundError(f"RBAC path not found: {path}")
        for file in files:
            if file.name in ("kustomization.yaml", "kustomization.yml"):
                continue
            try:
                docs = list(yaml.safe_load_all(file.read_text()))
            except yaml.YAMLError as e:
                raise ValueError(f"{file}: not valid YAML: {e}") from None
            for doc in _flatten(docs):
                if doc.get("kind") in RBAC_KINDS:
                    policy.add(doc, str(file))
    return policy


def _flatten(docs: Iterable[Any]) -> Iterable[dict[str, Any]]:
    for doc in docs:
        if isinstance(doc, dict) and doc.get("kind") == "List":
            yield from _flatten(doc.get("items") or [])
        elif isinstance(doc, dict):
            yield doc


class Authorizer:
    """Kubernetes' RBAC authorizer, plus the system:masters bypass and open discovery endpoints."""

    def __init__(self, policy: Policy):
        self.policy = policy

    def authorize(self, a: Attributes) -> tuple[bool, str]:
        """(allowed, reason); the reason names roles that bindings refer to but that do not exist."""
        if MASTERS in a.user.groups:
            return True, ""
        if a.path:
            return True, ""  # discovery and health, open to every authenticated user as system:discovery is
        errors: list[str] = []
        for binding in self.policy.bindings:
            if binding.namespace and binding.namespace != a.namespace:
                continue
            if not any(s.matches(a.user) for s in binding.subjects):
                continue
            rules = self._rules(binding)
            if rules is None:
                what = "clusterrole" if binding.role_kind == "ClusterRole" else "role"
                errors.append(f'{what}.rbac.authorization.k8s.io "{binding.role_name}" not found')
                continue
            if any(rule.allows(a) for rule in rules):
                return True, ""
        return False, ("RBAC: " + ", ".join(errors)) if errors else ""

    def _rules(self, binding: Binding) -> tuple[Rule, ...] | None:
        if binding.role_kind == "ClusterRole":
            return self.policy.cluster_roles.get(binding.role_name)
        return self.policy.roles.get((binding.namespace, binding.role_name))


def forbidden_message(a: Attributes, reason: str = "") -> str:
    """The message of Kubernetes' 403, word for word."""
    if a.path:
        message = f'User "{a.user.name}" cannot {a.verb} path "{a.path}"'
    elif a.namespace:
        message = (f'User "{a.user.name}" cannot {a.verb} resource "{a.combined_resource}" in API group '
                   f'"{a.api_group}" in the namespace "{a.namespace}"')
    else:
        message = (f'User "{a.user.name}" cannot {a.verb} resource "{a.combined_resource}" in API group '
                   f'"{a.api_group}" at the cluster scope')
    if reason:
        message = f"{message}: {reason}"
    if a.path:
        return f"forbidden: {message}"
    qualified = f"{a.resource}.{a.api_group}" if a.api_group else a.resource
    return f'{qualified} "{a.name}" is forbidden: {message}' if a.name else f"{qualified} is forbidden: {message}"
