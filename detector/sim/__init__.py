"""The fleet simulator: many fake GPU nodes, one process."""
