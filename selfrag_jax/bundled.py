"""Where the bundled models live inside the package (`make train-default` writes them, the
demo and `data preview` read them): critic/, generator/ and the decoding settings chosen for them (`inference.settings`)."""

from __future__ import annotations

from pathlib import Path

ASSETS = Path(__file__).resolve().parent / "assets" / "default"
