"""The accelerators this project plans for and accounts against: HBM, peak FLOP/s and
bandwidth per chip, from the vendors' spec sheets. `plan` sizes slices with them; the
trainer's MFU and `gpu_check`'s roofline read the running device's row."""

from __future__ import annotations

from dataclasses import dataclass

GiB = 1024**3


@dataclass(frozen=True)
class Chip:
    name: str
    kind: str  # "tpu" | "gpu"
    hbm_bytes: int
    peak_flops: float  # dense bfloat16 FLOP/s, from the vendors' spec sheets
    hbm_bandwidth: float  # bytes/s
    dims: int = 3  # torus dimensions of a TPU slice
    cores_in_name: bool = False  # v4-32 / v5p-32 count TensorCores: 2 per chip
    chip_config: str = "default"  # libtpu chip config (v4 runs as one "megacore" device per chip)


CHIPS: dict[str, Chip] = {
    "v4": Chip("v4", "tpu", 32 * GiB, 275e12, 1.2e12, 3, True, "megacore"),
    "v5p": Chip("v5p", "tpu", 95 * GiB, 459e12, 2.765e12, 3, True),
    "v5e": Chip("v5e", "tpu", 16 * GiB, 197e12, 0.819e12, 2),
    "v6e": Chip("v6e", "tpu", 32 * GiB, 918e12, 1.64e12, 2),
    "h100": Chip("h100", "gpu", 80 * GiB, 989e12, 3.35e12),
    "h200": Chip("h200", "gpu", 140 * GiB, 989e12, 4.8e12),
    "a100": Chip("a100", "gpu", 80 * GiB, 312e12, 2.0e12),
    "l4": Chip("l4", "gpu", 24 * GiB, 121e12, 0.3e12),
}
ALIASES = {"v5litepod": "v5e", "v5lite": "v5e", "v6lite": "v6e", "v5": "v5p"}


def chip_of(device_kind: str) -> Chip | None:
    """The row of a JAX `device_kind` ("TPU v5 lite", "TPU v4", "NVIDIA H100 80GB HBM3"), None if unknown."""
    kind = device_kind.lower().replace("tpu", "").replace(" ", "")
    for name, chip in CHIPS.items():
        if chip.kind == "gpu" and name in kind:
            return chip
    name = ALIASES.get(kind, kind)
    return CHIPS.get(name)
