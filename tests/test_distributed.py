"""moekit.distributed: launch, failures with the failing rank's traceback, init_from_env, gather."""

from __future__ import annotations

import os
import time
from dataclasses import dataclass

import pytest
import torch
import torch.distributed as dist

from moekit.distributed import gather_objects, gather_traces, init_from_env, launch, to_cpu
from moekit.errors import DistributedError, InvalidInputError
from moekit.testing import expect_raises

pytestmark = pytest.mark.distributed


# Rank functions live at module level: spawned ranks import them by name.
class FakeTrace:
    def __init__(self, rank):
        self.rank = rank

    def counts_matrix(self):
        return torch.full((self.rank + 1, 3), self.rank, dtype=torch.int64)


def sum_ranks(rank, world, offset):
    t = torch.tensor([rank + offset])
    dist.all_reduce(t)
    gathered = gather_traces(FakeTrace(rank))
    return {
        "rank": rank,
        "world": world,
        "sum": t,
        "interpreter": os.environ.get("TRITON_INTERPRET"),
        "gathered": gathered,
    }


def fail_on_one(rank, world):
    if rank == 1:
        raise ValueError("rank one has a bad day")
    dist.barrier()  # rank 0 waits here: launch must not hang on it
    return rank


def die_on_zero(rank, world):
    if rank == 0:
        os._exit(7)
    return rank


def exit_quietly_on_one(rank, world):
    if rank == 1:
        os._exit(0)  # no report, no error: only the exit code says it is gone
    time.sleep(45)  # works on, outside any collective (which would notice the closed connection)
    return rank


def gather_alone(rank, world):
    """Rank 1 never joins the gather (it works on, then returns): rank 0 must not wait past its timeout."""
    if rank == 1:
        time.sleep(8)
        return None
    start = time.monotonic()
    try:
        gather_objects({"rank": rank}, timeout_s=2)
        return "no error"
    except DistributedError as e:
        return f"{type(e).__name__} {'timed out' in str(e)} {time.monotonic() - start:.1f}"


def hang_on_one(rank, world):
    if rank == 1:
        time.sleep(600)
    dist.barrier()
    return rank


def fail_at_once_while_the_other_works(rank, world):
    if rank == 0:
        raise RuntimeError("rank zero fails at once")
    time.sleep(45)  # works on, outside any collective
    return rank


def _listening(pids) -> list[str]:
    """Local addresses of the LISTEN sockets that processes ``pids`` hold (Linux /proc)."""
    inodes = set()
    for pid in pids:
        for fd in os.listdir(f"/proc/{pid}/fd"):
            target = os.readlink(f"/proc/{pid}/fd/{fd}") if os.path.islink(f"/proc/{pid}/fd/{fd}") else ""
            if target.startswith("socket:["):
                inodes.add(target[8:-1])
    found = []
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        for line in open(table).read().splitlines()[1:]:
            cols = line.split()
            if cols[3] == "0A" and cols[9] in inodes:  # 0A: LISTEN
                found.append(cols[1].split(":")[0])
    return found


def listening_addresses(rank, world):
    dist.barrier()  # every rank's gloo sockets exist, and the parent's store
    addresses = _listening([os.getpid(), os.getppid()])
    dist.barrier()
    return addresses


@pytest.mark.skipif(not os.path.exists("/proc/net/tcp"), reason="reads Linux's /proc/net/tcp")
def test_nothing_listens_beyond_loopback():
    # The rendezvous store once listened on every interface (*:PORT) while gloo kept to loopback.
    loopback = {"0100007F", "00000000000000000000000001000000"}  # 127.0.0.1, ::1 as /proc writes them
    results = launch(listening_addresses, 2, backend="gloo", timeout_s=60)
    assert all(results), "found no listening socket: the check itself is broken"
    assert all(set(r) <= loopback for r in results), results


def test_a_failure_does_not_wait_for_the_slowest_rank():
    start = time.monotonic()
    with expect_raises(DistributedError, match="rank 0 of 2 failed") as caught:
        launch(fail_at_once_while_the_other_works, 2, backend="gloo", timeout_s=120)
    assert "rank zero fails at once" in caught.message
    assert time.monotonic() - start < 20, "launch waited for the rank that was still working"


