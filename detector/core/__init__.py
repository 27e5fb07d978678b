"""The detector's core: observations, problems, checks, the sweep. Nothing here knows Kubernetes."""
