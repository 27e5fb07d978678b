"""gpu-npd: a GPU node problem detector for Kubernetes."""

__version__ = "0.1.0"
