"""A request body sent wrong is answered in Flowcast's words, saying how to fix it.

Issue 26 (step 18) tried the API as a new user: an input sent without its
``{"input": …}`` wrapper got "Extra inputs are not permitted", ``curl -d`` without a
Content-Type "Type is not JSON serializable: bytes", bad JSON ``"path": "$[40]"`` with
"JSON decode error". Every JSON route reads its body in one place (app/requests.py).
"""

from __future__ import annotations

from pathlib import Path

import httpx
import pytest

from tests.support.servers import ValkeyServer, authed, serving

JSON = {"content-type": "application/json"}
FORM = {"content-type": "application/x-www-form-urlencoded"}


def error_of(response: httpx.Response, status: int, code: str) -> dict[str, object]:
    assert response.status_code == status, response.text
    error: dict[str, object] = response.json()["error"]
    assert error["code"] == code, error
    return error


@pytest.mark.timeout(30)
async def test_an_input_without_its_wrapper_is_told_to_wrap_it(client: httpx.AsyncClient) -> None:
    response = await client.post(
        "/api/workflows/approve-refund/execute", json={"amount": 40, "customer": "Zed"}
    )
    error = error_of(response, 422, "invalid_request")
    assert error["message"] == (
        'the request has 2 problems: unknown field "amount": the body is '
        '{"input": …, "inlineFiles": …, "webhook": …}; wrap the input in {"input": …}; unknown '
        'field "customer": the body is {"input": …, "inlineFiles": …, "webhook": …}; wrap the '
        'input in {"input": …}'
    )
    assert error["problems"] == [
        {
            "path": f"$.{name}",
            "message": f'unknown field "{name}": the body is '
            '{"input": …, "inlineFiles": …, "webhook": …}; wrap the input in {"input": …}',
        }
        for name in ("amount", "customer")
    ]
    # A resume's answer the same; a body that is not an object says what it should be.
    response = await client.post("/api/executions/ex_none/resume", json={"approved": True})
    assert error_of(response, 422, "invalid_request")["message"] == (
        'unknown field "approved": the body is {"blockId": …, "input": …}; '
        'wrap the input in {"input": …}'
    )
    response = await client.post("/api/workflows/approve-refund/execute", json=[40])
    assert error_of(response, 422, "invalid_request")["message"] == (
        'the body must be a JSON object like {"input": …, "inlineFiles": …, "webhook": …}; '
        'wrap the input in {"input": …}'
    )
    response = await client.put("/api/secrets/TOKEN", json={"valu": "long enough"})
    assert error_of(response, 422, "invalid_request")["problems"] == [
        {"path": "$.value", "message": '"value" is required: the body is {"value": …}'},
        {"path": "$.valu", "message": 'unknown field "valu": the body is {"value": …}'},
    ]


@pytest.mark.timeout(30)
async def test_a_body_not_sent_as_json_is_told_the_content_type(
    client: httpx.AsyncClient, unique: str
) -> None:
    # What `curl -d '{"input": …}'` sends: form-encoded, by curl's default.
    for method, path in [
        ("POST", "/api/workflows/approve-refund/execute"),
        ("PUT", f"/api/workflows/form-{unique}"),
        ("POST", "/api/executions/ex_none/resume"),
        ("PUT", "/api/secrets/TOKEN"),
    ]:
        response = await client.request(method, path, content=b'{"input": 1}', headers=FORM)
        error = error_of(response, 415, "unsupported_media_type")
        assert error["message"] == (
            "send Content-Type: application/json with a JSON body "
            "(got 'application/x-www-form-urlencoded')"
        ), path
    response = await client.post("/api/workflows/approve-refund/execute", content=b"{}")
    assert error_of(response, 415, "unsupported_media_type")["message"].endswith("(got none)")
    assert (await client.get(f"/api/workflows/form-{unique}")).status_code == 404
    # A JSON type with parameters, or a +json one, is JSON; no body at all is no input.
    for content_type in ("application/json; charset=utf-8", "application/merge-patch+json"):
        response = await client.post(
            "/api/workflows/stream-story/execute",
            content=b'{"input": {}}',
            headers={"content-type": content_type},
        )
        assert response.status_code == 202, response.text
    response = await client.post("/api/workflows/stream-story/execute")
    assert response.status_code == 202, response.text


@pytest.mark.timeout(30)
async def test_bad_json_is_told_its_line_and_column(client: httpx.AsyncClient, unique: str) -> None:
    body = b'{"input": {\n  "amount": 40,\n  }}'
    message = "invalid JSON at line 3, column 3: Expecting property name enclosed in double quotes"
    for method, path in [
        ("POST", "/api/workflows/approve-refund/execute"),
        ("PUT", f"/api/workflows/bad-{unique}"),
    ]:
        response = await client.request(method, path, content=body, headers=JSON)
        error = error_of(response, 422, "invalid_request")
        assert error["message"] == message
        assert error["problems"] == [{"path": "$", "message": message}]
    response = await client.post(
        "/api/workflows/approve-refund/execute", content=b'{"input": ', headers=JSON
    )
    message = error_of(response, 422, "invalid_request")["message"]
    assert message == "invalid JSON at line 1, column 11: Expecting value"
    assert (await client.get(f"/api/workflows/bad-{unique}")).status_code == 404


@pytest.mark.timeout(60)
async def test_with_keys_a_body_without_a_key_is_refused_before_it_is_read(
    valkey: ValkeyServer, tmp_path: Path
) -> None:
    key = "body-key-" + "b" * 24
    async with serving(valkey, tmp_path, api_keys=key) as server:
        async with authed(server) as anonymous, authed(server, key) as keyed:
            for content, headers in [(b"{not json", JSON), (b'{"input": 1}', FORM)]:
                response = await anonymous.post(
                    "/api/workflows/approve-refund/execute", content=content, headers=headers
                )
                error_of(response, 401, "unauthorized")
            response = await keyed.post(
                "/api/workflows/approve-refund/execute", content=b"{not json", headers=JSON
            )
            message = error_of(response, 422, "invalid_request")["message"]
            assert message.startswith("invalid JSON at line 1, column 2: ")


@pytest.mark.timeout(30)
async def test_a_route_that_needs_a_body_and_got_none_says_what_to_send(
    client: httpx.AsyncClient,
) -> None:
    """Found by the fuzz test while this was written: a PUT without a body (pydantic's
    ``missing`` at the body itself) must be a 422 too, never a 500."""
    response = await client.put("/api/secrets/TOKEN")
    error = error_of(response, 422, "invalid_request")
    assert error["message"] == 'a body is required: send {"value": …}'
