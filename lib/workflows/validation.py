"""Workflow validation: every problem in a definition, each with a JSON path.

The structural checks (pydantic) and the semantic checks (types, configs, ids, edges,
cycles, templates) both run on the raw JSON, so a workflow with a broken field still
gets its other problems reported in the same answer.
"""

from __future__ import annotations

import re
from typing import Any

from jsonschema.exceptions import SchemaError
from pydantic import ValidationError

from lib.errors import Problem, WorkflowInvalid, error_path
from lib.workflows.blocks import BlockTypes
from lib.workflows.blocks.base import error_message
from lib.workflows.limits import MAX_DEPTH, MAX_TEMPLATE_CHARS, long_templates, too_deep
from lib.workflows.model import Workflow
from lib.workflows.schemas import check_schema, value_problems
from lib.workflows.secrets import MAX_SECRETS_PER_WORKFLOW
from lib.workflows.templates import Templates


def validate_workflow(raw: Any, *, block_types: BlockTypes, templates: Templates) -> Workflow:
    """The workflow defined by ``raw``, or WorkflowInvalid listing every problem."""
    if not isinstance(raw, dict):
        raise WorkflowInvalid([Problem("$", "a workflow must be a JSON object")])
    if too_deep(raw):
        raise WorkflowInvalid([Problem("$", f"the workflow nests deeper than {MAX_DEPTH} levels")])
    problems: list[Problem] = [
        Problem(f"${path}", f"a template may be at most {MAX_TEMPLATE_CHARS} characters")
        for path in long_templates(raw)
    ]
    workflow: Workflow | None = None
    try:
        workflow = Workflow.model_validate(raw)
    except ValidationError as exc:
        problems += [_structure_problem(error) for error in exc.errors()]
    blocks = raw.get("blocks")
    edges = raw.get("edges")
    block_list = blocks if isinstance(blocks, list) else []
    edge_list = edges if isinstance(edges, list) else []
    ids = _check_blocks(block_list, block_types, templates, problems)
    _check_edges(edge_list, ids, templates, problems)
    _check_input(raw, templates.max_render_seconds, problems)
    if problems or workflow is None:
        problems.sort(key=lambda problem: _path_key(problem.path))
        raise WorkflowInvalid(problems or [Problem("$", "the workflow is not valid")])
    return workflow


def _path_key(path: str) -> list[tuple[int, int, str]]:
    """Sort key for JSON paths: document order, with ``[10]`` after ``[2]``."""
    return [
        (0, int(index), "") if index else (1, 0, name)
        for index, name in re.findall(r"\[(\d+)\]|\.([^.\[]+)", path)
    ]


def _structure_problem(error: Any) -> Problem:
    path = "$" + error_path(tuple(error["loc"]))
    if error["type"] == "extra_forbidden":
        return Problem(path, "unknown field")
    if error["type"] == "missing":
        return Problem(path, "required field is missing")
    if error["type"] == "string_pattern_mismatch":
        return Problem(path, "must be a slug: 1-64 lowercase letters, digits, '_' or '-'")
    if error["type"] in ("model_type", "dict_type"):
        return Problem(path, "must be an object")
    return Problem(path, error_message(error))


def _check_blocks(
    blocks: list[Any], block_types: BlockTypes, templates: Templates, problems: list[Problem]
) -> dict[str, int]:
    """Check types, configs, templates and ids; return the index of each block id."""
    ids: dict[str, int] = {}
    read: set[str] = set()
    # Every id up front: a template may read a block defined further down.
    block_ids = {
        block["id"]
        for block in blocks
        if isinstance(block, dict) and isinstance(block.get("id"), str)
    }
    for index, block in enumerate(blocks):
        if not isinstance(block, dict):
            continue
        where = f"$.blocks[{index}]"
        block_id = block.get("id")
        if isinstance(block_id, str):
            if block_id in ids:
                message = f"duplicate block id {block_id!r} (see $.blocks[{ids[block_id]}])"
                problems.append(Problem(f"{where}.id", message))
            else:
                ids[block_id] = index
        config = block.get("config", {})
        if not isinstance(config, dict):
            continue
        type_name = block.get("type")
        block_type = block_types.get(type_name) if isinstance(type_name, str) else None
        secret_names, secret_problems = templates.secret_reads(config)
        read |= secret_names
        for suffix, message in secret_problems:
            problems.append(Problem(f"{where}.config{suffix}", message))
        if secret_names and block_type is not None and not block_type.reads_secrets:
            message = f"only {', '.join(block_types.secret_readers())} blocks may read secrets"
            problems.append(Problem(f"{where}.config", message))
        if isinstance(type_name, str):
            if block_type is None:
                known = ", ".join(block_types.names())
                message = f"unknown block type {type_name!r} (known: {known})"
                problems.append(Problem(f"{where}.type", message))
            else:
                for suffix, message in block_type.check_config(config):
                    problems.append(Problem(f"{where}.config{suffix}", message))
        for suffix, message in templates.check(config, block_ids):
            problems.append(Problem(f"{where}.config{suffix}", message))
    if len(read) > MAX_SECRETS_PER_WORKFLOW:
        message = f"a workflow may read at most {MAX_SECRETS_PER_WORKFLOW} secrets"
        problems.append(Problem("$.blocks", message))
    return ids


