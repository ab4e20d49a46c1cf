"""The mesh and the one table that maps logical axis names onto it.

Layers only say which logical axes a tensor has ("embed", "heads", ...). This module owns
the mapping of those names onto the physical mesh axes `data`, `fsdp` and `tensor`, builds
meshes from a short spec, and checks divisibility before anything is compiled, so that a
bad combination fails with a message that names the config value to change.
"""

from __future__ import annotations

import math
import re
from typing import Any, Sequence

import jax
import numpy as np
from flax import linen as nn
from jax.sharding import Mesh, NamedSharding, PartitionSpec

MESH_AXES = ("data", "fsdp", "tensor")

# logical axis -> mesh axis (or tuple of mesh axes, or None for replicated).
LogicalRules = tuple[tuple[str, Any], ...]
DEFAULT_RULES: LogicalRules = (
    # parameters
    ("vocab", "tensor"),
    ("embed", "fsdp"),
    ("heads", "tensor"),
    ("kv_heads", "tensor"),
    ("head_dim", None),
    ("mlp", "tensor"),
    ("norm", None),
    ("layers", None),
    # activations
    ("activation_batch", ("data", "fsdp")),
    ("activation_length", None),
    ("activation_embed", None),
    ("activation_heads", "tensor"),
    ("activation_kv_heads", "tensor"),
    ("activation_mlp", "tensor"),
    ("activation_vocab", "tensor"),
    # KV cache [batch, kv_heads, time, head_dim]
    ("cache_batch", ("data", "fsdp")),
    ("cache_kv_heads", "tensor"),
    ("cache_time", None),
)

# Which config value sets the size of a logical axis (for error messages).
AXIS_SOURCES = {
    "vocab": "model.vocab_size (or pad it with model.vocab_size rounded up)",
    "embed": "model.hidden_size",
    "heads": "model.num_heads",
    "kv_heads": "model.num_kv_heads",
    "mlp": "model.intermediate_size",
    "activation_batch": "the global batch size",
    "cache_batch": "the decode batch size",
}


def rules_from_config(rules: Sequence[Sequence[Any]] | None) -> LogicalRules:
    """Rules as written in YAML (lists) -> the tuple form flax expects."""
    if rules is None:
        return DEFAULT_RULES
    out = []
    for item in rules:
        if len(item) != 2:
            raise ValueError(f"sharding rule {item!r} must be [logical_axis, mesh_axis_or_list_or_null]")
        name, target = item
        if isinstance(target, list):
            target = tuple(target)
        for axis in (target if isinstance(target, tuple) else (target,)):
            if axis is not None and axis not in MESH_AXES:
                raise ValueError(f"sharding rule for {name!r} names mesh axis {axis!r}; mesh axes are {MESH_AXES}")
        out.append((name, target))
    return tuple(out)


def parse_mesh_spec(spec: str | Sequence[int] | dict[str, int], num_devices: int | None = None) -> dict[str, int]:
    """'2,2,2' | 'data=2,fsdp=4' | (8,1,1) | {'fsdp': -1} -> {'data', 'fsdp', 'tensor'} sizes.

    One axis may be -1 to take the remaining devices. Missing axes are 1.
    """
    n = jax.device_count() if num_devices is None else num_devices
    if isinstance(spec, str):
        spec = spec.strip()
        if "=" in spec:
            sizes = {}
            for part in spec.split(","):
                key, _, value = part.partition("=")
                sizes[key.strip()] = int(value)
        else:
            sizes = dict(zip(MESH_AXES, (int(x) for x in re.split(r"[,x ]+", spec) if x)))
    elif isinstance(spec, dict):
        sizes = dict(spec)
    else:
        sizes = dict(zip(MESH_AXES, (int(x) for x in spec)))
    unknown = set(sizes) - set(MESH_AXES)
    if unknown:
        raise ValueError(f"mesh spec {spec!r}: unknown axis {sorted(unknown)[0]!r}; axes are {MESH_AXES}")
    sizes = {axis: int(sizes.get(axis, 1)) for axis in MESH_AXES}
    free = [a for a, s in sizes.items() if s == -1]
    if len(free) > 1:
        raise ValueError(f"mesh spec {spec!r}: only one axis may be -1")
    fixed = math.prod(s for s in sizes.values() if s != -1)
    if free:
        if n % fixed:
            raise ValueError(f"mesh spec {spec!r}: {n} devices are not divisible by {fixed}")
        sizes[free[0]] = n // fixed
    if math.prod(sizes.values()) != n:
        raise ValueError(
            f"mesh spec {spec!r} has {math.prod(sizes.values())} devices but {n} are available; "
            "change the mesh (e.g. mesh=data=-1)"
        )
    return sizes


