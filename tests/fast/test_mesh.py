import pytest
from jax.sharding import PartitionSpec as P

from gemma_tpu_helpers.course.views import model_views
from gemma_tpu_helpers.fixes.model import gemma4
from gemma_tpu_helpers.fixes.model import mesh as mesh_lib


def test_mesh_axes_are_auto_and_shaped_by_the_profile(mesh, smoke):
    import jax

    assert dict(mesh.shape) == dict(smoke.hardware.mesh)
    assert all(t == jax.sharding.AxisType.Auto for t in mesh.axis_types)
    assert model_views.mesh_grid(mesh).shape == (4, 2)


def test_bad_mesh_specs():
    with pytest.raises(mesh_lib.MeshError, match="needs 4 devices but 8"):
        mesh_lib.make_mesh((2, 2), ("fsdp", "tp"))
    with pytest.raises(mesh_lib.MeshError, match="one axis name per"):
        mesh_lib.make_mesh((8,), ("fsdp", "tp"))


def test_example_sharding_splits_over_both_axes(mesh):
    x = model_views.example_sharding(mesh)
    assert x.sharding.spec == P("fsdp", "tp")
    assert {s.data.shape for s in x.addressable_shards} == {(4, 4)}


def test_tp_table_for_the_31b():
    table = model_views.tp_table(gemma4.GEMMA4_31B_TEXT_CONFIG).set_index("tp")
    assert list(table["valid"]) == [True, True, True, False]
    assert "global KV heads" in table.loc[8, "why not"]


@pytest.mark.parametrize("context, spec", [("trainer", P("fsdp")), ("set_mesh", P())])
def test_trainer_batch_is_sharded_only_under_the_trainer_context(tiny_dir, mesh, context, spec):
    model = gemma4.load_model(tiny_dir, mesh)  # fresh: the probe takes one (tiny) optimizer step
    sharding = model_views.trainer_batch_sharding(model, mesh, context=context)
    assert sharding.spec == spec  # set_mesh alone: the batch is silently replicated on every device


def test_cli_mesh(tiny_dir, tmp_path):
    from support import run_cli

    (tmp_path / "smoke").mkdir()
    (tmp_path / "smoke" / "base").symlink_to(tiny_dir)  # the smoke base (its seed and depth), not the checkout's runs/
    r = run_cli("mesh", "--profile", "smoke", env={"GEMMA_TPU_RUNS": str(tmp_path)})
    assert r.returncode == 0, r.stderr[-2000:]
    assert "fsdp" in r.stdout and "global KV heads" in r.stdout  # tp=8 row explains itself
    r = run_cli("mesh", "--profile", "v5p-8", env={"JAX_PLATFORMS": "cpu"})  # no TPU here: the pre-flight says so
    assert r.returncode == 2 and "this machine has no TPU" in r.stderr and "INVALID_ARGUMENT" not in r.stderr