def _check_input(raw: dict[str, Any], cpu_seconds: float, problems: list[Problem]) -> None:
    """``inputSchema`` must be a JSON Schema Flowcast can run, and ``exampleInput`` (when
    both are given) an input it accepts."""
    schema = raw.get("inputSchema")
    if not isinstance(schema, dict):
        return  # absent, or not an object: reported by the structural checks
    try:
        check_schema(schema)
    except SchemaError as exc:
        where = "$.inputSchema" + error_path(tuple(exc.absolute_path))
        problems.append(Problem(where, f"not a valid JSON Schema: {exc.message}"))
        return
    if "exampleInput" in raw:
        problems += value_problems(
            schema,
            raw["exampleInput"],
            where="$.exampleInput",
            whose="the inputSchema",
            cpu_seconds=cpu_seconds,
        )


def _check_edges(
    edges: list[Any], ids: dict[str, int], templates: Templates, problems: list[Problem]
) -> None:
    """Check edge ends, self-edges, duplicates, ``when`` expressions and cycles."""
    seen: dict[tuple[str, str], int] = {}
    graph: dict[str, list[tuple[str, int]]] = {block_id: [] for block_id in ids}
    for index, edge in enumerate(edges):
        if not isinstance(edge, dict):
            continue
        where = f"$.edges[{index}]"
        source, target = edge.get("from"), edge.get("to")
        known = True
        for end, value in (("from", source), ("to", target)):
            if isinstance(value, str) and value not in ids:
                problems.append(Problem(f"{where}.{end}", f"unknown block {value!r}"))
                known = False
        when = edge.get("when")
        if isinstance(when, str):
            message = templates.check_expression(when, ids)
            if message:
                problems.append(Problem(f"{where}.when", message))
            elif templates.expression_reads_secrets(when):
                problems.append(Problem(f"{where}.when", "a condition may not read secrets"))
        if not (isinstance(source, str) and isinstance(target, str) and known):
            continue
        if source == target:
            problems.append(Problem(f"{where}.to", f"block {source!r} cannot depend on itself"))
            continue
        if (source, target) in seen:
            first = seen[(source, target)]
            message = f"duplicate edge {source!r} → {target!r} (see $.edges[{first}])"
            problems.append(Problem(where, message))
            continue
        seen[(source, target)] = index
        graph[source].append((target, index))
    for cycle, index in _cycles(graph):
        path = " → ".join(cycle)
        problems.append(Problem(f"$.edges[{index}]", f"this edge closes a cycle: {path}"))


def _cycles(graph: dict[str, list[tuple[str, int]]]) -> list[tuple[list[str], int]]:
    """One cycle per back edge found by a depth-first search, with that edge's index."""
    state: dict[str, int] = {}  # 1: on the current path, 2: finished
    found: list[tuple[list[str], int]] = []
    for root in graph:
        if root in state:
            continue
        state[root] = 1
        path = [root]
        # Iterative so a 500-block chain cannot hit the recursion limit.
        stack = [iter(graph[root])]
        while stack:
            step = next(stack[-1], None)
            if step is None:
                stack.pop()
                state[path.pop()] = 2
                continue
            target, index = step
            if state.get(target) == 1:
                found.append(([*path[path.index(target) :], target], index))
            elif target not in state:
                state[target] = 1
                path.append(target)
                stack.append(iter(graph[target]))
    return found
