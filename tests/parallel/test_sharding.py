"""The mesh and the rules table: `context` sits between fsdp and tensor, defaults to 1 (configs
and runs written before it), splits the activations' positions and, beside fsdp, the
parameters' embed axis; on a mesh whose context is 1 every parameter keeps its sharding."""

import jax
import pytest
from jax.sharding import PartitionSpec as P

from transformer.model.config import TransformerConfig
from transformer.parallel import sharding


def test_mesh_axes_and_the_context_default():
    assert sharding.MESH_AXES == ("data", "fsdp", "context", "tensor")
    assert sharding.mesh_shape({"data": -1, "fsdp": 1, "tensor": 2}, 8) == {
        "data": 4, "fsdp": 1, "context": 1, "tensor": 2}
    mesh = sharding.make_mesh({"data": 1, "fsdp": 2, "context": 4, "tensor": 1})
    assert dict(mesh.shape) == {"stage": 1, "data": 1, "fsdp": 2, "context": 4, "tensor": 1,
                                "expert": 1}
    with pytest.raises(ValueError, match="mesh.context=3, mesh.tensor=1 needs 6 devices"):
        sharding.mesh_shape({"data": 2, "fsdp": 1, "context": 3, "tensor": 1}, 8)


def test_length_goes_to_context_and_embed_beside_fsdp():
    rules = dict(sharding.LOGICAL_AXIS_RULES)
    assert rules["length"] == "context" and rules["embed"] == ("fsdp", "context")
    abstract = {"kernel": jax.ShapeDtypeStruct((64, 16), "float32"),
                "odd": jax.ShapeDtypeStruct((6, 16), "float32")}
    specs = {"kernel": P("embed", "mlp"), "odd": P("embed", "mlp")}
    without = sharding.logical_to_sharding(
        specs, abstract, sharding.make_mesh({"data": 2, "fsdp": 2, "tensor": 2}))
    assert without["kernel"].spec == P("fsdp", "tensor")  # as before the context axis
    split = sharding.logical_to_sharding(
        specs, abstract, sharding.make_mesh({"data": 1, "fsdp": 2, "context": 2, "tensor": 2}))
    assert split["kernel"].spec == P(("fsdp", "context"), "tensor")
    assert split["odd"].spec == P(None, "tensor")  # 4 does not divide 6: replicated


def test_expert_axis_splits_the_batch_and_the_experts():
    shape = sharding.mesh_shape({"data": 2, "fsdp": 1, "tensor": 1, "expert": 4}, 8)
    assert shape == {"data": 2, "fsdp": 1, "context": 1, "tensor": 1, "expert": 4}
    assert sharding.batch_shards(shape) == 8
    abstract = {"ff_in": jax.ShapeDtypeStruct((8, 64, 16), "float32")}
    specs = {"ff_in": P("expert", "embed", "mlp")}
    mesh = sharding.make_mesh({"data": 1, "fsdp": 2, "tensor": 1, "expert": 4})
    assert sharding.logical_to_sharding(specs, abstract, mesh)["ff_in"].spec == P(
        "expert", "fsdp", "tensor")
    with pytest.raises(ValueError, match="mesh.expert=4 does not divide model.num_experts=6"):
        sharding.validate_mesh_for_model(shape, TransformerConfig(num_experts=6))


def test_mesh_shape_names_the_expert_axis_only_where_experts_are_split():
    """Every config declares `mesh.expert = 1`, and a run's config.json from before it has no
    such key. Neither names the axis in `mesh_shape`, so summaries and run metadata stay as
    they were. A size of -1 or above 1 names it, within a slice or across slices."""
    declared = {"data": -1, "fsdp": 1, "context": 1, "tensor": 1, "expert": 1,
                "dcn_data": -1, "dcn_fsdp": 1, "dcn_context": 1, "dcn_tensor": 1,
                "dcn_expert": 1}
    stored = {"data": -1, "fsdp": 1, "tensor": 1}
    unsplit = {"data": 8, "fsdp": 1, "context": 1, "tensor": 1}
    assert sharding.mesh_shape(declared, 8) == unsplit
    assert sharding.mesh_shape(stored, 8) == unsplit
    assert sharding.mesh_shape({**declared, "data": 1, "expert": -1}, 8)["expert"] == 8
    assert sharding.mesh_shape({**declared, "data": 4, "expert": 2}, 8)["expert"] == 2
    across = {**declared, "dcn_data": 1, "dcn_expert": 2}
    assert sharding.mesh_shape(across, 16, num_slices=2)["expert"] == 2
    assert dict(sharding.make_mesh(declared).shape)["expert"] == 1
