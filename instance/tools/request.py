"""A chat request's tool and template fields, checked, as a
:class:`~ggmux.instance.tools.base.ToolRequest`.

OpenAI's fields: ``tools`` (function tools; the older ``functions``),
``tool_choice`` (``"none"``, ``"auto"``, ``"required"`` or ``{"type":
"function", "function": {"name"}}``; the older ``function_call``),
``parallel_tool_calls`` (default true, as OpenAI), ``reasoning_effort``;
llama-server's: ``chat_template_kwargs`` (template variables, e.g.
``{"enable_thinking": false}``), ``reasoning_format`` (``none`` keeps
reasoning inline; ``deepseek``/``auto``/``deepseek-legacy`` split it into
``reasoning_content``), ``add_generation_prompt``. A named function is
``required`` with that one tool and one call (what OpenAI does with it).
Every tool's ``parameters`` schema is checked against the request limits
(:func:`ggmux.instance.grammar.structured.schema_grammar`). Each mistake is a
:class:`~ggmux.instance.validate.BadRequest` naming the field.
"""

from __future__ import annotations

import re

from ..grammar.structured import schema_grammar
from ..reasoning import REASONING_FORMATS
from ..validate import BadRequest, RequestLimits, function_parameters, shown
from .base import ToolRequest

REASONING_EFFORTS = ("none", "minimal", "low", "medium", "high", "xhigh")
_CHOICE_FORMS = ('"none", "auto", "required" or '
                 '{"type": "function", "function": {"name": ...}}')


_NAME = re.compile(r"[A-Za-z0-9_.:-]{1,128}")


def _function(f, field: str) -> dict:
    if not isinstance(f, dict) or not isinstance(f.get("name"), str) or not f["name"]:
        raise BadRequest(f"{field} must be an object with a non-empty string 'name'", field)
    if not _NAME.fullmatch(f["name"]):
        # OpenAI's rule (letters, digits, _ and -, at most 64) with room for MCP's dots and
        # colons: a name is written into grammars and parsed back out of the answer
        raise BadRequest(f"{field}.name {shown(f['name'])} must be 1 to 128 letters, digits, "
                         "'_', '-', '.' or ':'", f"{field}.name")
    parameters = function_parameters(f.get("parameters"), f"{field}.parameters")
    if f.get("description") is not None and not isinstance(f["description"], str):
        raise BadRequest(f"{field}.description must be a string", f"{field}.description")
    out = {"name": f["name"], "parameters": parameters}
    if f.get("description"):
        out["description"] = f["description"]
    return out


def declared_tools(body: dict, limits: RequestLimits) -> tuple[list[dict], str]:
    """The request's tools as OpenAI function tools, and the field they came
    from (``tools`` or ``functions``)."""
    tools, functions = body.get("tools"), body.get("functions")
    if tools is not None and functions is not None:
        raise BadRequest("give 'tools' or 'functions', not both", "functions")
    out: list[dict] = []
    field = "tools"
    if tools is not None:
        if not isinstance(tools, list):
            raise BadRequest("'tools' must be a list of tools", "tools")
        for i, t in enumerate(tools):
            if not isinstance(t, dict) or t.get("type", "function") != "function":
                kind = t.get("type") if isinstance(t, dict) else None
                raise BadRequest(f"tools[{i}] must be an object with type 'function'"
                                 + (f", not {shown(kind)}" if kind is not None else ""),
                                 f"tools[{i}]")
            out.append({"type": "function",
                        "function": _function(t.get("function"), f"tools[{i}].function")})
    elif functions is not None:
        field = "functions"
        if not isinstance(functions, list):
            raise BadRequest("'functions' must be a list of functions", "functions")
        out = [{"type": "function", "function": _function(f, f"functions[{i}]")}
               for i, f in enumerate(functions)]
    seen: set[str] = set()
    for i, t in enumerate(out):
        name = t["function"]["name"]
        where = f"{field}[{i}]" + (".function" if field == "tools" else "")
        if name in seen:
            raise BadRequest(f"{where}.name {shown(name)} is given twice", f"{where}.name")
        seen.add(name)
        schema_grammar(t["function"]["parameters"], limits, f"{where}.parameters")
    return out, field


