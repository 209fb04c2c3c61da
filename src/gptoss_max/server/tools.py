"""Function tools, tool choice and response formats: checked, then handed to Harmony."""

from __future__ import annotations

from typing import Any

from gptoss_max.harmony.render import FunctionTool, ResponseFormat
from gptoss_max.server import grammar
from gptoss_max.server.errors import bad_request

ToolDef = tuple[str, str | None, dict | None, bool | None]  # name, description, parameters, strict


def check_schema(schema: dict[str, Any], param: str, *, must_be_object: bool) -> None:
    """A JSON schema the model can be told about; `jsonschema` checks it when installed."""
    if must_be_object and schema.get("type", "object") != "object":
        raise bad_request(
            "Function parameters must be a JSON schema of type 'object'.",
            param,
            "invalid_function_parameters",
        )
    try:
        import jsonschema
    except ImportError:  # optional: without it only the shape above is checked
        return
    try:
        jsonschema.validators.validator_for(schema).check_schema(schema)
    except jsonschema.SchemaError as exc:
        raise bad_request(f"Invalid JSON schema: {exc.message}.", param, "invalid_schema") from None


def function_tools(tools: list[ToolDef], param: str) -> tuple[FunctionTool, ...]:
    """(name, description, parameters, strict) -> checked `FunctionTool`s.

    A strict function's arguments are decoded under its parameters schema, so that schema
    must compile to a grammar; any other function's arguments are a JSON object."""
    seen: set[str] = set()
    out = []
    for i, (name, description, parameters, strict) in enumerate(tools):
        if name in seen:
            raise bad_request(f"Duplicate function name {name!r}.", f"{param}[{i}].name")
        seen.add(name)
        if parameters is not None:
            where = f"{param}[{i}].parameters"
            check_schema(parameters, where, must_be_object=True)
            if strict:
                hint = " (a function that is not strict gets any JSON object)"
                grammar.check_schema(parameters, where, exact=True, hint=hint)
        out.append(FunctionTool(name, description or "", parameters, bool(strict)))
    return tuple(out)


def tool_choice(choice: str | None, named: str | None, tools: tuple[FunctionTool, ...]) -> str:
    """ "auto" | "none" | "required" | a function's name, checked against `tools`."""
    if named is not None:
        if named not in {t.name for t in tools}:
            raise bad_request(
                f"tool_choice names {named!r}, which is not among the tools.", "tool_choice"
            )
        return named
    if choice == "required" and not tools:
        raise bad_request("tool_choice 'required' needs at least one tool.", "tool_choice")
    return choice or "auto"


def response_format(fmt: dict[str, Any] | None, param: str) -> ResponseFormat:
    """`{"type", "name", "schema", "description", "strict"}` (as the Responses API spells it).

    The answer is decoded under the schema: `strict` makes a keyword the grammar cannot
    enforce a 400 rather than a keyword left unenforced."""
    kind = (fmt or {}).get("type") or "text"
    if kind == "text":
        return ResponseFormat()
    if kind == "json_object":
        return ResponseFormat("json_object")
    assert fmt is not None
    name, schema = fmt.get("name"), fmt.get("schema")
    if not name or schema is None:
        raise bad_request("A json_schema format needs a name and a schema.", param)
    strict = bool(fmt.get("strict"))
    check_schema(schema, f"{param}.schema", must_be_object=False)
    hint = " (without strict, what cannot be enforced is left out)" if strict else ""
    grammar.check_schema(schema, f"{param}.schema", exact=strict, hint=hint)
    return ResponseFormat("json_schema", name, schema, fmt.get("description"), strict)
