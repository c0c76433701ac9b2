"""The S3 value store behind a real server: moto's S3 over HTTP, values offloaded by an
execution, served back whole by the values route, and the bucket checked by readiness."""

from __future__ import annotations

import asyncio
import hashlib
import uuid
from collections.abc import AsyncIterator

import boto3
import httpx
import orjson
import pytest

from lib.execution.values import RECORD_NAME
from lib.workflows.blocks.payload import make_payload
from tests.support.api import all_events, put, wait_finished
from tests.support.logcheck import check_log
from tests.support.s3 import CREDENTIALS, MotoServer
from tests.support.servers import FlowcastServer, ValkeyServer

PREFIX = "values/"
PAYLOAD_BYTES = 500_000


@pytest.fixture
async def bucket(moto: MotoServer) -> str:
    name = f"flowcast-{uuid.uuid4().hex[:8]}"
    client = boto3.client("s3", endpoint_url=moto.url, **_boto_credentials())
    await asyncio.to_thread(client.create_bucket, Bucket=name)
    return name


def _boto_credentials() -> dict[str, str]:
    return {
        "aws_access_key_id": CREDENTIALS["AWS_ACCESS_KEY_ID"],
        "aws_secret_access_key": CREDENTIALS["AWS_SECRET_ACCESS_KEY"],
        "region_name": CREDENTIALS["AWS_DEFAULT_REGION"],
    }


@pytest.fixture
async def s3_client(
    tmp_path_factory: pytest.TempPathFactory, valkey: ValkeyServer, moto: MotoServer, bucket: str
) -> AsyncIterator[httpx.AsyncClient]:
    server = FlowcastServer(
        data_dir=tmp_path_factory.mktemp("s3-server"),
        env={
            "FLOWCAST_REDIS_URL": valkey.url,
            "FLOWCAST_REDIS_PREFIX": f"s3{uuid.uuid4().hex[:8]}",
            "FLOWCAST_S3_BUCKET": bucket,
            "FLOWCAST_S3_ENDPOINT_URL": moto.url,
            "FLOWCAST_S3_PREFIX": PREFIX,
            "FLOWCAST_LARGE_VALUE_BYTES": "100000",
            **CREDENTIALS,
        },
    )
    await server.start()
    try:
        async with httpx.AsyncClient(base_url=server.url, timeout=30) as client:
            yield client
    finally:
        await server.stop()


async def test_a_value_above_the_threshold_goes_to_s3_and_comes_back_whole_through_the_route(
    s3_client: httpx.AsyncClient, moto: MotoServer, bucket: str
) -> None:
    client = s3_client
    workflow = {
        "id": "to-s3",
        "blocks": [{"id": "big", "type": "payload", "config": {"bytes": PAYLOAD_BYTES}}],
    }
    await put(client, workflow)
    started = await client.post("/api/workflows/to-s3/execute", json={})
    assert started.status_code == 202, started.text
    execution_id = started.json()["executionId"]
    assert (await wait_finished(client, execution_id))["status"] == "completed"
    events = await all_events(client, execution_id)
    check_log(events)

    expected = orjson.dumps(make_payload(PAYLOAD_BYTES, "string"))
    digest = hashlib.sha256(expected).hexdigest()
    [completed] = [event for event in events if event["type"] == "block:completed"]
    ref = completed["data"]["output"]
    assert ref == {
        "$ref": "value",
        "id": f"lv_{digest}",
        "kind": "string",
        "size": PAYLOAD_BYTES,
        "preview": expected[1:257].decode(),
        "sha256": digest,
    }
    assert events[-1]["data"]["output"] == {"big": ref}

    response = await client.get(f"/api/executions/{execution_id}/values/{ref['id']}")
    assert response.status_code == 200
    assert hashlib.sha256(response.content).hexdigest() == digest
    assert response.content == expected

    unknown = f"/api/executions/{execution_id}/values/lv_{'0' * 64}"
    assert (await client.get(unknown)).status_code == 404

    s3 = boto3.client("s3", endpoint_url=moto.url, **_boto_credentials())
    key = f"{PREFIX}{execution_id}/{ref['id']}"
    head = await asyncio.to_thread(s3.head_object, Bucket=bucket, Key=key)
    assert head["ContentLength"] == PAYLOAD_BYTES
    listed = await asyncio.to_thread(s3.list_objects_v2, Bucket=bucket, Prefix=PREFIX)
    # Beside the value, only the owner's durable records (rec_…).
    keys = [item["Key"] for item in listed.get("Contents", [])]
    assert [k for k in keys if not RECORD_NAME.match(k.rpartition("/")[2])] == [key]

    ready = await client.get("/readyz")
    assert ready.status_code == 200
    assert ready.json()["checks"] == {"buffer": True, "values": True}