def test_launch_returns_every_rank_in_order_and_gathers():
    results = launch(sum_ranks, 2, backend="gloo", args=(10,), timeout_s=60)
    assert [r["rank"] for r in results] == [0, 1]
    assert all(r["world"] == 2 and r["sum"].item() == 21 for r in results)
    assert all(r["interpreter"] == "1" for r in results)  # children import moekit before kernels
    for r in results:  # gather_traces: every rank's [chunks, E_local] counts, on every rank
        assert [tuple(c.shape) for c in r["gathered"]] == [(1, 3), (2, 3)]
        assert r["gathered"][1].unique().tolist() == [1]


def test_failing_rank_traceback_reaches_the_caller():
    start = time.monotonic()
    with expect_raises(DistributedError, match="rank 1 of 2 failed") as caught:
        launch(fail_on_one, 2, backend="gloo", timeout_s=60)
    assert "ValueError: rank one has a bad day" in caught.message
    assert "fail_on_one" in caught.message  # the traceback, not just the message
    assert time.monotonic() - start < 30  # did not wait for rank 0's barrier to time out


def test_rank_that_dies_without_a_word():
    with expect_raises(DistributedError, match="rank 0 .*exited with code 7"):
        launch(die_on_zero, 2, backend="gloo", timeout_s=60)


def test_rank_that_exits_with_code_0_without_a_word():
    # Before: noticed only at the deadline (60 s here), while a non-zero exit code got the grace.
    start = time.monotonic()
    with expect_raises(DistributedError, match="rank 1 exited with code 0 without reporting a result"):
        launch(exit_quietly_on_one, 2, backend="gloo", timeout_s=60)
    assert time.monotonic() - start < 15, f"noticed after {time.monotonic() - start:.1f} s"


def test_gather_objects_waits_at_most_its_timeout():
    got = launch(gather_alone, 2, backend="gloo", timeout_s=60)
    assert got[1] is None and got[0].startswith("DistributedError True"), got
    assert float(got[0].split()[-1]) < 4, got  # timeout_s=2, plus a little


def test_hanging_rank_times_out():
    start = time.monotonic()
    with expect_raises(DistributedError):
        launch(hang_on_one, 2, backend="gloo", timeout_s=5)
    assert time.monotonic() - start < 30


def test_bad_arguments():
    with expect_raises(InvalidInputError, match="world_size"):
        launch(sum_ranks, 0)
    for timeout in (0, -1, "5", True):
        with expect_raises(InvalidInputError, match="timeout_s"):
            launch(sum_ranks, 1, timeout_s=timeout)
    with expect_raises(InvalidInputError, match="backend"):
        launch(sum_ranks, 1, backend="mpi")
    if torch.cuda.device_count() < 64:
        with expect_raises(InvalidInputError, match="one GPU per rank"):
            launch(sum_ranks, 64, backend="nccl")


def test_args_that_do_not_pickle_are_named_before_any_rank_starts():
    # Issue 25, item 15: a raw TypeError from multiprocessing.
    import threading

    with expect_raises(InvalidInputError, match="args must pickle .*cannot pickle '_thread.lock'"):
        launch(sum_ranks, 2, args=(threading.Lock(),))
    with expect_raises(InvalidInputError, match="args must be a tuple"):
        launch(sum_ranks, 2, args=[1])
    assert not [p for p in __import__("multiprocessing").active_children() if p.is_alive()]


def test_function_must_be_found_by_name():
    with expect_raises(InvalidInputError, match="module-level"):
        launch(lambda rank, world: rank, 1)


def test_init_from_env_without_torchrun_is_one_process(monkeypatch):
    monkeypatch.delenv("RANK", raising=False)
    monkeypatch.delenv("WORLD_SIZE", raising=False)
    assert init_from_env() == (0, 1)
    assert not dist.is_initialized()


def test_init_from_env_joins_a_torchrun_style_group(monkeypatch):
    # What torchrun exports for a one-process job.
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    for k, v in {
        "RANK": "0",
        "WORLD_SIZE": "1",
        "LOCAL_RANK": "0",
        "MASTER_ADDR": "127.0.0.1",
        "MASTER_PORT": str(port),
    }.items():
        monkeypatch.setenv(k, v)
    try:
        assert init_from_env(backend="gloo", timeout_s=30) == (0, 1)
        assert dist.get_backend() == "gloo"
        assert init_from_env() == (0, 1)  # a second call is harmless
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


@dataclass
class _Box:
    t: torch.Tensor
    items: list


def test_results_move_to_cpu_recursively():
    x = torch.ones(2, requires_grad=True)
    out = to_cpu({"a": [x * 2, (x,)], "b": _Box(x, [x]), "c": 3})
    assert not out["a"][0].requires_grad and out["c"] == 3
    assert isinstance(out["b"], _Box) and out["b"].items[0].device.type == "cpu"


