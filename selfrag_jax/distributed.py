"""Multi-host set-up shared by train, embed, generate and sweep.

On a TPU pod every worker runs the same command; `jax.distributed.initialize()` joins them
(TPU VMs and SLURM/Open MPI GPU clusters are detected by JAX itself; elsewhere the
coordinator comes from JAX_COORDINATOR_ADDRESS, JAX_NUM_PROCESSES and JAX_PROCESS_ID).
Only process 0 writes logs and shared files.
"""

from __future__ import annotations

import os

import jax

_initialized = False


def multi_host_requested() -> bool:
    env = os.environ
    if env.get("JAX_COORDINATOR_ADDRESS") and int(env.get("JAX_NUM_PROCESSES", "1")) > 1:
        return True
    if len([h for h in env.get("TPU_WORKER_HOSTNAMES", "").split(",") if h]) > 1:
        return True
    return int(env.get("SLURM_NTASKS", "1")) > 1 or int(env.get("OMPI_COMM_WORLD_SIZE", "1")) > 1


def initialize() -> None:
    """Join the other processes of this job when the environment says there are some."""
    global _initialized
    if _initialized or not multi_host_requested():
        return
    env = os.environ
    if env.get("JAX_COORDINATOR_ADDRESS"):
        jax.distributed.initialize(
            coordinator_address=env["JAX_COORDINATOR_ADDRESS"],
            num_processes=int(env["JAX_NUM_PROCESSES"]),
            process_id=int(env["JAX_PROCESS_ID"]),
        )
    else:
        jax.distributed.initialize()
    _initialized = True


HOST_DEVICES_FLAG = "--xla_force_host_platform_device_count"


def split_host_cpu(devices: int = 2) -> bool:
    """Give the host (CPU) platform `devices` XLA devices, before JAX starts, unless XLA_FLAGS
    already sets a count. One XLA CPU device leaves much of a second core idle on the
    embedded default's small models; with two, a data-parallel mesh ("-1,1,1") runs the
    halves of each batch side by side (bench/README.md has the measured gain). GPUs and
    TPUs are untouched: the host platform is not their default. False when too late (the
    backend is already up) or when XLA_FLAGS decides."""
    from jax._src import xla_bridge

    flags = os.environ.get("XLA_FLAGS", "")
    if xla_bridge.backends_are_initialized() or HOST_DEVICES_FLAG in flags:
        return False
    os.environ["XLA_FLAGS"] = f"{flags} {HOST_DEVICES_FLAG}={devices}".strip()
    return True


def is_main() -> bool:
    return jax.process_index() == 0


def any_process(flag: bool) -> bool:
    """True on every process if `flag` is true on any (e.g. one worker got SIGTERM)."""
    if jax.process_count() == 1:
        return flag
    import numpy as np
    from jax.experimental import multihost_utils

    return bool(np.any(multihost_utils.process_allgather(np.array([flag]))))


def gather_json(obj) -> list:
    """Every process's JSON-able `obj`, in process order (e.g. each host's data position)."""
    import json

    if jax.process_count() == 1:
        return [obj]
    import numpy as np
    from jax.experimental import multihost_utils

    raw = np.frombuffer(json.dumps(obj).encode(), np.uint8)
    size = int(np.max(multihost_utils.process_allgather(np.array([raw.size]))))
    padded = np.zeros(size, np.uint8)
    padded[: raw.size] = raw
    rows = multihost_utils.process_allgather(padded)
    return [json.loads(bytes(r).rstrip(b"\0").decode()) for r in rows]
