"""What every block type speaks: its context, the services it may use, its interface.

Configs are validated twice. At registration the raw config is checked against the
type's ``config_model``, except that a problem at a value that is a template string is
ignored (``"{{ input.n }}"`` in an integer field is fine until it is rendered); at run
time the rendered config is validated strictly, and a failure is ``bad_config``.
"""

from __future__ import annotations

import asyncio
import hashlib
import ipaddress
import json
from abc import ABC, abstractmethod
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, ClassVar, Generic, TypeVar

import httpx
from pydantic import BaseModel, ConfigDict, ValidationError
from pydantic.alias_generators import to_camel

from lib.errors import BlockError, FlowcastError, error_path
from lib.workflows.pool import TemplatePool
from lib.workflows.templates import is_template

if TYPE_CHECKING:
    from lib.workflows.providers import Providers

IPAddress = ipaddress.IPv4Address | ipaddress.IPv6Address

Resolver = Callable[[str, int], Awaitable[Sequence[IPAddress]]]
"""``await resolve(host, port)``: every address of an (ASCII) host name; ``OSError`` if none."""


@dataclass(frozen=True, kw_only=True)
class BlockServices:
    """Process-wide resources shared by every block (owned and closed by the caller).

    ``resolve`` is how ``http`` blocks look up host names before checking and pinning
    the address; ``None`` means the system resolver (``loop.getaddrinfo``). Tests set it
    to answer chosen addresses without DNS. ``llm`` holds the model providers ``llm``
    blocks may call (None: none is configured).
    """

    http: httpx.AsyncClient
    templates: TemplatePool
    http_limiter: asyncio.Semaphore
    http_allow_private: bool = False
    resolve: Resolver | None = None
    llm: Providers | None = None


class PauseRequested(FlowcastError):
    """A block asks for a human's input; the executor pauses the execution for it."""

    code = "pause_requested"

    def __init__(
        self, *, prompt: str, schema: dict[str, Any], timeout_seconds: int | None = None
    ) -> None:
        super().__init__(f"approval requested: {prompt}")
        self.prompt = prompt
        self.schema = schema
        self.timeout_seconds = timeout_seconds


_UNANSWERED: Any = object()


def idempotency_key(execution_id: str, block_id: str) -> str:
    """The key every run of one block in one execution shares: 32 hex digits.

    Derived from the ids alone (the first 128 bits of a SHA-256), so every attempt, every
    re-run after a recovery and every process that takes the execution over computes the
    same key, without storing it. The format is kept as it is: a key that changed would
    make a re-run look new to a remote side that already saw the first run.
    """
    return hashlib.sha256(f"{execution_id}\x00{block_id}".encode()).hexdigest()[:32]


@dataclass(frozen=True, kw_only=True)
class BlockContext:
    """What one attempt of one block knows about its execution.

    Blocks run at least once, not exactly once: a retried attempt, and a block that was
    in flight when its process died or handed the execution off (it runs again where
    the execution is recovered), start again from the beginning. ``attempt`` counts the
    runs of this block in this execution (1, 2, …; it goes on counting across a
    recovery). ``idempotency_key`` is the same on every one of them and differs between
    blocks and executions: send it with any side effect (``http`` blocks send it as the
    ``Idempotency-Key`` header) so the other side can tell a repeat from a new request.
    Chunks emitted by an attempt that failed stay in the event log; clients show a
    block's text afresh from its next ``block:started``.
    """

    execution_id: str
    workflow_id: str
    block_id: str
    attempt: int
    input: Any
    emit_chunk: Callable[[str], None]
    services: BlockServices
    answer: Any = _UNANSWERED

    @property
    def idempotency_key(self) -> str:
        """Stable across attempts, re-runs and processes; unique per execution and block."""
        return idempotency_key(self.execution_id, self.block_id)

    def request_approval(
        self, prompt: str, schema: dict[str, Any], *, timeout_seconds: int | None = None
    ) -> Any:
        """The human's answer once the execution is resumed; until then, pause.

        A block that asks is run again from its start on resume, and this call then
        returns the resume input (already validated against ``schema``).
        """
        if self.answer is not _UNANSWERED:
            return self.answer
        raise PauseRequested(prompt=prompt, schema=schema, timeout_seconds=timeout_seconds)


PluginHandler = Callable[[BlockContext, Any], Awaitable[Any]]


class BlockConfig(BaseModel):
    """Base of every block config: unknown fields refused, camelCase names in JSON."""

    model_config = ConfigDict(extra="forbid", alias_generator=to_camel, populate_by_name=True)


def as_text(value: Any) -> Any:
    """A rendered value for a text field: strings as they are, anything else as JSON."""
    if value is None or isinstance(value, str):
        return value
    return json.dumps(value, separators=(",", ":"), ensure_ascii=False)


def error_message(error: Any) -> str:
    """A pydantic error's message, phrased for a workflow author."""
    if error["type"] == "extra_forbidden":
        return "unknown field"
    message = str(error["msg"])
    return message.removeprefix("Value error, ")


def _value_at(raw: Any, loc: tuple[int | str, ...]) -> list[Any]:
    """The values along ``loc`` inside ``raw``, outermost first (as far as they exist)."""
    found = []
    current = raw
    for part in loc:
        if isinstance(current, dict) and part in current:
            current = current[part]
        elif isinstance(current, list) and isinstance(part, int) and part < len(current):
            current = current[part]
        else:
            break
        found.append(current)
    return found


C = TypeVar("C", bound=BlockConfig)


class BlockType(ABC, Generic[C]):
    """A kind of block: a name, a config model and how to run one attempt."""

    name: ClassVar[str]
    config_model: type[C]
    # Whether its templates may read ``{{ secrets.NAME }}`` (blocks that call out).
    reads_secrets: ClassVar[bool] = False

    def check_config(self, raw: dict[str, Any]) -> list[tuple[str, str]]:
        """Registration-time problems of a raw (unrendered) config, as (path, message)."""
        problems = self.check_raw(raw)
        try:
            self.config_model.model_validate(raw)
        except ValidationError as exc:
            for error in exc.errors():
                loc = tuple(error["loc"])
                if any(is_template(value) for value in _value_at(raw, loc)):
                    continue
                problems.append((error_path(loc), error_message(error)))
        return problems

    def check_raw(self, raw: dict[str, Any]) -> list[tuple[str, str]]:
        """Registration checks the config model cannot make (e.g. a known plugin name)."""
        return []

    def parse_config(self, rendered: Any) -> C:
        """Validate a rendered config; a failure is the non-retryable ``bad_config``."""
        try:
            return self.config_model.model_validate(rendered)
        except ValidationError as exc:
            details = "; ".join(
                f"config{error_path(tuple(e['loc']))}: {error_message(e)}" for e in exc.errors()
            )
            raise BlockError("bad_config", details, retryable=False) from exc

    @abstractmethod
    async def run(self, ctx: BlockContext, config: C) -> Any:
        """Run one attempt and return the block's output (raise BlockError to fail)."""
