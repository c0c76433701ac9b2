"""The workflow model: blocks, edges and the graph helpers the executor needs."""

from __future__ import annotations

import hashlib
from typing import Annotated, Any

import orjson
from pydantic import BaseModel, ConfigDict, Field, PrivateAttr, StringConstraints

SLUG_PATTERN = r"^[a-z0-9][a-z0-9_-]{0,63}$"

Slug = Annotated[str, StringConstraints(pattern=SLUG_PATTERN)]


class _Model(BaseModel):
    model_config = ConfigDict(extra="forbid", populate_by_name=True)


class Retry(_Model):
    """How often a block is attempted and how long to wait between attempts."""

    attempts: int = Field(1, ge=1, le=20)
    backoff_ms: int = Field(200, ge=0, le=600_000, alias="backoffMs")


class BlockDef(_Model):
    """One block of a workflow: its id, type and (possibly templated) config."""

    id: Slug
    type: str
    config: dict[str, Any] = Field(default_factory=dict)
    retry: Retry | None = None
    timeout_ms: int | None = Field(None, ge=1, le=86_400_000, alias="timeoutMs")
    name: str | None = None


class Edge(_Model):
    """A dependency ``from_`` → ``to``, taken only when ``when`` (if any) is truthy."""

    from_: str = Field(alias="from")
    to: str
    when: str | None = None


class Workflow(_Model):
    """A directed acyclic graph of blocks."""

    id: Slug
    name: str = ""
    description: str = ""
    blocks: list[BlockDef] = Field(min_length=1, max_length=500)
    edges: list[Edge] = Field(default_factory=list, max_length=2000)
    # What an execution's ``input`` must be (a JSON Schema, checked at execute) and an
    # input that is (checked against it when stored), to prefill a start.
    input_schema: dict[str, Any] | None = Field(
        None,
        alias="inputSchema",
        description="A JSON Schema an execution's input must match (else 422 at execute)",
    )
    example_input: Any = Field(
        None,
        alias="exampleInput",
        description="An input to start with (the page prefills it); matches inputSchema",
    )
    _canonical: tuple[bytes, str] | None = PrivateAttr(default=None)

    def block(self, block_id: str) -> BlockDef:
        """The block with this id (KeyError if there is none)."""
        for block in self.blocks:
            if block.id == block_id:
                return block
        raise KeyError(block_id)

    def incoming(self) -> dict[str, list[Edge]]:
        """Each block's incoming edges, in edge order (every block has an entry)."""
        result: dict[str, list[Edge]] = {block.id: [] for block in self.blocks}
        for edge in self.edges:
            result[edge.to].append(edge)
        return result

    def downstream(self) -> dict[str, list[str]]:
        """Each block's direct dependents, in workflow order, without repeats."""
        order = {block.id: index for index, block in enumerate(self.blocks)}
        targets: dict[str, set[str]] = {block.id: set() for block in self.blocks}
        for edge in self.edges:
            targets[edge.from_].add(edge.to)
        return {source: sorted(found, key=order.__getitem__) for source, found in targets.items()}

    def ancestors(self) -> dict[str, frozenset[str]]:
        """Each block's transitive upstream blocks (the outputs its templates may read)."""
        incoming = self.incoming()
        result: dict[str, frozenset[str]] = {}

        def visit(block_id: str) -> frozenset[str]:
            # Iterative post-order so deep chains cannot hit the recursion limit.
            stack = [block_id]
            while stack:
                current = stack[-1]
                pending = [e.from_ for e in incoming[current] if e.from_ not in result]
                if pending:
                    stack.extend(pending)
                    continue
                stack.pop()
                if current not in result:
                    found: set[str] = set()
                    for edge in incoming[current]:
                        found.add(edge.from_)
                        found |= result[edge.from_]
                    result[current] = frozenset(found)
            return result[block_id]

        for block in self.blocks:
            visit(block.id)
        return result

    def sinks(self) -> list[str]:
        """Ids of the blocks without outgoing edges, in workflow order."""
        sources = {edge.from_ for edge in self.edges}
        return [block.id for block in self.blocks if block.id not in sources]

    def to_json(self) -> dict[str, Any]:
        """The workflow as JSON, with the spec's field names."""
        return self.model_dump(by_alias=True, exclude_none=True, mode="json")

    def canonical(self) -> tuple[bytes, str]:
        """Its JSON with sorted keys and that JSON's SHA-256 (the version's digest),
        worked out once: a workflow is not changed after it is validated, and every
        execution of it asks."""
        if self._canonical is None:
            raw = orjson.dumps(self.to_json(), option=orjson.OPT_SORT_KEYS)
            self._canonical = (raw, hashlib.sha256(raw).hexdigest())
        return self._canonical
