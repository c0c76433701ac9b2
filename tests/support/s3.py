"""moto's S3 server in its own process on loopback, for the S3 value store tests."""

from __future__ import annotations

import asyncio
import os
import subprocess
import sys
import uuid
from pathlib import Path
from typing import Any

import boto3
import httpx

from tests.support.ports import own_port

CREDENTIALS = {
    "AWS_ACCESS_KEY_ID": "testing",
    "AWS_SECRET_ACCESS_KEY": "testing",
    "AWS_DEFAULT_REGION": "us-east-1",
}


class MotoServer:
    """``moto_server`` on 127.0.0.1 and a free port."""

    def __init__(self, *, log_path: Path) -> None:
        self.port = own_port()  # tests/support/ports.py
        self.log_path = log_path
        self._process: subprocess.Popen[bytes] | None = None

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    @property
    def pid(self) -> int:
        """The server's process id (to stop it with SIGSTOP: an endpoint that answers
        nothing)."""
        assert self._process is not None, "not started"
        return self._process.pid

    async def start(self, timeout: float = 30.0) -> None:
        binary = Path(sys.executable).with_name("moto_server")
        with self.log_path.open("wb") as log:
            self._process = subprocess.Popen(
                [str(binary), "-H", "127.0.0.1", "-p", str(self.port)],
                stdout=log,
                stderr=log,
                env={**os.environ, **CREDENTIALS},
            )
        deadline = asyncio.get_running_loop().time() + timeout
        async with httpx.AsyncClient(timeout=2) as client:
            while True:
                if self._process.poll() is not None:
                    raise RuntimeError(f"moto_server exited:\n{self.log_path.read_text()}")
                try:
                    await client.get(self.url)
                    return
                except httpx.TransportError:
                    if asyncio.get_running_loop().time() > deadline:
                        raise
                await asyncio.sleep(0.05)

    async def stop(self) -> None:
        process, self._process = self._process, None
        if process is not None and process.poll() is None:
            process.terminate()
            await asyncio.to_thread(process.wait, 10)


def s3_client(moto: MotoServer) -> Any:
    """A boto3 S3 client of ``moto``, with the test credentials."""
    return boto3.client(
        "s3",
        endpoint_url=moto.url,
        aws_access_key_id=CREDENTIALS["AWS_ACCESS_KEY_ID"],
        aws_secret_access_key=CREDENTIALS["AWS_SECRET_ACCESS_KEY"],
        region_name=CREDENTIALS["AWS_DEFAULT_REGION"],
    )


async def shared_bucket(moto: MotoServer) -> dict[str, str]:
    """A new bucket on ``moto`` and the environment that makes a Flowcast process keep its
    values (and durable records) there: replicas given the same share a value store."""
    name = f"flowcast-{uuid.uuid4().hex[:8]}"
    await asyncio.to_thread(s3_client(moto).create_bucket, Bucket=name)
    return {"FLOWCAST_S3_BUCKET": name, "FLOWCAST_S3_ENDPOINT_URL": moto.url, **CREDENTIALS}
