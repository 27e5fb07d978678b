"""What an NVML stand-in (the fake node's, a replayed capture's) serves for the names it does not define
itself, so that it can be called exactly as the `pynvml` module is."""

from __future__ import annotations

from typing import Any

import pynvml

# pynvml functions that are plain Python (no driver call): served as they are.
_PURE_HELPERS = frozenset({"nvmlExceptionClass", "nvmlStructToFriendlyObject", "nvmlFriendlyObjectToStruct"})


def from_pynvml(name: str, unimplemented: int) -> Any:
    """A name a stand-in does not define: pynvml's constant, error class or helper as it is; an NVML
    function the stand-in does not implement raises `unimplemented` (FunctionNotFound: like an old driver;
    NotSupported: a snapshot that does not say)."""
    real = getattr(pynvml, name)
    if callable(real) and name.startswith("nvml") and not isinstance(real, type) \
            and not name.startswith("nvmlEventType") and name not in _PURE_HELPERS:
        def missing(*args: Any, **kwargs: Any) -> Any:
            raise pynvml.NVMLError(unimplemented)
        missing.__name__ = name
        return missing
    return real
