"""The tool-calling and structured-output fields of a chat request, checked as vLLM 0.33's request model checks
them (before field validation, on the raw body; errors name their parameter)."""

from __future__ import annotations

from typing import Any

from kernelsight.server.wire.protocol.validation import VLLMValidationError

_CORRECT_USAGE = 'Correct usage: `{"type": "function", "function": {"name": "my_function"}}`'


def check_response_format(data: dict[str, Any]) -> None:
    rf = data.get("response_format")
    if isinstance(rf, dict) and rf.get("type") == "json_schema" and rf.get("json_schema") is None:
        raise VLLMValidationError("When response_format type is 'json_schema', the 'json_schema' field must be "
                                  "provided.", "response_format")


def check_structured_outputs(data: dict[str, Any]) -> None:
    so = data.get("structured_outputs")
    if not isinstance(so, dict):
        return
    count = sum(so.get(k) is not None for k in ("json", "regex", "choice"))
    if count > 1:
        raise VLLMValidationError("You can only use one kind of constraints for structured outputs ('json', 'regex' "
                                  "or 'choice').")
    if count > 0 and data.get("tool_choice", "none") not in ("none", "auto", "required"):
        raise VLLMValidationError("You can only either use constraints for structured outputs or tools, not both.")


def check_tool_usage(data: dict[str, Any]) -> None:
    """vLLM's checks of ``tools`` / ``tool_choice``; a missing ``tool_choice`` with tools becomes "auto"."""
    if data.get("tools") == []:
        raise VLLMValidationError("`tools` must not be an empty array. Either provide at least one tool or omit the "
                                  "field entirely.", "tools")
    if "tool_choice" not in data and data.get("tools"):
        data["tool_choice"] = "auto"
    choice = data.get("tool_choice")
    if choice is None or choice == "none":
        return
    if data.get("tools") is None:
        raise VLLMValidationError("When using `tool_choice`, `tools` must be set.", "tool_choice")
    if choice not in ("auto", "required") and not isinstance(choice, dict):
        raise VLLMValidationError(f"Invalid value for `tool_choice`: {choice}! Only named tools, \"none\", \"auto\" "
                                  "or \"required\" are supported.", "tool_choice")
    if isinstance(choice, dict):
        function = choice.get("function")
        if not isinstance(function, dict):
            raise VLLMValidationError(f"Invalid value for `function`: `{function}` in `tool_choice`! "
                                      f"{_CORRECT_USAGE}", "tool_choice.function")
        if "name" not in function:
            raise VLLMValidationError(f"Expected field `name` in `function` in `tool_choice`! {_CORRECT_USAGE}",
                                      "tool_choice.function.name")
        name = function["name"]
        if not isinstance(name, str) or not name:
            raise VLLMValidationError(f"Invalid `name` in `function`: `{name}` in `tool_choice`! {_CORRECT_USAGE}",
                                      "tool_choice.function.name")
        tools = data["tools"] if isinstance(data["tools"], list) else []
        if not any(isinstance(t, dict) and isinstance(t.get("function"), dict) and t["function"].get("name") == name
                   for t in tools):
            raise VLLMValidationError("The tool specified in `tool_choice` does not match any of the specified "
                                      "`tools`", "tool_choice")
