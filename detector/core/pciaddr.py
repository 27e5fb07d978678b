"""Moved to detector/backends/pciaddr.py, the bottom layer, where nvidia-smi's parser needs it. This name stays
only for importers in areas being changed elsewhere (detector/checks/xid/parser.py,
detector/kube/device_taints.py, fake_nvml/); once they import the new path, delete this module."""

from detector.backends.pciaddr import normalize_bus_id, nvml_bus_id

__all__ = ["normalize_bus_id", "nvml_bus_id"]
