"""Built-in checks, one module each. They join through the `gpu_npd.checks` entry points."""
