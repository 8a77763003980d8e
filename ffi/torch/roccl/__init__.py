"""roccl as a torch.distributed backend, and roccl's collectives for other Python programs.

    import roccl                       # registers the backend "roccl" (CPU tensors)
    torch.distributed.init_process_group("roccl")

    uid = roccl.unique_id()            # one process; pass the bytes to every rank
    comm = roccl.Communicator(uid, nranks, rank)
    comm.all_reduce(numpy_array)       # numpy arrays, other buffers, CPU tensors

    roccl.all_reduce(tensor, group=g)  # a blocking all-reduce without torch.distributed's
                                       # work objects and hooks (torch.ops.roccl.all_reduce_)
    roccl.direct_all_reduce()          # torch.distributed.all_reduce's blocking calls on
                                       # roccl groups take that path (ROCCL_TORCH_DIRECT=1)

With this package installed, ``init_process_group("roccl")`` also works without the import:
torch finds the backend through the entry point ``torch.distributed.backends``.
"""

import os

import torch  # noqa: F401  (loads libtorch before the extension)
import torch.distributed as dist

from . import _C

__all__ = [
    "register",
    "all_reduce",
    "direct_all_reduce",
    "Options",
    "ProcessGroupRoccl",
    "Communicator",
    "unique_id",
    "env_from_launcher",
    "nccl_library_path",
    "net_plugin_path",
]

ProcessGroupRoccl = _C.ProcessGroupRoccl
Communicator = _C.Communicator
unique_id = _C.unique_id


class Options:
    """Options of a roccl process group, given as ``pg_options`` to
    ``dist.init_process_group("roccl", ...)`` or ``dist.new_group(...)``.

    ``deterministic``: every reducing collective of the group returns bitwise one result
    for its rank count and data type, whatever algorithm, network and settings run it (as
    ``ROCCL_DETERMINISTIC=1``, which applies to every group); see docs/DETERMINISM.md."""

    def __init__(self, deterministic=False):
        self.deterministic = bool(deterministic)

    def __repr__(self):
        return f"roccl.Options(deterministic={self.deterministic})"


def _create_backend(opts, backend_options=None):
    """The creator torch calls for each process group of backend "roccl": rank 0 of the
    group publishes roccl's unique id through the group's Store, the others read it; the
    group's timeout is roccl's timeout; ``backend_options`` (``pg_options``) is an
    :class:`Options` or None."""
    if backend_options is not None and not isinstance(backend_options, Options):
        raise TypeError(
            f"roccl: pg_options must be a roccl.Options, not {type(backend_options).__name__}"
        )
    deterministic = backend_options is not None and backend_options.deterministic
    return _C.ProcessGroupRoccl(
        opts.store, opts.group_rank, opts.group_size, opts.timeout, deterministic
    )


# Each launcher's variable for a process's rank on its node.
_LOCAL_RANK = ("SLURM_LOCALID", "OMPI_COMM_WORLD_LOCAL_RANK", "MPI_LOCALRANKID", "PMI_LOCAL_RANK")


def env_from_launcher():
    """Let ``init_process_group("roccl")`` (``env://``) run under ``srun`` or ``mpirun``, not
    only under torchrun: fill in RANK, WORLD_SIZE, LOCAL_RANK, MASTER_ADDR and MASTER_PORT
    where they are unset, from the launcher's variables, by roccl's rules (docs/TORCH.md):
    under Slurm rank 0's host is the first host of the step's node list and the port
    ``29400 + (SLURM_JOB_ID + SLURM_STEP_ID) % 1000``, the same on every task; set
    MASTER_PORT yourself to choose another. Returns the variables it set. Under torchrun it
    sets nothing."""
    import os

    info = _C._launcher_env()
    if info["launcher"] == "torchrun":
        return {}
    want = {"RANK": str(info["rank"]), "WORLD_SIZE": str(info["nranks"])}
    if info["host"]:
        want["MASTER_ADDR"] = info["host"]
        want["MASTER_PORT"] = str(info["port"])
    local = next((os.environ[v] for v in _LOCAL_RANK if os.environ.get(v)), None)
    if local is not None:
        want["LOCAL_RANK"] = local
    done = {k: v for k, v in want.items() if not os.environ.get(k)}
    if "MASTER_ADDR" not in want and not os.environ.get("MASTER_ADDR"):
        raise RuntimeError(
            f"roccl: the {info['launcher']} environment names no host for rank 0: set "
            "MASTER_ADDR and MASTER_PORT (or ROCCL_ROOT=host:port)"
        )
    os.environ.update(done)
    return done


def _lib(name):
    from pathlib import Path

    path = Path(__file__).resolve().parent / "lib" / name
    if not path.exists():
        raise FileNotFoundError(
            f"roccl: {path} is missing: reinstall the package (pip install "
            "--no-build-isolation ./ffi/torch builds it)"
        )
    return str(path)


