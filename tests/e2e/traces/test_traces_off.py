"""Tracing off (SPEC §15): without the OpenTelemetry variables, or with the SDK
disabled, a server imports none of the OpenTelemetry tracing SDK, instrumentation or
exporter (the API is FastAPI's own dependency) and sends nothing, though its
requests and an outbound ``http`` call ran."""

from __future__ import annotations

import asyncio
import json
import os
import sys
from pathlib import Path

import pytest

from lib import tracing
from tests.support.otlp import otlp_receiver
from tests.support.servers import ROOT, ValkeyServer, env_on


@pytest.mark.timeout(60)
@pytest.mark.parametrize(
    "otel",
    [{}, {"OTEL_SDK_DISABLED": "true"}, {"OTEL_TRACES_EXPORTER": "none"}],
    ids=["no-variables", "sdk-disabled", "exporter-none"],
)
async def test_tracing_off_imports_nothing_and_sends_nothing(
    valkey: ValkeyServer, tmp_path: Path, otel: dict[str, str]
) -> None:
    with otlp_receiver() as receiver:
        env = {k: v for k, v in os.environ.items() if not k.startswith(("FLOWCAST_", "OTEL_"))}
        env |= env_on(valkey, http_allow_private="true", data_dir=str(tmp_path))
        if otel:  # asked not to, though an endpoint is named
            env |= {**otel, "OTEL_EXPORTER_OTLP_ENDPOINT": receiver.url}
        process = await asyncio.create_subprocess_exec(
            sys.executable, "-m", "tests.support.untraced", receiver.url + "/called",
            cwd=ROOT, env=env, stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE,
        )  # fmt: skip
        out, err = await process.communicate()
        assert process.returncode == 0, err.decode()
        ran = json.loads(out.decode().strip().splitlines()[-1])
        assert ran == {"status": "completed", "loaded": []}, ran
        called = [headers for path, headers in receiver.requests if path == "/called"]
        assert len(called) == 1 and "traceparent" not in called[0]
        assert receiver.spans == []
        assert [path for path, _ in receiver.requests] == ["/called"]  # no /v1/traces


@pytest.mark.timeout(5)
@pytest.mark.parametrize(
    ("env", "on"),
    [
        ({}, False),
        ({"OTEL_SERVICE_NAME": "x"}, False),
        ({"OTEL_EXPORTER_OTLP_ENDPOINT": "http://127.0.0.1:4318"}, True),
        ({"OTEL_EXPORTER_OTLP_TRACES_ENDPOINT": "http://127.0.0.1:4318/v1/traces"}, True),
        ({"OTEL_TRACES_EXPORTER": "otlp"}, True),
        ({"OTEL_TRACES_EXPORTER": "console"}, True),
        ({"OTEL_TRACES_EXPORTER": "none", "OTEL_EXPORTER_OTLP_ENDPOINT": "http://h"}, False),
        ({"OTEL_SDK_DISABLED": "TRUE", "OTEL_EXPORTER_OTLP_ENDPOINT": "http://h"}, False),
        ({"OTEL_SDK_DISABLED": "false", "OTEL_EXPORTER_OTLP_ENDPOINT": "http://h"}, True),
    ],
)
def test_the_standard_variables_decide_whether_traces_are_on(env: dict[str, str], on: bool) -> None:
    assert tracing.requested(env) is on
