"""A multi-node Ray cluster on this machine, hosted by a process of its own.

``ray.cluster_utils.Cluster`` starts every Ray process with ``Popen(preexec_fn=...)``, a fork of the
process that calls it. In the test process, where JAX's threads run once a JAX test has, that fork
copies their locks mid-use (and JAX warns); a host started by spawn runs no thread of ours when it
forks. The test process stays the driver (``ray.init(address=...)``).
"""

from __future__ import annotations

import multiprocessing as mp


def _host(conn, node_args: dict, workers: int) -> None:
    from ray.cluster_utils import Cluster

    cluster = Cluster(initialize_head=True, head_node_args=node_args)
    nodes = {}

    def add() -> str:
        node = cluster.add_node(**node_args)
        nodes[node.node_id] = node
        return node.node_id

    added = [add() for _ in range(workers)]
    cluster.wait_for_nodes()
    conn.send((cluster.address, added))
    while True:
        command, arg = conn.recv()
        if command == "add":
            reply = add()
            cluster.wait_for_nodes()
        elif command == "remove":
            cluster.remove_node(nodes.pop(arg), allow_graceful=False)
            reply = None
        else:
            cluster.shutdown()
            conn.send(None)
            return
        conn.send(reply)


class HostedCluster:
    """A head and ``workers`` worker nodes started with ``node_args``; ``workers`` lists their node ids."""

    def __init__(self, node_args: dict, workers: int):
        ctx = mp.get_context("spawn")
        self._conn, theirs = ctx.Pipe()
        self._proc = ctx.Process(target=_host, args=(theirs, node_args, workers), daemon=True)
        self._proc.start()
        theirs.close()
        self.address, self.workers = self._conn.recv()

    def _ask(self, command: str, arg=None):
        self._conn.send((command, arg))
        return self._conn.recv()

    def add_node(self) -> str:
        """Start one more worker node; its node id."""
        return self._ask("add")

    def remove_node(self, node_id: str) -> None:
        """Kill the worker node ``node_id`` at once (no graceful shutdown), as a lost machine."""
        self._ask("remove", node_id)

    def shutdown(self) -> None:
        self._ask("stop")
        self._proc.join(60)
