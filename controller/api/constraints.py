"""A request's structured-output constraints, compiled before it is queued.

From the body (response_format, structured_outputs, tools with tool_choice) to compiled
grammars (controller/text/grammar.py), or a 400 naming the parameter and the engine's reason.
Each constraint's text is bounded (--max-grammar-chars) before compiling; compiling runs on a
small thread pool, off the event loop, and a repeated constraint is answered from the cache
without leaving it.

A request has at most one output grammar: response_format or structured_outputs, or the
tool-call grammar of tool_choice "required" / a named function (asking for both is a 400).
"""

from __future__ import annotations

import asyncio
import re
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

from controller.api.errors import MAX_QUOTE, APIError
from controller.api.structured import ChatTool, NamedToolChoice, ResponseFormat, StructuredOutputs
from controller.text.grammar import (
    CompiledGrammar,
    Constraint,
    GrammarCompiler,
    GrammarError,
    GrammarLimits,
    GrammarTooLarge,
    choice_constraint,
    json_schema_constraint,
)
from controller.text.tools import ToolCallFormat

COMPILE_THREADS = 2  # grammars compiled at once (the rest wait their turn)
# The engine's reasons quote the client's text: each quoted run is cut to MAX_QUOTE characters.
_LONG_QUOTE = re.compile("([\"'])([^\"']{" + str(MAX_QUOTE) + "})[^\"']+")


def _reason(exc: Exception) -> str:
    """The engine's reason, quoting at most MAX_QUOTE characters of the client's text."""
    return _LONG_QUOTE.sub(r"\1\2...", str(exc))


@dataclass
class RequestGrammars:
    """What a request's output is constrained to, compiled."""

    # response_format / structured_outputs, or the calls tool_choice forces ("required", a
    # named function): the format's call grammar with each function's parameters schema.
    output: CompiledGrammar | None = None


def grammar_limits(config: Any) -> GrammarLimits:
    """The grammar bounds of a controller's settings (defaults for settings it lacks)."""
    d = GrammarLimits()

    def get(name: str, default: int) -> int:
        value = getattr(config, name, None)
        return value if isinstance(value, int) and not isinstance(value, bool) else default

    return GrammarLimits(
        max_chars=get("max_grammar_chars", d.max_chars),
        cache_entries=get("grammar_cache_entries", d.cache_entries),
        cache_bytes=get("grammar_cache_mib", d.cache_bytes >> 20) << 20,
    )


def output_constraint(
    response_format: ResponseFormat | None, structured: StructuredOutputs | None
) -> tuple[Constraint, str] | None:
    """The output's constraint and the parameter that set it; None for free text."""
    wants_format = response_format is not None and response_format.type != "text"
    if wants_format and structured is not None:
        raise APIError(
            "Give response_format or structured_outputs, not both.", 400, "structured_outputs"
        )
    if structured is not None:
        if structured.json_ is not None:
            return json_schema_constraint(structured.json_), "structured_outputs.json"
        if structured.regex is not None:
            return Constraint("regex", structured.regex), "structured_outputs.regex"
        if structured.choice is not None:
            return choice_constraint(structured.choice), "structured_outputs.choice"
        if structured.grammar is not None:
            return Constraint("grammar", structured.grammar), "structured_outputs.grammar"
        return Constraint("json_object", ""), "structured_outputs.json_object"
    if not wants_format:
        return None
    if response_format.type == "json_object" or response_format.json_schema.schema_ is None:
        return Constraint("json_object", ""), "response_format"
    schema = response_format.json_schema.schema_
    return json_schema_constraint(schema), "response_format.json_schema.schema"


def forced_functions(
    tools: list[ChatTool] | None, choice: str | NamedToolChoice | None
) -> list[tuple[int, dict[str, Any]]]:
    """(index in tools, function) of each function the output must be a call of: all for
    "required", the named one for a named tool_choice, none otherwise ("auto" and "none" leave
    the output free; a strict tool is not enforced under "auto"); 400 when tool_choice asks
    for tools that are not there."""
    tools = tools or []
    if isinstance(choice, NamedToolChoice):
        index = next(
            (i for i, t in enumerate(tools) if t.function.name == choice.function.name), -1
        )
        if index < 0:
            raise APIError("tool_choice names a function that is not in tools.", 400, "tool_choice")
        chosen = [index]
    elif choice == "required":
        if not tools:
            raise APIError('tool_choice "required" needs tools.', 400, "tool_choice")
        chosen = list(range(len(tools)))
    else:
        chosen = []
    return [(i, tools[i].function.model_dump(exclude_none=True)) for i in chosen]


def tool_constraint(
    functions: list[dict[str, Any]], fmt: ToolCallFormat, parallel: bool | None
) -> Constraint:
    """The grammar of an output that is only calls of `functions` in `fmt` (several unless
    parallel_tool_calls is false)."""
    return Constraint("grammar", fmt.grammar(functions, parallel is not False))


class ConstraintCompiler:
    """Compiles a request's constraints off the event loop, with the grammar cache."""

    def __init__(self, compiler: GrammarCompiler | None):
        self.compiler = compiler  # None: this tokenizer has no grammar support
        self._pool = ThreadPoolExecutor(COMPILE_THREADS, thread_name_prefix="grammar")

    async def compile(self, constraint: Constraint, param: str) -> CompiledGrammar:
        """One constraint compiled, or the 400 that refuses it."""
        if self.compiler is None:
            raise APIError(
                "Structured output is not available for this model's tokenizer.", 400, param
            )
        try:
            self.compiler.check_size(constraint)
            hit = self.compiler.cached(constraint)
            if hit is not None:
                return hit
            loop = asyncio.get_running_loop()
            return await loop.run_in_executor(self._pool, self.compiler.compile, constraint)
        except GrammarTooLarge as exc:
            raise APIError(f"{param}: {exc}", 400, param, "grammar_too_large") from None
        except GrammarError as exc:
            raise APIError(
                f"Invalid {param}: {_reason(exc)}", 400, param, "invalid_grammar"
            ) from None

    async def request_grammars(
        self,
        response_format: ResponseFormat | None,
        structured: StructuredOutputs | None,
        tools: list[ChatTool] | None = None,
        tool_choice: str | NamedToolChoice | None = None,
        parallel_tool_calls: bool | None = None,
        tool_format: ToolCallFormat | None = None,
    ) -> RequestGrammars:
        """A request's output constraint, compiled, or the 400 that refuses it."""
        found = output_constraint(response_format, structured)
        forced = forced_functions(tools, tool_choice)
        if found is not None and forced:
            raise APIError(
                'tool_choice "required" or a named function constrains the output to tool '
                "calls; response_format and structured_outputs cannot constrain it as well.",
                400,
                "tool_choice",
            )
        if found is not None:
            return RequestGrammars(await self.compile(*found))
        if not forced or tool_format is None:
            return RequestGrammars()
        functions = [fn for _, fn in forced]
        constraint = tool_constraint(functions, tool_format, parallel_tool_calls)
        try:
            return RequestGrammars(await self.compile(constraint, "tools"))
        except APIError as exc:
            if exc.code != "invalid_grammar":
                raise
            await self._blame_tool(forced)
            raise

    async def _blame_tool(self, forced: list[tuple[int, dict[str, Any]]]) -> None:
        """The 400 of the first forced tool whose parameters schema is refused on its own
        (a refused call grammar names the tool it comes from)."""
        for i, fn in forced:
            schema = fn.get("parameters") or {"type": "object"}
            await self.compile(json_schema_constraint(schema), f"tools[{i}].function.parameters")
