"""The `gpu-npd` command line."""
