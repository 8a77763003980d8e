"""roccl as a torch.distributed backend.

    import roccl                       # registers the backend "roccl" (CPU tensors)
    torch.distributed.init_process_group("roccl")

With this package installed, ``init_process_group("roccl")`` also works without the import:
torch finds the backend through the entry point ``torch.distributed.backends``.
"""

import torch  # noqa: F401  (loads libtorch before the extension)
import torch.distributed as dist

from . import _C

__all__ = ["register", "ProcessGroupRoccl"]

ProcessGroupRoccl = _C.ProcessGroupRoccl


def _create_backend(opts, backend_options=None):
    """The creator torch calls for each process group of backend "roccl": rank 0 of the
    group publishes roccl's unique id through the group's Store, the others read it; the
    group's timeout is roccl's timeout."""
    return _C.ProcessGroupRoccl(opts.store, opts.group_rank, opts.group_size, opts.timeout)


def register():
    """Register the backend "roccl" for CPU tensors (done on import; safe to call again)."""
    if "ROCCL" in dist.Backend._plugins:
        return
    dist.Backend.register_backend("roccl", _create_backend, extended_api=True, devices=["cpu"])


register()
