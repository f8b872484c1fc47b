"""The device mesh, the one logical-axis rules table, and the shardings of params and batches.

Mesh axes ("data", "fsdp", "context", "tensor"): the batch is split over data x fsdp; FSDP
shards parameters and optimizer state over "fsdp" (their `embed` axis). Context parallelism
splits the activations' `length` axis (the positions of each row) over "context", and shards
parameters over it as FSDP does (a chip holding a share of the positions of the same rows
needs the whole model only for the moment it computes a layer). Self-attention then gathers
the keys and values each query block needs (`transformer.ops.ring`). Tensor parallelism splits
heads and d_ff over "tensor" (Megatron-style). A parameter dimension that its mesh axes do not
divide is replicated instead (e.g. a single kv head under tensor parallelism: multi-query).
`mesh.context` defaults to 1 (configs and runs written before it).

Pipeline stages (`mesh.stage`, `parallel/pipeline.py`): the mesh always starts with a "stage"
axis, of size 1 unless the config sets another (only then does `mesh_shape` name it). It
splits the stacked layers' leading axis (logical `layers`) among its chips, which pass the
activations on to the next stage.

Expert parallelism (`mesh.expert`, a mixture-of-experts model, docs/moe.md): the mesh always
ends with an "expert" axis. Its size is 1 unless the config sets another, and only then does
`mesh_shape` name it. It splits the batch as data parallelism does and the experts' weights
(logical axis `expert`) among its chips. Capacity dispatch sends its [B, E, C, D] buffers
all-to-all over it to the chips of their experts and back. Dropless dispatch all-gathers the
tokens over it and reduce-scatters the outputs (`ops/expert_parallel.py`). Where it is 1, the
buffers keep the logical axes `expert_batch` (the batch axes but "expert") and `expert`.

Several TPU slices (multi-slice pods) talk over the data-center network (DCN), slower than the
links within a slice (ICI): `mesh.data`, `mesh.fsdp`, `mesh.tensor` size each axis within one
slice and `mesh.dcn_data`, `mesh.dcn_fsdp`, `mesh.dcn_context`, `mesh.dcn_tensor` across
slices (each mesh axis is their product); `dcn_data` defaults to -1, all the slices, so data
parallelism crosses them.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Mapping, Sequence

import flax.linen as nn
import jax
from jax.experimental import mesh_utils
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from transformer.parallel import pipeline
from transformer.parallel.pipeline import STAGE_AXIS

log = logging.getLogger("transformer")

MESH_AXES = ("data", "fsdp", "context", "tensor")
DCN_AXES = tuple(f"dcn_{axis}" for axis in MESH_AXES)  # config keys: the axes across slices
EXPERT_AXIS = "expert"  # last in every mesh (`mesh_axes`); STAGE_AXIS is first
MESH_DEFAULTS = {"context": 1, EXPERT_AXIS: 1, STAGE_AXIS: 1}  # the axes a config may leave out
DCN_DEFAULTS = {"dcn_data": -1, "dcn_fsdp": 1, "dcn_context": 1, "dcn_tensor": 1,
                f"dcn_{EXPERT_AXIS}": 1, f"dcn_{STAGE_AXIS}": 1}
_OPTIONAL = (STAGE_AXIS, EXPERT_AXIS)  # named by `mesh_axes` only where not 1
# The pipeline's schedule: how the run is laid out, not the model, so a resume may change it.
# Copied into the model config's fields (`pipeline_fields`); their defaults.
PIPELINE_KEYS = {"pipeline_repeats": 1, "pipeline_microbatches": 0}
# The keys of a config's `mesh` section. Every config holds them all (configs/common.py).
CONFIG_KEYS = frozenset(MESH_AXES + DCN_AXES + tuple(PIPELINE_KEYS)
                        + tuple(k for a in _OPTIONAL for k in (a, f"dcn_{a}")))
BATCH_AXES = ("data", "fsdp", EXPERT_AXIS)
LENGTH_AXIS = "context"  # the mesh axis of the activations' positions
PARAM_AXES = ("fsdp", LENGTH_AXIS)  # the mesh axes a parameter's `embed` axis is sharded over

# Logical axis name -> mesh axes. First match wins (Linen); every name appears once.
LOGICAL_AXIS_RULES: tuple[tuple[str, str | tuple[str, ...] | None], ...] = (
    ("batch", BATCH_AXES),
    ("expert_batch", BATCH_AXES[:-1]),
    ("expert", EXPERT_AXIS),
    ("length", LENGTH_AXIS),
    ("embed", PARAM_AXES),
    ("heads", "tensor"),
    ("kv_heads", "tensor"),
    ("head_dim", None),
    ("mlp", "tensor"),
    ("vocab", "tensor"),
    ("layers", STAGE_AXIS),
)


def _fill(keys: Sequence[str], sizes: list[int], total: int, what: str) -> list[int]:
    """`sizes` with its one -1 (if any) taking the rest of `total`. One line on a mismatch."""
    described = ", ".join(f"mesh.{k}={s}" for k, s in zip(keys, sizes, strict=True)
                          if s != 1 or not k.endswith(("context",) + _OPTIONAL))  # unsplit
    if sizes.count(-1) > 1:
        raise ValueError(f"at most one mesh axis may be -1, got {described}")
    if any(s == 0 or s < -1 for s in sizes):
        raise ValueError(f"mesh sizes must be positive or -1, got {described}")
    known = math.prod(s for s in sizes if s != -1)
    if -1 in sizes:
        if total % known:
            raise ValueError(f"{described} cannot fill {total} {what}: {known} does not "
                             f"divide {total}")
        sizes[sizes.index(-1)] = total // known
    if math.prod(sizes) != total:
        raise ValueError(f"{described} needs {math.prod(sizes)} {what}, but {total} are "
                         f"available; make the product {total} or set one axis to -1")
    return sizes


def mesh_axes(mesh_cfg) -> tuple[str, ...]:
    """MESH_AXES, after "stage" and before "expert" where the config's `mesh` section sets
    that axis to anything but 1.

    Every config declares `mesh.expert = 1` and `mesh.stage = 1`, and runs written before them
    have no such keys. In both, `mesh_shape` leaves the axis out, so summaries and run metadata
    name it only where it splits. A size of -1 names it too, as lm_moe.py's does on any device
    count.
    """
    def split(axis):
        return any(int(mesh_cfg.get(key, 1)) != 1 for key in (axis, f"dcn_{axis}"))

    return ((STAGE_AXIS,) * split(STAGE_AXIS) + MESH_AXES
            + (EXPERT_AXIS,) * split(EXPERT_AXIS))


def hybrid_shape(mesh_cfg, num_devices: int, num_slices: int = 1) -> tuple[list[int], list[int]]:
    """(sizes within a slice, sizes across slices) of the `mesh_axes`, from the config's `mesh`
    section for `num_devices` devices in `num_slices` slices."""
    if num_devices % num_slices:
        raise ValueError(f"{num_devices} devices do not split into {num_slices} slices")
    axes = mesh_axes(mesh_cfg)
    dcn_axes = tuple(f"dcn_{axis}" for axis in axes)
    dcn = _fill(dcn_axes, [int(mesh_cfg.get(k, DCN_DEFAULTS[k])) for k in dcn_axes],
                num_slices, "slices")
    sizes = [int(mesh_cfg[axis] if axis in mesh_cfg else MESH_DEFAULTS[axis]) for axis in axes]
    ici = _fill(axes, sizes,
                num_devices // num_slices, "devices per slice" if num_slices > 1 else "devices")
    return ici, dcn


def mesh_shape(mesh_cfg, num_devices: int, num_slices: int = 1) -> dict[str, int]:
    """{"data": .., "fsdp": .., "context": .., "tensor": ..} from the config's `mesh` section.
    One -1 takes the rest. With several slices each axis is its size within a slice times
    across them."""
    ici, dcn = hybrid_shape(mesh_cfg, num_devices, num_slices)
    return {axis: i * d for axis, i, d in zip(mesh_axes(mesh_cfg), ici, dcn, strict=True)}


def pipeline_fields(mesh_cfg) -> dict[str, int]:
    """The `mesh` section's pipeline keys as the model config's fields (a config written
    before them: their defaults)."""
    return {key: int(mesh_cfg.get(key, default)) for key, default in PIPELINE_KEYS.items()}


def num_slices(devices: Sequence[jax.Device]) -> int:
    """How many TPU slices `devices` span (devices of a multi-slice pod carry `slice_index`)."""
    return len({getattr(device, "slice_index", 0) for device in devices})


def validate_mesh_for_model(shape: Mapping[str, int], model) -> None:
    """Tensor parallelism must divide the model's heads and d_ff, expert parallelism its
    experts; pipeline stages need a model they can split (`pipeline.check`). `model` is a
    TransformerConfig. A mismatch raises one line naming the sizes."""
    expert = shape.get(EXPERT_AXIS, 1)
    if expert > 1 and model.num_experts % expert:
        raise ValueError(f"mesh.expert={expert} does not divide model.num_experts="
                         f"{model.num_experts}")
    stages = shape.get(STAGE_AXIS, 1)
    layers = getattr(model, pipeline.stack_field(model.architecture))
    pipeline.check(stages_=stages, layers=layers,
                   repeats=model.pipeline_repeats,
                   microbatches=model.pipeline_microbatches or stages,
                   architecture=model.architecture, scan_layers=model.scan_layers)
    tensor = shape["tensor"]
    for field in ("num_heads", "d_ff"):
        value = getattr(model, field)
        if value % tensor:
            raise ValueError(f"mesh.tensor={tensor} does not divide {field}={value}")


def make_mesh(mesh_cfg, devices: Sequence[jax.Device] | None = None) -> Mesh:
    """The ("stage",) + MESH_AXES + ("expert",) mesh over `devices` (default: all), Auto
    axis types.
    Over several slices a hybrid mesh whose DCN part spans the slices. A mesh axis that no
    product of the torus' physical axes equals (8 on a v5p-128's 4x4x4) splits a physical
    axis, with a warning, rather than failing as `jax.make_mesh` does off v5e."""
    devices = list(jax.devices() if devices is None else devices)
    slices = num_slices(devices)
    ici, dcn = hybrid_shape(mesh_cfg, len(devices), slices)
    if STAGE_AXIS not in mesh_axes(mesh_cfg):
        ici, dcn = [1] + ici, [1] + dcn
    if EXPERT_AXIS not in mesh_axes(mesh_cfg):
        ici, dcn = ici + [1], dcn + [1]
    axes = (STAGE_AXIS,) + MESH_AXES + (EXPERT_AXIS,)
    axis_types = (jax.sharding.AxisType.Auto,) * len(axes)
    if slices == 1:
        try:
            return jax.make_mesh(tuple(ici), axes, axis_types, devices=devices)
        except NotImplementedError:
            log.warning("mesh %s: no product of the devices' physical axes gives each mesh "
                        "axis, so physical axes are split (collectives over a split axis "
                        "cross more links)", dict(zip(axes, ici, strict=True)))
            grid = mesh_utils.create_device_mesh(ici, devices, allow_split_physical_axes=True)
            return Mesh(grid, axes, axis_types=axis_types)
    grid = mesh_utils.create_hybrid_device_mesh(ici, dcn, devices)
    return Mesh(grid, axes, axis_types=axis_types)


def logical_to_sharding(logical_specs, abstract_tree, mesh: Mesh):
    """NamedShardings for a tree of logical PartitionSpecs, replicating any dimension whose
    mesh axes do not divide it (a checkpoint's shardings are the same as before `context`
    existed on a mesh whose context is 1)."""

    def one(spec, leaf):
        mesh_spec = nn.logical_to_mesh_axes(spec, LOGICAL_AXIS_RULES)
        fitted = []
        for dim, axes in zip(leaf.shape, tuple(mesh_spec) + (None,) * leaf.ndim, strict=False):
            if isinstance(axes, tuple):  # axes of size 1 split nothing: ("fsdp",) reads "fsdp"
                axes = tuple(a for i, a in enumerate(axes) if i == 0 or mesh.shape[a] > 1)
                axes = axes[0] if len(axes) == 1 else axes
            names = (axes,) if isinstance(axes, str) else (axes or ())
            size = math.prod(mesh.shape[name] for name in names)
            fitted.append(axes if axes is not None and dim % size == 0 else None)
        return NamedSharding(mesh, P(*fitted))

    return jax.tree.map(one, logical_specs, abstract_tree,
                        is_leaf=lambda x: isinstance(x, P))


def tree_shardings(boxed_abstract_tree, mesh: Mesh):
    """Shardings of a tree whose leaves may be boxed with logical names (nn.Partitioned).
    Unboxed leaves (e.g. step counters) are replicated."""
    specs = nn.get_partition_spec(boxed_abstract_tree)
    return logical_to_sharding(specs, nn.unbox(boxed_abstract_tree), mesh)


def batch_shards(mesh_shape: Mapping[str, int]) -> int:
    """How many ways the batch is split: the product of the BATCH_AXES sizes (`mesh.shape`)."""
    return math.prod(mesh_shape.get(axis, 1) for axis in BATCH_AXES)


def replicated(mesh: Mesh) -> NamedSharding:
    return NamedSharding(mesh, P())
