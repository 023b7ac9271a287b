"""`StructuredOutputFields.naming_the_field`: the engine's processor names a bad constraint
`structured_outputs.<kind>` whichever field carried it; the error a client gets names the field
it filled (`response_format`, `guided_<kind>`), and leaves every other error as it is.

Called directly, on requests parsed as the server parses them (JSON), with the messages the
processor really writes (`constraints.py`) and the param `ServerError.from_value_error` takes
from them.
"""

from __future__ import annotations

import json

import pytest

from aserve.server.errors import ServerError
from aserve.server.protocol import ChatCompletionRequest, CompletionRequest
from aserve.structured_output.constraints import constraint_job, grammar_of

NOT_A_SCHEMA = {"type": "nope"}
MESSAGES = [{"role": "user", "content": "Hi"}]


def chat(**fields) -> ChatCompletionRequest:
    return ChatCompletionRequest.model_validate_json(json.dumps({"messages": MESSAGES, **fields}))


def completion(**fields) -> CompletionRequest:
    return CompletionRequest.model_validate_json(json.dumps({"prompt": "Hi", **fields}))


def processor_error(kind: str, value) -> ServerError:
    """The 400 the processor's refusal of this constraint becomes (`serving.prepare`)."""
    with pytest.raises(ValueError) as refused:
        grammar_of(kind, value, False)
    return ServerError.from_value_error(refused.value)


def test_a_bad_response_format_schema_is_named_as_the_client_wrote_it():
    error = processor_error("json", NOT_A_SCHEMA)
    assert error.param == "structured_outputs.json"  # what the processor says
    assert error.message.startswith("structured_outputs.json is not a valid JSON schema: ")
    fmt = {"type": "json_schema", "json_schema": {"name": "x", "schema": NOT_A_SCHEMA}}
    for body in (chat(response_format=fmt), completion(response_format=fmt)):
        message, param = body.naming_the_field(error.message, error.param)
        assert param == "response_format"
        assert message == ("response_format.json_schema.schema"
                           + error.message.removeprefix("structured_outputs.json"))
        assert "structured_outputs" not in message


def test_response_format_json_object_is_named_response_format():
    message, param = chat(response_format={"type": "json_object"}).naming_the_field(
        "structured_outputs.json_object could not be compiled: x", "structured_outputs.json_object")
    assert (message, param) == ("response_format could not be compiled: x", "response_format")


@pytest.mark.parametrize("field, kind, value", [
    ("guided_json", "json", NOT_A_SCHEMA),
    ("guided_grammar", "grammar", "root ::= nowhere"),
    ("guided_regex", "regex", "(unclosed"),  # refused by the compile job (`compile_job`)
])
def test_a_bad_guided_constraint_is_named_guided_kind(field, kind, value):
    if kind == "regex":
        error = ServerError.from_value_error(ValueError(
            "structured_outputs.regex could not be compiled: unclosed group"))
    else:
        error = processor_error(kind, value)
    assert error.param == f"structured_outputs.{kind}"
    message, param = chat(**{field: value}).naming_the_field(error.message, error.param)
    assert param == field
    assert message == field + error.message.removeprefix(f"structured_outputs.{kind}")


def test_a_constraint_over_the_caps_is_named_too():
    from aserve.sampling_params import StructuredOutputsParams

    choices = [str(i) for i in range(10_001)]
    with pytest.raises(ValueError) as refused:
        constraint_job(StructuredOutputsParams(choice=choices))
    error = ServerError.from_value_error(refused.value)
    message, param = chat(guided_choice=choices).naming_the_field(error.message, error.param)
    assert param == "guided_choice" and message.startswith("guided_choice has 10001 entries")


def test_structured_outputs_itself_keeps_its_own_name():
    error = processor_error("json", NOT_A_SCHEMA)
    body = chat(structured_outputs={"json": NOT_A_SCHEMA})
    assert body.naming_the_field(error.message, error.param) == (error.message, error.param)


@pytest.mark.parametrize("message, param", [
    ("structured_outputs takes one constraint per request, got a, b.", "structured_outputs"),
    ("top_k must be -1 or at least 1.", "top_k"),
    ("Something went wrong.", None),
])
def test_other_errors_are_left_as_they_are(message, param):
    fmt = {"type": "json_schema", "json_schema": {"name": "x", "schema": {}}}
    assert chat(response_format=fmt).naming_the_field(message, param) == (message, param)


def test_a_tool_constraint_is_left_for_the_tools_to_name():
    """No field of the request carried it (tool_choice "required" made it): `chat.py` names it
    `tools`; a `response_format` of type text constrains nothing."""
    error = processor_error("json", NOT_A_SCHEMA)
    tool = {"type": "function", "function": {"name": "f", "parameters": {}}}
    body = chat(tools=[tool], tool_choice="required", response_format={"type": "text"})
    assert body.naming_the_field(error.message, error.param) == (error.message, error.param)


def test_a_message_that_does_not_start_with_the_field_keeps_its_words():
    fmt = {"type": "json_schema", "json_schema": {"name": "x", "schema": {}}}
    message, param = chat(response_format=fmt).naming_the_field(
        "The constraint took too long.", "structured_outputs.json")
    assert (message, param) == ("The constraint took too long.", "response_format")