def nccl_library_path():
    """The path of ``libroccl-nccl.so``, roccl under NCCL's names and ABI: what vLLM's
    ``VLLM_NCCL_SO_PATH`` (or any program that loads NCCL by path) can point at."""
    return _lib("libroccl-nccl.so")


def net_plugin_path(rccl=False):
    """The path of roccl's network plugin for NCCL (``libnccl-net-roccl.so``) or, with
    ``rccl=True``, for RCCL (``librccl-net-roccl.so``): set ``NCCL_NET_PLUGIN`` to it (docs/PLUGIN.md)."""
    return _lib("librccl-net-roccl.so" if rccl else "libnccl-net-roccl.so")


@torch.library.register_fake("roccl::all_reduce_")
def _all_reduce_fake(tensor, group_name, op=0):
    """What torch.compile's tracing sees of torch.ops.roccl.all_reduce_: the tensor is
    written in place, nothing is returned."""
    return None


_RED_OP_TYPE = dist.ReduceOp.RedOpType
_plain_all_reduce = dist.all_reduce


def all_reduce(tensor, op=dist.ReduceOp.SUM, group=None):
    """All-reduce ``tensor`` in place over ``group`` (default: the world) and return when it is
    done, as ``torch.distributed.all_reduce(tensor, op, group)`` does, but on a roccl group
    with nothing queued the call runs on this thread at once, without torch.distributed's
    Python checks, its dispatch to the backend, a work object or the hooks torch attaches
    (its flight recorder does not see the call). Under ``torch.compile`` (``fullgraph=True``
    too) it is the operator ``torch.ops.roccl.all_reduce_``; there pass ``group`` as the
    group's name (``group.group_name``) if the compiler cannot take the group object.
    ``op``: a ``torch.distributed.ReduceOp`` other than PREMUL_SUM. A group whose backend is
    not roccl is served by its own all-reduce."""
    if torch.compiler.is_compiling() or isinstance(group, str):
        if isinstance(group, str):
            name = group
        else:
            name = (group if group is not None else dist.group.WORLD).group_name
        torch.ops.roccl.all_reduce_(tensor, name, int(op))
        return
    pg = group if group is not None else dist.group.WORLD
    if pg is dist.GroupMember.NON_GROUP_MEMBER:
        return  # not a member: as torch.distributed.all_reduce, nothing to do
    if not _C._all_reduce_direct(tensor, pg, int(op)):
        _plain_all_reduce(tensor, op, group)


def _direct(tensor, op=dist.ReduceOp.SUM, group=None, async_op=False):
    """torch.distributed.all_reduce once ``direct_all_reduce()`` is on: a blocking call on a
    CPU tensor of a roccl group runs as :func:`all_reduce` does; anything else (an async
    call, a group of another backend, a tensor that needs grad or is complex, a ReduceOp
    instance such as PREMUL_SUM's, tracing by torch.compile) through torch's own."""
    if (
        async_op
        or torch.compiler.is_compiling()
        or not tensor.is_cpu
        or tensor.requires_grad
        or tensor.is_complex()
        or type(op) is not _RED_OP_TYPE
    ):
        return _plain_all_reduce(tensor, op, group, async_op)
    pg = group if group is not None else dist.group.WORLD
    if pg is None or pg is dist.GroupMember.NON_GROUP_MEMBER or not _C._all_reduce_direct(
        tensor, pg, int(op)
    ):
        return _plain_all_reduce(tensor, op, group, async_op)
    return None


def direct_all_reduce(enable=True):
    """Make ``torch.distributed.all_reduce`` take :func:`all_reduce`'s path for its blocking
    calls on roccl groups (``enable=False`` restores torch's own), so that model code that
    calls ``torch.distributed.all_reduce`` (Hugging Face transformers' tensor parallelism,
    for one) gets it unchanged. ``ROCCL_TORCH_DIRECT=1`` turns it on when roccl is imported
    (which ``init_process_group("roccl")`` does). What it changes: torch's flight recorder
    and hooks do not see those calls, and ``TORCH_DISTRIBUTED_DEBUG=DETAIL``'s checks of
    them are skipped (the group is then wrapped, and torch's path is taken)."""
    dist.all_reduce = _direct if enable else _plain_all_reduce


def register():
    """Register the backend "roccl" for CPU tensors (done on import; safe to call again)."""
    if "ROCCL" in dist.Backend._plugins:
        return
    dist.Backend.register_backend("roccl", _create_backend, extended_api=True, devices=["cpu"])


register()
if os.environ.get("ROCCL_TORCH_DIRECT", "0") not in ("", "0"):
    direct_all_reduce()
