"""Rules: what observations mean. Versioned YAML files, validated on load; they know nothing of NVML."""