def make_mesh(spec: str | Sequence[int] | dict[str, int] = "1,-1,1", devices: Sequence[Any] | None = None) -> Mesh:
    """A mesh with axes (data, fsdp, tensor) over `devices` (default: all devices).

    Uses jax's topology-aware device order when the devices are the real ones, so the
    `tensor` axis lands on the fastest interconnect.
    """
    devices = list(jax.devices() if devices is None else devices)
    sizes = parse_mesh_spec(spec, len(devices))
    shape = tuple(sizes[a] for a in MESH_AXES)
    try:
        grid = jax.experimental.mesh_utils.create_device_mesh(shape, devices=devices)
    except Exception:  # non-TPU topologies and abstract device lists
        grid = np.asarray(devices, dtype=object).reshape(shape)
    return Mesh(grid, MESH_AXES)


def logical_to_spec(logical: Sequence[str | None], rules: LogicalRules = DEFAULT_RULES) -> PartitionSpec:
    return nn.logical_to_mesh_axes(tuple(logical), rules)


def logical_sharding(mesh: Mesh, logical: Sequence[str | None], rules: LogicalRules = DEFAULT_RULES) -> NamedSharding:
    return NamedSharding(mesh, logical_to_spec(logical, rules))


def tree_shardings(mesh: Mesh, logical_tree: Any, rules: LogicalRules = DEFAULT_RULES) -> Any:
    """Map a tree of logical PartitionSpecs (from `nn.get_partition_spec`) to NamedShardings."""
    return jax.tree.map(
        lambda spec: NamedSharding(mesh, nn.logical_to_mesh_axes(tuple(spec), rules)),
        logical_tree,
        is_leaf=lambda x: isinstance(x, PartitionSpec),
    )


def check_divisible(path: str, shape: Sequence[int], logical: Sequence[str | None], mesh: Mesh,
                    rules: LogicalRules = DEFAULT_RULES) -> None:
    """Raise one line naming the config value when a dimension does not split over the mesh."""
    spec = logical_to_spec(logical, rules)
    for dim, (size, name, axes) in enumerate(zip(shape, logical, tuple(spec) + (None,) * len(shape))):
        if axes is None:
            continue
        axes = axes if isinstance(axes, tuple) else (axes,)
        parts = math.prod(mesh.shape[a] for a in axes)
        if size % parts:
            source = AXIS_SOURCES.get(name, f"the size of logical axis {name!r}")
            raise ValueError(
                f"{path}: dimension {dim} ({name}={size}) is not divisible by mesh axes "
                f"{'x'.join(axes)}={parts}; change {source} or the mesh / sharding rules"
            )


def check_tree_divisible(abstract_tree: Any, logical_tree: Any, mesh: Mesh, rules: LogicalRules = DEFAULT_RULES):
    """check_divisible over a whole parameter tree (abstract shapes and logical specs)."""
    flat_shapes = jax.tree_util.tree_flatten_with_path(abstract_tree)[0]
    flat_specs = jax.tree.leaves(logical_tree, is_leaf=lambda x: isinstance(x, PartitionSpec))
    for (path, leaf), spec in zip(flat_shapes, flat_specs):
        check_divisible(jax.tree_util.keystr(path), leaf.shape, tuple(spec), mesh, rules)