@pytest.mark.interpreter
def test_ep_cli_runs_every_rank_and_prints_counts(capsys):
    from moekit.ep import main

    argv = [
        "--world-size",
        "2",
        "--M",
        "9,0",
        "--E",
        "4",
        "--topk",
        "2",
        "--K",
        "32",
        "--N",
        "32",
        "--chunk-size",
        "4",
        "--timeout",
        "120",
    ]
    assert main(argv) == 0
    out = capsys.readouterr().out
    assert "rank 1: M=0 tokens" in out and "chunk 0 [triton]" in out and "MISMATCH" not in out


def _own_non_loopback_address() -> str | None:
    """An IPv4 address of one of this host's interfaces outside 127/8 (Linux's /proc/net/fib_trie)."""
    try:
        lines = open("/proc/net/fib_trie").read().splitlines()
    except OSError:
        return None
    for above, line in zip(lines, lines[1:], strict=False):
        address = above.strip().removeprefix("|-- ")
        if line.strip() == "/32 host LOCAL" and not address.startswith("127."):
            return address
    return None


_PROBE = """
import json, socket, sys
sys.path.insert(0, {tests!r})
import test_distributed as td
from moekit.distributed import launch
listening = launch(td.listening_addresses, 2, backend="gloo", timeout_s=60)
print(json.dumps({{"resolved": socket.gethostbyname(socket.gethostname()), "listening": listening}}))
"""


def _can_unshare() -> bool:
    import shutil
    import subprocess

    if shutil.which("unshare") is None or os.geteuid() != 0:
        return False
    return subprocess.run(["unshare", "--uts", "--mount", "true"], capture_output=True).returncode == 0


@pytest.mark.skipif(not os.path.exists("/proc/net/tcp"), reason="reads Linux's /proc/net/tcp")
def test_gloo_listens_on_loopback_when_the_hostname_resolves_elsewhere(tmp_path):
    """gloo binds the address the hostname resolves to unless told an interface. Here the launch
    runs in its own UTS and mount namespaces (root, ``unshare``), where the hostname resolves to
    one of this host's non-loopback addresses: every listener must still be on loopback."""
    import json
    import subprocess
    import sys

    address = _own_non_loopback_address()
    if address is None or not _can_unshare():
        pytest.skip("needs a non-loopback IPv4 address, root and unshare(1) with UTS + mount namespaces")
    hosts = tmp_path / "hosts"
    hosts.write_text(f"{address} moekit-probe-host\n127.0.0.1 localhost\n")
    code = _PROBE.format(tests=os.path.dirname(__file__))
    script = f'hostname moekit-probe-host && mount --bind "{hosts}" /etc/hosts && exec "$0" -c "$1"'
    done = subprocess.run(["unshare", "--uts", "--mount", "sh", "-c", script, sys.executable, code],
                          capture_output=True, text=True, timeout=120, env=os.environ.copy())  # fmt: skip
    assert done.returncode == 0, done.stdout + done.stderr
    got = json.loads(done.stdout.strip().splitlines()[-1])
    assert got["resolved"] == address, got  # the setup works: the hostname resolves beyond loopback
    loopback = {"0100007F", "00000000000000000000000001000000"}
    assert all(got["listening"]) and all(set(r) <= loopback for r in got["listening"]), got


@pytest.mark.parametrize("bad", [float("inf"), 1e10, 1e20, float("nan"), 0, -1, True, "30"])
def test_every_timeout_is_a_number_of_seconds_or_a_named_error(bad):
    """inf and values past what c10d's clock holds are refused by name at construction (they used to
    pass and then fail inside torch: OverflowError, DistNetworkError); None keeps its meaning where
    documented (the process group's own timeout)."""
    from moekit.distributed.process_group import MAX_TIMEOUT_S, check_timeout
    from moekit.prepare_finalize import All2AllPrepareFinalize

    with expect_raises(InvalidInputError, match="timeout_s must be a number of seconds"):
        launch(abs, 1, timeout_s=bad)
    with expect_raises(InvalidInputError, match="timeout_s must be a number of seconds"):
        All2AllPrepareFinalize(timeout_s=bad)
    All2AllPrepareFinalize(timeout_s=None)
    check_timeout(MAX_TIMEOUT_S)
    with expect_raises(InvalidInputError, match="or None"):
        check_timeout(bad, none_means="the group's own timeout")
