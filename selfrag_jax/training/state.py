"""The training state: what a step updates and a checkpoint saves (trainer and checkpointing share it)."""

from __future__ import annotations

from typing import Any

import jax
from flax import struct


class TrainState(struct.PyTreeNode):
    step: jax.Array
    params: Any
    opt_state: Any
    first_bad_step: jax.Array  # -1, or the first step whose loss was not finite
