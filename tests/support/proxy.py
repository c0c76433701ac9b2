"""nginx in front of Flowcast replicas, run from the repository's own configuration.

``deploy/nginx.conf.template`` is the file compose mounts into the official nginx image;
here the same file is rendered with loopback addresses and included in a minimal main
configuration whose paths (pid, temporary files, logs) all live under one directory.
The access log (the template sends it to stdout) names the replica behind each request.
"""

from __future__ import annotations

import asyncio
import os
import re
import signal
import string
import subprocess
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from app.embedded import die_with_parent
from app.settings import Settings
from tests.support.api import until
from tests.support.ports import own_port
from tests.support.servers import ROOT

NGINX = Path("/usr/sbin/nginx")
TEMPLATE = ROOT / "deploy" / "nginx.conf.template"
DEFAULT_MAX_BODY_BYTES: int = Settings.model_fields["max_body_bytes"].default

MAIN = """\
daemon off;
worker_processes 1;
pid {dir}/nginx.pid;
error_log {dir}/error.log info;
{user}
events {{ worker_connections 512; }}
http {{
    client_body_temp_path {dir}/client_body;
    proxy_temp_path {dir}/proxy;
    fastcgi_temp_path {dir}/fastcgi;
    uwsgi_temp_path {dir}/uwsgi;
    scgi_temp_path {dir}/scgi;
    include {dir}/flowcast.conf;
}}
"""

_LINE = re.compile(
    r'"(?P<method>\S+) (?P<path>\S+) [^"]*" (?P<status>\d+) .* '
    r'upstream="(?P<upstream>[^"]*)" upstream_status="(?P<upstream_status>[^"]*)"'
)


def render(*, listen: str, replicas: tuple[str, str], max_body_bytes: int) -> str:
    """The template with its placeholders filled, as the nginx image's envsubst would."""
    return string.Template(TEMPLATE.read_text()).safe_substitute(
        PROXY_LISTEN=listen,
        REPLICA_1=replicas[0],
        REPLICA_2=replicas[1],
        MAX_BODY_BYTES=str(max_body_bytes),
    )


@dataclass(frozen=True)
class Logged:
    """One access log line: the request and the replicas nginx tried for it, in order."""

    method: str
    path: str
    status: int
    upstreams: list[str]
    upstream_statuses: list[str]


class NginxProxy:
    """``nginx`` on a free 127.0.0.1 port, proxying to two ``host:port`` replicas."""

    def __init__(
        self,
        *,
        directory: Path,
        replicas: tuple[str, str],
        max_body_bytes: int = DEFAULT_MAX_BODY_BYTES,
    ) -> None:
        self.directory = directory.resolve()
        self.port = own_port()  # tests/support/ports.py
        self.replicas = replicas
        self.max_body_bytes = max_body_bytes
        self.conf = self.directory / "nginx.conf"
        self.access_log = self.directory / "access.log"
        self.error_log = self.directory / "error.log"
        self._process: subprocess.Popen[bytes] | None = None

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def write(self) -> None:
        self.directory.mkdir(parents=True, exist_ok=True)
        included = render(
            listen=f"127.0.0.1:{self.port}",
            replicas=self.replicas,
            max_body_bytes=self.max_body_bytes,
        )
        (self.directory / "flowcast.conf").write_text(included)
        # Run by root, the workers would become nobody, who cannot enter pytest's 0700
        # temporary directories (request bodies are buffered there).
        user = "user root;" if os.geteuid() == 0 else ""
        self.conf.write_text(MAIN.format(dir=self.directory, user=user))

    def command(self, *args: str) -> list[str]:
        return [str(NGINX), "-p", str(self.directory), "-c", str(self.conf),
                "-e", str(self.error_log), *args]  # fmt: skip

    def check(self) -> subprocess.CompletedProcess[str]:
        """``nginx -t`` on the written configuration."""
        self.write()
        return subprocess.run(
            self.command("-t"), capture_output=True, text=True, timeout=30, check=False
        )

    async def start(self, timeout: float = 20.0) -> None:
        self.write()
        with self.access_log.open("ab") as out, self.error_log.open("ab") as err:
            self._process = subprocess.Popen(
                self.command(),
                stdin=subprocess.DEVNULL,
                stdout=out,
                stderr=err,
                preexec_fn=die_with_parent,
            )
        await self._until_answering(timeout)

    async def _until_answering(self, timeout: float) -> None:
        """Poll until nginx accepts connections; fail early if it exits. (A TCP connect,
        not a request: a request would reach a replica and show in the access log.)"""
        assert self._process is not None
        deadline = asyncio.get_running_loop().time() + timeout
        while True:
            if self._process.poll() is not None:
                raise RuntimeError(f"nginx exited with {self._process.returncode}:\n{self.logs()}")
            try:
                _, writer = await asyncio.open_connection("127.0.0.1", self.port)
            except OSError as exc:
                if asyncio.get_running_loop().time() > deadline:
                    raise RuntimeError(
                        f"nginx not listening after {timeout}s:\n{self.logs()}"
                    ) from exc
                await asyncio.sleep(0.05)
                continue
            writer.close()
            await writer.wait_closed()
            return

    async def stop(self) -> None:
        process, self._process = self._process, None
        if process is None:
            return
        if process.poll() is None:
            process.send_signal(signal.SIGTERM)  # fast shutdown: open streams are cut
        try:
            await asyncio.to_thread(process.wait, 10)
        except subprocess.TimeoutExpired:
            process.kill()
            await asyncio.to_thread(process.wait)

    def logs(self) -> str:
        parts = [path.read_text() for path in (self.error_log, self.access_log) if path.exists()]
        return "\n".join(parts)[-4000:]

    def requests(self) -> list[Logged]:
        """Every request in the access log so far (nginx writes a line when one ends)."""
        found = []
        for line in self.access_log.read_text().splitlines():
            match = _LINE.search(line)
            assert match is not None, f"unexpected access log line: {line!r}"
            found.append(
                Logged(
                    method=match["method"],
                    path=match["path"],
                    status=int(match["status"]),
                    upstreams=match["upstream"].split(", "),
                    upstream_statuses=match["upstream_status"].split(", "),
                )
            )
        return found

    async def logged(
        self, matches: Callable[[Logged], bool], count: int = 1, timeout: float = 10.0
    ) -> list[Logged]:
        """Wait until at least ``count`` logged requests match; those requests."""

        def enough() -> list[Logged] | None:
            found = [entry for entry in self.requests() if matches(entry)]
            return found if len(found) >= count else None

        logged: list[Logged] = await until(enough, f"{count} matching requests logged", timeout)
        return logged

    async def __aenter__(self) -> NginxProxy:
        await self.start()
        return self

    async def __aexit__(self, *exc_info: object) -> None:
        await self.stop()


