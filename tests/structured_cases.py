"""Schemas and tools for the structured-output tests, shared by the in-process and real-model runs.

Every string has a maxLength and every number bounds: under a random model a string or
number stops only when the grammar makes it stop, and a request must end within its budget.
"""

from __future__ import annotations

import json

import jsonschema


def _obj(required: list[str] | None = None, **props) -> dict:
    out = {"type": "object", "properties": props, "additionalProperties": False}
    out["required"] = list(props) if required is None else required
    return out


def _int(lo: int, hi: int) -> dict:
    return {"type": "integer", "minimum": lo, "maximum": hi}


def _str(n: int, **kw) -> dict:
    return {"type": "string", "maxLength": n, **kw}


_POINT = _obj(x=_int(0, 9), y=_int(0, 9))

SCHEMAS: dict[str, dict] = {
    "person": _obj(name=_str(12), age=_int(0, 120)),
    "enum": _obj(color={"enum": ["red", "green", "blue"]}),
    "nested": _obj(user=_obj(id=_int(1, 999), email=_str(20)), active={"type": "boolean"}),
    "enum_array": _obj(tags={"type": "array", "items": {"enum": ["a", "b", "c"]}, "minItems": 1, "maxItems": 3}),
    "unit_interval": _obj(score={"type": "number", "minimum": 0, "maximum": 1}),
    "root_array": {"type": "array", "items": _int(-5, 5), "minItems": 2, "maxItems": 4},
    "optional_field": _obj(["a"], a=_int(0, 9), b=_str(5)),
    "const": _obj(kind={"const": "point"}, x=_int(-10, 10), y=_int(-10, 10)),
    "any_of": _obj(value={"anyOf": [_int(0, 10), _str(4)]}),
    "nullable": _obj(note={"type": ["string", "null"], "maxLength": 6}),
    "refs": {**_obj(origin={"$ref": "#/$defs/point"}, target={"$ref": "#/$defs/point"}), "$defs": {"point": _POINT}},
    "object_array": _obj(items={"type": "array", "items": _obj(sku=_str(6), qty=_int(1, 9)), "maxItems": 2}),
    "status_code": _obj(ok={"type": "boolean"}, code=_int(100, 599)),
    "int_enum": _obj(level={"enum": [1, 2, 3]}),
    "deep": _obj(a=_obj(b=_obj(c=_obj(d={"enum": ["x", "y"]})))),
    "pattern": _obj(zip={"type": "string", "pattern": "^[0-9]{5}$"}),
    "exclusive": _obj(t={"type": "number", "exclusiveMinimum": 0, "exclusiveMaximum": 10}),
    "fixed_length": _obj(code=_str(3, minLength=3)),
    "grid": _obj(grid={"type": "array", "maxItems": 2, "items": {"type": "array", "maxItems": 2, "items": _int(0, 1)}}),
    "mixed": _obj(
        status={"enum": ["ok", "error"]},
        data=_obj(count=_int(0, 100), labels={"type": "array", "items": _str(4), "maxItems": 2}),
    ),
    "root_enum": {"enum": ["yes", "no", "maybe"]},
}

WEATHER = {
    "type": "function",
    "name": "get_weather",
    "description": "Current weather for a city",
    "strict": True,
    "parameters": _obj(city=_str(16), unit={"enum": ["c", "f"]}),
}
ADD = {
    "type": "function",
    "name": "add",
    "description": "Add two numbers",
    "strict": True,
    "parameters": _obj(a=_int(0, 99), b=_int(0, 99)),
}
TOOLS = [WEATHER, ADD]
TOOL_SCHEMAS = {t["name"]: t["parameters"] for t in TOOLS}


def chat_tool(tool: dict) -> dict:
    return {"type": "function", "function": {k: v for k, v in tool.items() if k != "type"}}


def valid(text: str, schema: dict) -> object:
    """The parsed JSON; raises if `text` is not JSON or does not validate against `schema`."""
    value = json.loads(text)
    jsonschema.validate(value, schema)
    return value
