"""torch's own distributed test suite (the one torch runs for its backends), with roccl.

torch ships it in the wheel: `torch.testing._internal.distributed.distributed_test`
(`DistributedTest._DistTestBase`, run with `TestDistBackend`). This drives it the way torch's
`test/distributed/test_distributed_spawn.py` does: each test spawns `WORLD_SIZE` processes
that join through a file store and run the test body; `BACKEND` names the backend. roccl is
declared in `DistTestCases.backend_feature` for the CPU features it has (DDP, subgroups, a
backend registered by a plugin), so the tests for them run instead of being skipped.

    BACKEND=roccl WORLD_SIZE=3 python run_suite.py [unittest arguments, e.g. -k all_reduce]
"""

import os
import sys
import tempfile
import unittest

# torch's test harness reads a set CI variable (any value) as "torch's own CI": it then writes
# JUnit XML through `xmlrunner`, which the wheel does not bring, and looks up torch's lists of
# disabled and slow tests. This is not torch's CI, so the variable goes before torch is imported.
os.environ.pop("CI", None)
os.environ.setdefault("BACKEND", "roccl")
os.environ.setdefault("WORLD_SIZE", "2")
if "TEMP_DIR" not in os.environ:
    os.environ["TEMP_DIR"] = tempfile.mkdtemp(prefix="roccl-torch-suite-")

BACKEND = os.environ["BACKEND"]
if BACKEND == "roccl":
    import roccl  # noqa: F401  (registers the backend "roccl")

from torch.testing._internal.common_distributed import DistTestCases  # noqa: E402

if BACKEND == "roccl":
    for feature in ("ddp", "subgroup", "plugin"):
        DistTestCases.backend_feature[feature].add("roccl")
    # torch's own declaration of a backend without receives from any source (NCCL's too):
    # roccl matches every message to a named peer (docs/TORCH.md).
    DistTestCases.skip_collective["sendrecv anysource"].add("roccl")

# Tests that fail for a reason outside roccl (docs/TORCH.md), skipped with that reason.
KNOWN = {
    "test_ddp_logging_data_cpu": (
        "torch names every backend registered by Backend.register_backend 'custom' in DDP's "
        "logging data (C++ ProcessGroup::getBackendName), where the test expects 'roccl'"
    ),
}

# Tests the suite keeps to Gloo by its name, whose bodies need nothing Gloo has and roccl
# lacks: they run with roccl too.
FOR_GLOO_ONLY = [
    "test_accumulate_gradients_no_sync",
    "test_accumulate_gradients_no_sync_allreduce_hook",
    "test_accumulate_gradients_no_sync_allreduce_with_then_hook",
    "test_accumulate_gradients_no_sync_grad_is_view",
    "test_all_gather_object_default_pg",
    "test_all_gather_object_subgroup",
    "test_all_reduce_coalesced_full_group_max",
    "test_all_reduce_coalesced_full_group_min",
    "test_all_reduce_coalesced_full_group_product",
    "test_all_reduce_coalesced_full_group_sum",
    "test_all_reduce_coalesced_max",
    "test_all_reduce_coalesced_min",
    "test_all_reduce_coalesced_product",
    "test_all_reduce_coalesced_sum",
    "test_barrier_timeout_full_group",
    "test_batch_isend_irecv_gloo",
    "test_batch_isend_irecv_gloo_tags",
    "test_get_future",
    "test_grads_same_across_ranks_with_no_sync",
    "test_monitored_barrier_gloo",
    "test_monitored_barrier_gloo_rank_0_timeout",
    "test_monitored_barrier_gloo_subgroup",
    "test_monitored_barrier_failure_order",
    "test_scatter_object_list",
]

# Of those, the tests whose bodies pick their CPU code by the backend's name (`if BACKEND ==
# "gloo"`, with no branch for other CPU backends): their bodies run that branch, on roccl
# (the group is roccl's; only the test's own choice of code reads "gloo").
CPU_BRANCH_NAMED_GLOO = [
    "test_accumulate_gradients_no_sync",
    "test_accumulate_gradients_no_sync_allreduce_hook",
    "test_accumulate_gradients_no_sync_allreduce_with_then_hook",
    "test_accumulate_gradients_no_sync_grad_is_view",
]

from torch.testing._internal.common_utils import run_tests  # noqa: E402
from torch.testing._internal.distributed import distributed_test  # noqa: E402
from torch.testing._internal.distributed.distributed_test import (  # noqa: E402
    DistributedTest,
    TestDistBackend,
)


class TestDistBackendWithSpawn(TestDistBackend, DistributedTest._DistTestBase):
    """Each test in `WORLD_SIZE` spawned processes."""

    def setUp(self):
        super().setUp()
        self._spawn_processes()

    def run_test(self, test_name, parent_pipe):
        # In the rank's process, after the group was made with BACKEND.
        if BACKEND == "roccl" and test_name in CPU_BRANCH_NAMED_GLOO:
            distributed_test.BACKEND = "gloo"
        super().run_test(test_name, parent_pipe)


def run_where_gloo_runs(cls, name):
    """Clear the skips that keep test `name` to Gloo by the backend's name (a decorator such
    as ``require_backend_is_available({"gloo"})``), wherever they sit on its chain of
    decorated functions; a skip for any other reason (no GPU) stays."""
    f = getattr(cls, name)
    while f is not None:
        why = getattr(f, "__dict__", {}).get("__unittest_skip_why__", "")
        if "gloo" in why.lower() and "cuda" not in why.lower():
            del f.__unittest_skip__
            del f.__unittest_skip_why__
        f = getattr(f, "__wrapped__", None)


if BACKEND == "roccl":
    for _name in FOR_GLOO_ONLY:
        run_where_gloo_runs(TestDistBackendWithSpawn, _name)
    for _name, _why in KNOWN.items():
        setattr(
            TestDistBackendWithSpawn,
            _name,
            unittest.skip(f"not roccl's: {_why}")(getattr(TestDistBackendWithSpawn, _name)),
        )


if __name__ == "__main__":
    run_tests()