class Dropper:
    """A replica that reads each request and closes the connection without answering;
    with ``once``, it is gone after the first (a replica killed with the request in
    hand): the next connection is refused."""

    def __init__(self, *, once: bool = False) -> None:
        self.once = once
        self.received: list[str] = []
        self._server: asyncio.Server | None = None
        self.port = 0

    @property
    def address(self) -> str:
        return f"127.0.0.1:{self.port}"

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            head = await reader.readuntil(b"\r\n\r\n")
            lines = head.decode("latin-1").split("\r\n")
            method, target, _ = lines[0].split(" ")
            for line in lines[1:]:
                name, _, value = line.partition(":")
                if name.lower() == "content-length":
                    await reader.readexactly(int(value))
            self.received.append(f"{method} {target}")
        except (asyncio.IncompleteReadError, ConnectionError):
            pass
        finally:
            writer.close()
            if self.once and self._server is not None:
                self._server.close()

    async def __aenter__(self) -> Dropper:
        self._server = await asyncio.start_server(self._serve, "127.0.0.1", 0)
        self.port = self._server.sockets[0].getsockname()[1]
        return self

    async def __aexit__(self, *exc_info: object) -> None:
        if self._server is not None:
            self._server.close()
            await self._server.wait_closed()


class TcpLink:
    """One process's own TCP link to a server (a replica's to Valkey), through a proxy
    on a free 127.0.0.1 port, that a test can cut: every connection through it is
    dropped at once and new ones are closed as they arrive, until it is healed. Only the
    process pointed at ``url`` loses the server; every other one keeps it."""

    def __init__(self, port: int) -> None:
        self.target = port
        self.port = 0
        self.cut_count = 0
        self._cut = False
        self._server: asyncio.Server | None = None
        self._open: set[asyncio.StreamWriter] = set()

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.port}/0"

    @property
    def is_cut(self) -> bool:
        return self._cut

    def cut(self) -> None:
        """Drop every connection through the link now; refuse new ones until healed."""
        self._cut = True
        self.cut_count += 1
        for writer in list(self._open):
            writer.transport.abort()
        self._open.clear()

    def heal(self) -> None:
        self._cut = False

    async def _serve(self, client: asyncio.StreamReader, to_client: asyncio.StreamWriter) -> None:
        if self._cut:
            to_client.transport.abort()
            return
        try:
            server, to_server = await asyncio.open_connection("127.0.0.1", self.target)
        except OSError:
            to_client.transport.abort()
            return
        if self._cut:  # cut while connecting
            to_client.transport.abort()
            to_server.transport.abort()
            return
        self._open.update((to_client, to_server))
        try:
            await asyncio.gather(self._pump(client, to_server), self._pump(server, to_client))
        finally:
            for writer in (to_client, to_server):
                self._open.discard(writer)
                writer.transport.abort()

    @staticmethod
    async def _pump(source: asyncio.StreamReader, sink: asyncio.StreamWriter) -> None:
        try:
            while data := await source.read(65536):
                sink.write(data)
                await sink.drain()
        except (ConnectionError, OSError):
            pass  # the other side went, or the link was cut: the caller closes both
        finally:
            sink.transport.abort()

    async def __aenter__(self) -> TcpLink:
        self._server = await asyncio.start_server(self._serve, "127.0.0.1", 0)
        self.port = self._server.sockets[0].getsockname()[1]
        return self

    async def __aexit__(self, *exc_info: object) -> None:
        self.cut()
        if self._server is not None:
            self._server.close()
            await self._server.wait_closed()
