"""What torch's Store holds of a roccl process group: torch's TCPStore does not authenticate
its clients, so the id roccl publishes there must carry no secret. The secret comes from
ROCCL_JOB_SECRET on every rank (docs/TORCH.md, docs/SECURITY.md)."""

import os

import tempfile

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from common import run

SECRET = "00112233445566778899aabbccddeeff"


def _rank(rank, world, path, env):
    os.environ.update(env)
    import roccl  # noqa: F401  (registers the backend)

    store = dist.FileStore(path, world)
    dist.init_process_group("roccl", store=store, rank=rank, world_size=world)
    sums(rank, world)
    if rank == 0:
        # A FileStore keeps keys and values as they are (and removes its file when the last
        # rank leaves): keep what a Store reader could read.
        with open(path, "rb") as f, open(path + ".seen", "wb") as out:
            out.write(f.read())
    dist.barrier()
    dist.destroy_process_group()


def test_the_store_holds_only_the_public_id():
    with tempfile.TemporaryDirectory() as d:
        path = os.path.join(d, "store")
        ctx = mp.start_processes(_rank, args=(2, path, {"ROCCL_JOB_SECRET": SECRET}),
                                 nprocs=2, join=False, start_method="fork")
        while not ctx.join(timeout=60):
            pass
        raw = open(path + ".seen", "rb").read()
    at = raw.find(b"RCID")
    assert at >= 0, "roccl's unique id is not in the Store"
    uid = raw[at:at + 128]
    assert uid[5] & 1 == 0, "the id in the Store says it carries a secret"
    assert uid[32:48] == bytes(16), "the id in the Store carries secret bytes"
    assert bytes.fromhex(SECRET) not in raw
    assert raw.find(b"RCID", at + 1) < 0, "a second id in the Store"


def sums(rank, world):
    t = torch.ones(3)
    dist.all_reduce(t)
    assert torch.equal(t, torch.full((3,), float(world)))


def test_ranks_with_another_job_secret_are_refused():
    # Rank 1's secret differs: the root refuses it, naming the secret.
    with pytest.raises(Exception) as e:
        run(2, sums, env={"ROCCL_JOB_SECRET": SECRET},
            per_rank_env={1: {"ROCCL_JOB_SECRET": SECRET[::-1]}}, timeout_s=10, limit=60)
    assert "ROCCL_JOB_SECRET" in str(e.value), str(e.value)


def test_encryption_without_a_job_secret_is_refused():
    with pytest.raises(Exception) as e:
        run(2, sums, env={"ROCCL_ENCRYPT": "1", "ROCCL_JOB_SECRET": ""}, timeout_s=10, limit=60)
    assert "no secret" in str(e.value), str(e.value)


def test_an_encrypted_group_with_a_job_secret_runs():
    run(2, sums, env={"ROCCL_ENCRYPT": "1", "ROCCL_JOB_SECRET": SECRET})


if __name__ == "__main__":
    os.sys.exit(pytest.main([__file__, "-q"]))
