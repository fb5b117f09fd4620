"""Every answer is the model the OpenAPI documents for it: for each operation a client calls here, the
body of its 2xx answer validates against the schema component the served document names, with exactly
that model's fields (none missing, none extra), and an Idempotency-Key replay is the same bytes.

The command bodies are written by the commit statement (so a replay is byte for byte the first answer),
not by FastAPI from the response model; this is what keeps the two from drifting apart.
"""

from __future__ import annotations

import json
from typing import Any

import httpx
import pytest
from pydantic import BaseModel

from api import models, tokens

pytestmark = pytest.mark.storage

MODELS: dict[str, type[BaseModel]] = {
    name: model
    for module in (models, tokens)
    for name, model in vars(module).items()
    if isinstance(model, type) and issubclass(model, BaseModel) and model.__module__ == module.__name__
}


def documented_model(openapi: dict[str, Any], method: str, template: str, status: int) -> type[BaseModel]:
    """The pydantic model behind the schema the served OpenAPI gives for this operation's answer."""
    answer = openapi["paths"][template][method]["responses"][str(status)]
    reference = answer["content"]["application/json"]["schema"]["$ref"]
    return MODELS[reference.rsplit("/", 1)[1]]


def assert_is_documented(
    openapi: dict[str, Any], method: str, template: str, response: httpx.Response
) -> dict[str, Any]:
    assert response.is_success, response.text
    model = documented_model(openapi, method, template, response.status_code)
    body: dict[str, Any] = json.loads(response.content)
    model.model_validate_json(response.content, strict=False)
    fields = {info.alias or name for name, info in model.model_fields.items()}
    assert set(body) == fields, (template, model.__name__, set(body) ^ fields)
    return body


async def test_every_answer_is_its_documented_model(http: httpx.AsyncClient, resource: str) -> None:
    openapi = (await http.get("/openapi.json")).json()
    locks = "/v1/locks/{resource}"

    key = {"Idempotency-Key": f"{resource}-acquire"}
    acquired = await http.post(f"/v1/locks/{resource}/acquire", json={"owner": "agv-1"}, headers=key)
    lease = assert_is_documented(openapi, "post", f"{locks}/acquire", acquired)
    again = await http.post(f"/v1/locks/{resource}/acquire", json={"owner": "agv-1"}, headers=key)
    assert again.headers["idempotent-replayed"] == "true"
    assert again.content == acquired.content

    token = {"owner": "agv-1", "fencing_token": lease["fencing_token"]}
    renewed = await http.post(f"/v1/locks/{resource}/renew", json=token)
    assert_is_documented(openapi, "post", f"{locks}/renew", renewed)
    for path, template in [
        (f"/v1/locks/{resource}", locks),
        (f"/v1/locks?prefix={resource}", "/v1/locks"),
        (f"/v1/locks/{resource}/history", f"{locks}/history"),
        ("/v1/tokens", "/v1/tokens"),
    ]:
        assert_is_documented(openapi, "get", template, await http.get(path))
    released = await http.post(f"/v1/locks/{resource}/release", json=token)
    assert_is_documented(openapi, "post", f"{locks}/release", released)

    await http.post(f"/v1/locks/{resource}/acquire", json={"owner": "agv-2"})
    forced = await http.post(f"/v1/locks/{resource}/force-release", json={"reason": "operator"})
    assert_is_documented(openapi, "post", f"{locks}/force-release", forced)
    nothing = await http.post(f"/v1/locks/{resource}/force-release", json={"reason": "operator"})
    assert assert_is_documented(openapi, "post", f"{locks}/force-release", nothing)["released"] is False

    issued = await http.post("/v1/tokens", json={"name": f"{resource}-wall", "role": "dashboard"})
    assert_is_documented(openapi, "post", "/v1/tokens", issued)
    revoked = await http.delete(f"/v1/tokens/{resource}-wall")
    assert_is_documented(openapi, "delete", "/v1/tokens/{name}", revoked)
