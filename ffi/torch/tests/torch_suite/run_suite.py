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

from torch.testing._internal.common_utils import run_tests  # noqa: E402
from torch.testing._internal.distributed.distributed_test import (  # noqa: E402
    DistributedTest,
    TestDistBackend,
)


class TestDistBackendWithSpawn(TestDistBackend, DistributedTest._DistTestBase):
    """Each test in `WORLD_SIZE` spawned processes."""

    def setUp(self):
        super().setUp()
        self._spawn_processes()


if BACKEND == "roccl":
    for _name, _why in KNOWN.items():
        setattr(
            TestDistBackendWithSpawn,
            _name,
            unittest.skip(f"not roccl's: {_why}")(getattr(TestDistBackendWithSpawn, _name)),
        )


if __name__ == "__main__":
    run_tests()
