"""Reporting to Kubernetes: node conditions, events, and a client that is gentle on the API server.
Knows nothing of GPUs: it sees condition statuses and problems."""