def tool_request(body: dict, limits: RequestLimits, reasoning_format: str = "deepseek",
                 json_schema: dict | None = None) -> ToolRequest:
    """Check the tool and template fields of a chat ``body``;
    ``reasoning_format`` is the instance's default (``--reasoning-format``),
    ``json_schema`` the request's ``response_format`` schema if any.
    Raises :class:`BadRequest`."""
    tools, field = declared_tools(body, limits)
    choice, cfield = body.get("tool_choice"), "tool_choice"
    if choice is None and body.get("function_call") is not None:
        choice, cfield = body["function_call"], "function_call"
        if isinstance(choice, dict):
            choice = {"type": "function", "function": choice}
    parallel = body.get("parallel_tool_calls")
    if parallel is not None and not isinstance(parallel, bool):
        raise BadRequest(f"'parallel_tool_calls' must be true or false, not {shown(parallel)}",
                         "parallel_tool_calls")
    req = ToolRequest(tools=tools, parallel=parallel is not False, json_schema=json_schema,
                      reasoning_format=reasoning_format)
    if isinstance(choice, dict):
        f = choice.get("function")
        if choice.get("type") != "function" or not isinstance(f, dict) or not isinstance(
                f.get("name"), str):
            raise BadRequest(f"'{cfield}' must be {_CHOICE_FORMS}", cfield)
        named = [t for t in tools if t["function"]["name"] == f["name"]]
        if not named:
            raise BadRequest(f"'{cfield}' names {shown(f['name'])}, which is not in the "
                             f"request's {field}", cfield)
        req.tools, req.choice, req.parallel = named, "required", False
    elif choice is None:
        req.choice = "auto"
    elif choice in ("none", "auto", "required"):
        req.choice = choice
        if choice == "required" and not tools:
            raise BadRequest(f"'{cfield}' is \"required\" but the request gives no tools",
                             cfield)
    else:
        raise BadRequest(f"'{cfield}' must be {_CHOICE_FORMS}", cfield)
    kwargs = body.get("chat_template_kwargs")
    if kwargs is not None:
        if not isinstance(kwargs, dict):
            raise BadRequest("'chat_template_kwargs' must be an object of template "
                             "variables", "chat_template_kwargs")
        req.extra.update(kwargs)
        if "enable_thinking" in kwargs:
            if not isinstance(kwargs["enable_thinking"], bool):
                raise BadRequest("chat_template_kwargs.enable_thinking must be true or false",
                                 "chat_template_kwargs.enable_thinking")
            req.enable_thinking = kwargs["enable_thinking"]
    effort = body.get("reasoning_effort")
    if effort is not None:
        if effort not in REASONING_EFFORTS:
            raise BadRequest(f"'reasoning_effort' must be one of {', '.join(REASONING_EFFORTS)}"
                             f", not {shown(effort)}", "reasoning_effort")
        req.extra.setdefault("reasoning_effort", effort)
        if effort == "none":
            req.enable_thinking = False
    rf = body.get("reasoning_format")
    if rf is not None:
        if rf not in REASONING_FORMATS:
            raise BadRequest(f"'reasoning_format' must be one of {', '.join(REASONING_FORMATS)}"
                             f", not {shown(rf)}", "reasoning_format")
        req.reasoning_format = rf
    req.reasoning_format = "none" if req.reasoning_format == "none" else "deepseek"
    agp = body.get("add_generation_prompt")
    if agp is not None:
        if not isinstance(agp, bool):
            raise BadRequest("'add_generation_prompt' must be true or false",
                             "add_generation_prompt")
        req.add_generation_prompt = agp
    return req
