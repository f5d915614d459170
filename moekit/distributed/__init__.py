"""Run a function on several torch.distributed ranks: from a notebook, a test, or torchrun.

One host, no torchrun (tests, notebooks, a laptop)::

    from moekit.distributed import launch
    results = launch(moekit.ep.run_rank, world_size=2, args=(config,))   # one result per rank

``launch`` spawns ``world_size`` processes, joins them through a TCP store that listens on a
free loopback port only (127.0.0.1, never every interface), calls ``fn(rank, world_size, *args)``
in each, and returns their return values in rank order (tensors come back on the CPU). With
gloo, the ranks' own data listeners are bound to the loopback interface too
(``GLOO_SOCKET_IFNAME=lo`` in the children), not to the address the hostname resolves to (a LAN
address on most hosts), so no socket that ``launch`` opens is reachable from the network; a test
checks every listener of a launch whose hostname resolves elsewhere. With NCCL, NCCL's own
bootstrap picks its interface (``NCCL_SOCKET_IFNAME``); that is not covered. When a rank fails
(raises, or exits without reporting a result, with any exit code), the others get a short grace
to report, then are stopped, and the caller sees the first failure's traceback. ``fn`` must be
importable (defined in a module, not in a notebook cell), because spawned processes find it by name.

Several hosts (or one host with torchrun), e.g. 2 nodes with 8 GPUs each; run on every node,
with ``--node-rank 0`` on ``host0`` and ``--node-rank 1`` on the other::

    torchrun --nnodes 2 --nproc-per-node 8 --node-rank 0 \\
             --master-addr host0 --master-port 29500 \\
             -m moekit.ep --M 256 --E 64 --topk 8 --chunk-size 64

Under torchrun, torch's own rendezvous applies: rank 0 hosts a TCPStore on ``--master-port`` that
the other hosts must reach, so it listens beyond loopback; keep that port inside your cluster.

Inside such a process call :func:`init_from_env` (``moekit.ep`` does) to join the group that
torchrun describes in ``RANK``, ``WORLD_SIZE``, ``LOCAL_RANK``, ``MASTER_ADDR``/``MASTER_PORT``.

Backends: ``"gloo"`` on CPU tensors (the Triton interpreter runs the kernels), ``"nccl"`` on
GPUs (one GPU per rank). ``None`` picks NCCL when moekit runs on CUDA and there is a GPU for
every rank, else gloo. For NCCL the NVLink-multicast features stay off
(``NCCL_NVLS_ENABLE=0``, ``TORCH_SYMM_MEM_DISABLE_MULTICAST=1``), which some shared machines
require.

- :mod:`moekit.distributed.process_group`: the backend, and joining the group torchrun describes;
- :mod:`moekit.distributed.launcher`: :func:`launch`, the ranks of one host as fresh processes;
- :mod:`moekit.distributed.collectives`: :func:`gather_objects`, :func:`gather_traces`, :func:`to_cpu`.
"""

from moekit.distributed.collectives import gather_objects, gather_traces, to_cpu
from moekit.distributed.launcher import launch
from moekit.distributed.process_group import default_backend, init_from_env, torchrun_env

__all__ = ["default_backend", "gather_objects", "gather_traces", "init_from_env", "launch", "to_cpu", "torchrun_env"]
