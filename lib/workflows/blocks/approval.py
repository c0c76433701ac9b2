"""``approval``: pauses the execution until a human resumes it; outputs the resume input."""

from __future__ import annotations

from typing import Any

from jsonschema.exceptions import SchemaError
from pydantic import Field, field_validator

from lib.workflows.blocks.base import BlockConfig, BlockContext, BlockType
from lib.workflows.schemas import check_schema


class ApprovalConfig(BlockConfig):
    prompt: str
    input_schema: dict[str, Any] = Field(alias="schema")
    timeout_seconds: int | None = Field(None, ge=1, le=30 * 86_400)

    @field_validator("input_schema")
    @classmethod
    def _valid_schema(cls, schema: dict[str, Any]) -> dict[str, Any]:
        try:
            check_schema(schema)
        except SchemaError as exc:
            raise ValueError(f"not a valid JSON Schema: {exc.message}") from exc
        return schema


class Approval(BlockType[ApprovalConfig]):
    """Pauses for a resume whose input ``schema`` validates; that input is its output."""

    name = "approval"
    config_model = ApprovalConfig

    async def run(self, ctx: BlockContext, config: ApprovalConfig) -> Any:
        return ctx.request_approval(
            config.prompt, config.input_schema, timeout_seconds=config.timeout_seconds
        )
