"""gpu-npd's one name domain: every label, annotation and taint key it writes lives under it, so its keys
never collide with another component's (the NVIDIA DRA driver's are under gpu.nvidia.com)."""

DOMAIN = "gpu-npd.io"


def key(name: str) -> str:
    """`scenario` -> `gpu-npd.io/scenario`."""
    return f"{DOMAIN}/{name}"
