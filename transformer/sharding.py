"""The device mesh, the one logical-axis rules table, and the shardings of params and batches.

Mesh axes ("data", "fsdp", "tensor"): the batch is split over data x fsdp; FSDP shards
parameters and optimizer state over "fsdp" (their `embed` axis); tensor parallelism splits
heads and d_ff over "tensor" (Megatron-style). A parameter dimension that its mesh axes do not
divide is replicated instead (e.g. a single kv head under tensor parallelism: multi-query).
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence

import flax.linen as nn
import jax
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from transformer.model_config import TransformerConfig

MESH_AXES = ("data", "fsdp", "tensor")
BATCH_AXES = ("data", "fsdp")

# Logical axis name -> mesh axes. First match wins (Linen); every name appears once.
LOGICAL_AXIS_RULES: tuple[tuple[str, str | tuple[str, ...] | None], ...] = (
    ("batch", BATCH_AXES),
    ("length", None),
    ("embed", "fsdp"),
    ("heads", "tensor"),
    ("kv_heads", "tensor"),
    ("head_dim", None),
    ("mlp", "tensor"),
    ("vocab", "tensor"),
    ("layers", None),
)


def mesh_shape(mesh_cfg, num_devices: int) -> dict[str, int]:
    """{"data": .., "fsdp": .., "tensor": ..} from the config's `mesh` section; one -1 takes
    the rest."""
    sizes = [int(mesh_cfg[axis]) for axis in MESH_AXES]
    described = ", ".join(f"mesh.{a}={s}" for a, s in zip(MESH_AXES, sizes, strict=True))
    if sizes.count(-1) > 1:
        raise ValueError(f"at most one mesh axis may be -1, got {described}")
    if any(s == 0 or s < -1 for s in sizes):
        raise ValueError(f"mesh sizes must be positive or -1, got {described}")
    known = math.prod(s for s in sizes if s != -1)
    if -1 in sizes:
        if num_devices % known:
            raise ValueError(f"{described} cannot fill {num_devices} devices: {known} does not "
                             f"divide {num_devices}")
        sizes[sizes.index(-1)] = num_devices // known
    if math.prod(sizes) != num_devices:
        raise ValueError(f"{described} needs {math.prod(sizes)} devices, but {num_devices} are "
                         f"available; make the product {num_devices} or set one axis to -1")
    return dict(zip(MESH_AXES, sizes, strict=True))


def validate_mesh_for_model(shape: Mapping[str, int], model: TransformerConfig) -> None:
    """Tensor parallelism must divide the heads and d_ff (one line naming the sizes)."""
    tensor = shape["tensor"]
    for field in ("num_heads", "d_ff"):
        value = getattr(model, field)
        if value % tensor:
            raise ValueError(f"mesh.tensor={tensor} does not divide {field}={value}")


def make_mesh(mesh_cfg, devices: Sequence[jax.Device] | None = None) -> Mesh:
    """The ("data", "fsdp", "tensor") mesh over `devices` (default: all), Auto axis types."""
    devices = list(jax.devices() if devices is None else devices)
    shape = mesh_shape(mesh_cfg, len(devices))
    return jax.make_mesh(tuple(shape.values()), MESH_AXES,
                         (jax.sharding.AxisType.Auto,) * len(MESH_AXES), devices=devices)


def logical_to_sharding(logical_specs, abstract_tree, mesh: Mesh):
    """NamedShardings for a tree of logical PartitionSpecs, replicating any dimension whose
    mesh axes do not divide it."""

    def one(spec, leaf):
        mesh_spec = nn.logical_to_mesh_axes(spec, LOGICAL_AXIS_RULES)
        fitted = []
        for dim, axes in zip(leaf.shape, tuple(mesh_spec) + (None,) * leaf.ndim, strict=False):
            names = (axes,) if isinstance(axes, str) else (axes or ())
            size = math.prod(mesh.shape[name] for name in names)
            fitted.append(axes if axes is not None and dim % size == 0 else None)
        return NamedSharding(mesh, P(*fitted))

    return jax.tree.map(one, logical_specs, abstract_tree,
                        is_leaf=lambda x: isinstance(x, P))


def tree_shardings(boxed_abstract_tree, mesh: Mesh):
    """Shardings of a tree whose leaves may be boxed with logical names (nn.Partitioned);
    unboxed leaves (e.g. step counters) are replicated."""
    specs = nn.get_partition_spec(boxed_abstract_tree)
    return logical_to_sharding(specs, nn.unbox(boxed_abstract_tree), mesh)


def batch_shards(mesh_shape: Mapping[str, int]) -> int:
    """How many ways the batch is split: the product of the BATCH_AXES sizes (`mesh.shape`)."""
    return math.prod(mesh_shape[axis] for axis in BATCH_AXES)


def replicated(mesh: Mesh) -> NamedSharding:
    return NamedSharding(mesh, P())
