"""An in-process Kubernetes API server (core/v1 Nodes and Events) for tests, demos and load
benchmarks: real HTTP on loopback, real RBAC from the project's manifests, injectable faults."""

from kube_emulator.emulator import Emulator

__all__ = ["Emulator"]
