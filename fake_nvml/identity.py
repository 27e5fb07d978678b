"""What a GPU board says about itself (NVML's identity calls), per fake model: enough to file an RMA.

Board part numbers and VBIOS versions follow the shapes real boards report (`692-2G520-0200-000`,
`96.00.A5.00.16`). GeForce boards have no InfoROM, and NVML reads the serial number from the InfoROM
("for all products with an inforom", NVML API reference, nvmlDeviceGetSerial): NotSupported there.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class BoardIdentity:
    board_part_number: str
    vbios_version: str
    has_inforom: bool = True


BOARDS: dict[str, BoardIdentity] = {
    "h100-sxm5-80gb": BoardIdentity("692-2G520-0200-000", "96.00.A5.00.16"),
    "h200-sxm-141gb": BoardIdentity("692-2G520-0280-000", "96.00.A5.00.03"),
    "a100-sxm4-80gb": BoardIdentity("692-2G506-0210-002", "92.00.45.00.03"),
    "a100-pcie-40gb": BoardIdentity("900-21001-0000-000", "92.00.25.00.08"),
    "v100-sxm2-32gb": BoardIdentity("900-2G503-0010-000", "88.00.80.00.04"),
    "rtx-4090": BoardIdentity("900-1G136-2530-000", "95.02.18.80.5F", has_inforom=False),
}
_UNKNOWN = BoardIdentity("900-00000-0000-000", "00.00.00.00.00")


def board_of(model_key: str) -> BoardIdentity:
    return BOARDS.get(model_key, _UNKNOWN)
