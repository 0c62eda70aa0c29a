"""Every private torch name hlat uses (`hlat/torch_private.py`, the one module that reaches them), checked on the
pinned torch: each check fails naming what moved, here rather than deep in a rehearsal, a restore or a compiled
FP8 step. tests/test_structure.py checks that no other module reaches a private torch name."""

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp

import hlat.torch_private as private


class Recorder(private.TorchDispatchMode):
    """The ops dispatched while it is active, in `seen`."""

    def __init__(self):
        super().__init__()
        self.seen = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.seen.append(func)
        return func(*args, **(kwargs or {}))


def test_a_dispatch_mode_sees_the_ops_run_under_it():
    with Recorder() as recorder:
        torch.ones(2) + 1
    assert torch.ops.aten.add.Tensor in recorder.seen, f"torch's TorchDispatchMode saw {recorder.seen} (changed?)"


def test_the_fake_store_registers_the_fake_backend():
    store = private.fake_store()
    assert isinstance(store, dist.Store), f"torch's FakeStore is {type(store)}, no longer a Store"
    assert "fake" in dist.Backend.backend_list, "torch's fake_pg no longer registers the 'fake' backend"


def test_the_ops_matched_by_identity_are_the_ones_named():
    names = {
        "CAST": (private.CAST, "aten::_to_copy"),
        "FSDP_ALL_GATHER": (private.FSDP_ALL_GATHER, "c10d::_allgather_base_"),
        **{
            f"FUNCTIONAL_COLLECTIVES[{i}]": (op, f"{private.FUNCTIONAL_NAMESPACE}::{op.overloadpacket.__name__}")
            for i, op in enumerate(private.FUNCTIONAL_COLLECTIVES)
        },
    }
    assert {k: op.name() for k, (op, _) in names.items()} == {k: name for k, (_, name) in names.items()}
    with torch.autocast("cpu", dtype=torch.bfloat16), Recorder() as recorder:
        torch.nn.functional.linear(torch.ones(2, 2), torch.nn.Parameter(torch.ones(2, 2)))
    assert private.CAST in recorder.seen, f"autocast no longer casts a parameter with {private.CAST.name()}"


def test_op_arguments_names_them_by_the_schema():
    a, b = torch.ones(1), torch.zeros(1)
    assert private.op_arguments(torch.ops.aten.add.Tensor, (a, b)) == {"self": a, "other": b}


def test_inductor_takes_the_precision_casts_setting():
    import torch._inductor.config as inductor

    before = inductor.emulate_precision_casts
    try:
        private.emulate_precision_casts()
        assert inductor.emulate_precision_casts is True, "torch._inductor.config.emulate_precision_casts moved"
    finally:
        inductor.emulate_precision_casts = before


class Wrapper(torch.Tensor):
    """A tensor subclass that wraps one tensor of its own shape, as torchao's FP8 weights wrap their values."""

    @staticmethod
    def __new__(cls, inner):
        return torch.Tensor._make_wrapper_subclass(cls, inner.shape, dtype=inner.dtype)

    def __init__(self, inner):
        self.inner = inner

    def __tensor_flatten__(self):
        return ["inner"], None

    @classmethod
    def __torch_dispatch__(cls, func, types, args=(), kwargs=None):
        return NotImplemented


def test_the_wrapped_tensor_is_found_through_tensor_flatten():
    inner = torch.arange(3.0)
    assert private.wrapped_tensor(Wrapper(inner)) is inner
    assert private.wrapped_tensor(inner) is None


def test_dcp_names_the_file_of_each_chunk_a_load_reads(tmp_path):
    dcp.save({"a": torch.ones(4), "b": torch.zeros(2)}, checkpoint_id=tmp_path)
    metadata = dcp.FileSystemReader(tmp_path).read_metadata()
    planner = dcp.DefaultLoadPlanner()
    planner.set_up_planner({"a": torch.empty(4)}, metadata, is_coordinator=False)
    assert private.chunk_files(metadata, planner.create_local_plan()) == {"__0_0.distcp"}


def test_dcp_keeps_where_each_item_lies_in_its_metadata_by_the_items_index(tmp_path):
    dcp.save({"a": torch.ones(4), "b": torch.zeros(2)}, checkpoint_id=tmp_path)
    metadata = dcp.FileSystemReader(tmp_path).read_metadata()
    kept = private.storage_data(metadata)
    assert {index.fqn for index in kept} == {"a", "b"} and {info.relative_path for info in kept.values()} == {
        "__0_0.distcp"
    }


def test_dcp_keeps_cached_save_plans_under_the_key_given_and_forgets_them(tmp_path):
    """A planner given a key of its own caches its plans there, not under its class's name (a run's plans never
    reach the next run of the same process), and `forget_plans` drops every cache of that key."""
    planner = dcp.DefaultSavePlanner(enable_plan_caching=True)
    private.own_plan_cache(planner, "hlat-test")
    dcp.save({"a": torch.ones(4)}, checkpoint_id=tmp_path, planner=planner)
    from torch.distributed.checkpoint.planner import SavePlanner

    caches = [getattr(SavePlanner, name) for name in private.PLAN_CACHES]
    assert all("hlat-test" in cache for cache in caches) and not any("DefaultSavePlanner" in c for c in caches)
    private.forget_plans("hlat-test")
    assert not any("hlat-test" in cache for cache in caches)


def test_a_gloo_group_of_its_own_forms_in_a_store_and_reduces():
    """torch's undocumented ProcessGroupGloo(store, rank, size, timeout): a group of one, outside any default group,
    whose all-reduce returns a work with a future (what a replica group's wait watches)."""
    store = dist.HashStore()
    group = private.gloo_group(dist.PrefixStore("epoch1", store), 0, 1, 10.0)
    x = torch.full((3,), 2.0)
    work = group.allreduce([x])
    work.get_future().wait()
    assert work.is_completed() and x.tolist() == [2.0, 2.0, 2.0]
    assert group.size() == 1 and group.rank() == 0
