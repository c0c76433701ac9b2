"""Run Flowcast in this very process with the environment it was given, execute a
workflow whose ``http`` block calls ``argv[1]``, and print (JSON) the tracing modules
loaded by then (lib/otel.py, the SDK's tracing, the instrumentation, the exporter): the
traces tests check that tracing off imports none.

``python -m tests.support.untraced <url>``, with the FLOWCAST_* settings in the
environment."""

from __future__ import annotations

import asyncio
import json
import sys

import httpx
import uvicorn

from app.main import create_app
from tests.support.ports import own_port


async def main(url: str) -> None:
    port = own_port()
    config = uvicorn.Config(create_app(), host="127.0.0.1", port=port, log_level="warning")
    server = uvicorn.Server(config)
    serving = asyncio.create_task(server.serve())
    try:
        async with httpx.AsyncClient(base_url=f"http://127.0.0.1:{port}", timeout=20) as client:
            while not server.started:
                if serving.done():
                    serving.result()
                await asyncio.sleep(0.02)
            workflow = {
                "id": "untraced",
                "blocks": [{"id": "call", "type": "http", "config": {"url": url}}],
                "edges": [],
            }
            assert (await client.put("/api/workflows/untraced", json=workflow)).is_success
            answer = await client.post("/api/workflows/untraced/execute", json={"input": {}})
            execution_id = answer.json()["executionId"]
            while True:
                snapshot = (await client.get(f"/api/executions/{execution_id}")).json()
                if snapshot["status"] not in ("queued", "running"):
                    break
                await asyncio.sleep(0.02)
    finally:
        server.should_exit = True
        await serving
    # What tracing would load. Not the API (``opentelemetry.trace``: FastAPI's own
    # dependency, imported by FastAPI), nor ``opentelemetry.sdk.metrics``, which
    # redis-py's observability module imports whenever the SDK is installed.
    tracing = (
        "lib.otel",
        "opentelemetry.sdk.trace",
        "opentelemetry.instrumentation",
        "opentelemetry.exporter",
    )
    loaded = sorted(name for name in sys.modules if name.startswith(tracing))
    print(json.dumps({"status": snapshot["status"], "loaded": loaded}))


if __name__ == "__main__":
    asyncio.run(main(sys.argv[1]))
