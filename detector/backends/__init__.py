"""Where checks get their facts: NVML (real or fake), nvidia-smi, the PCI bus. Chosen explicitly."""
