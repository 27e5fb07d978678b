"""The caps on a replay capture: it comes from outside (a ticket attachment, an unpacked archive), so a
FIFO, a device, a link out of its folder or a file far bigger or deeper than nvidia-smi ever prints is
refused with one line, never read until memory or the stack runs out.

The figures come from real captures (tests/fixtures/real_machines, ../shared/real-machines):

- `nvidia-smi -q -x` is 27 KiB for one H100 and 222 KiB for the largest, 8 V100S with processes
  (about 28 KiB a GPU, about 250 bytes a process). A 72-GPU node at that rate is about 2 MiB, so
  32 MiB leaves room for some 100,000 process entries besides, while parsing stays near 250 MiB of
  memory and 3 s (measured: 30 MiB of that capture's GPUs repeated, 1,144 GPUs, about 8 bytes of memory
  per byte of XML).
- The deepest real XML nests 7 elements (a MIG device's memory, under <mig_devices>), the text form
  fewer. 64 is far above both and far below Python's recursion limit (1,000), which the tree's own
  recursive walks would otherwise meet; the parsers count depth as they go, so a deeper document is
  refused before any recursion.
- Side files are /proc/modules (under 20 KiB with every module of a big server loaded), the driver's
  version line, `ls -la /dev/nvidia*` and `nvidia-smi nvlink -s` (18 links x 72 GPUs is about 40 KiB):
  1 MiB each is 25 times the largest.
"""

from __future__ import annotations

MAX_CAPTURE_BYTES = 32 << 20
MAX_DEPTH = 64
MAX_SIDE_FILE_BYTES = 1 << 20
