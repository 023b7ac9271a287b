"""The request fields that constrain a completion, OpenAI's and vLLM's, and the one
`StructuredOutputsParams` they mean:

    response_format      {"type": "text" | "json_object" | "json_schema", "json_schema":
                          {"name", "schema", "strict", "description"}}       (OpenAI)
    structured_outputs   {"json" | "regex" | "choice" | "grammar" | "json_object" |
                          "structural_tag": ..., "disable_any_whitespace"}    (vLLM)
    guided_json, guided_regex, guided_choice, guided_grammar                 (vLLM, older)

At most one constraint per request (two are a 400 naming both). The constraint itself (a schema,
a regex, a grammar) is compiled, and refused if bad, too large or too slow to compile, by the
engine's processor: a 400 that names `structured_outputs.<kind>`, whichever field carried it,
until `naming_the_field` names the field the request used (`response_format`, `guided_json`).
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator

from aserve.sampling_params import StructuredOutputsParams

JsonSchema = dict[str, Any] | bool


class StrictModel(BaseModel):
    """The base of every request model: types as JSON Schema states them (no coercion but the
    protocol's own), unknown fields ignored (OpenAI adds new ones often), no inf / nan."""

    model_config = ConfigDict(strict=True, extra="ignore", allow_inf_nan=False)


_BY_NAME = ConfigDict(**StrictModel.model_config, populate_by_name=True)  # aliased fields


class JsonSchemaFormat(StrictModel):
    model_config = _BY_NAME

    name: str = "response"
    description: str | None = None
    json_schema: JsonSchema | None = Field(default=None, alias="schema")
    strict: bool | None = None


class ResponseFormat(StrictModel):
    type: Literal["text", "json_object", "json_schema"]
    json_schema: JsonSchemaFormat | None = None

    @model_validator(mode="after")
    def _schema_given(self) -> ResponseFormat:
        if self.type == "json_schema" and (self.json_schema is None
                                           or self.json_schema.json_schema is None):
            raise ValueError("a response_format of type json_schema needs json_schema.schema.")
        return self


class StructuredOutputsRequest(StrictModel):
    """vLLM's `structured_outputs` request field."""

    json_: str | JsonSchema | None = Field(default=None, alias="json")
    regex: str | None = None
    choice: Annotated[list[str], Field(min_length=1)] | None = None
    grammar: str | None = None
    json_object: bool | None = None
    structural_tag: str | dict[str, Any] | None = None
    disable_any_whitespace: bool = False

    model_config = _BY_NAME


class StructuredOutputFields(StrictModel):
    """Mixed into the completions and chat requests."""

    response_format: ResponseFormat | None = None
    structured_outputs: StructuredOutputsRequest | None = None
    guided_json: str | JsonSchema | None = None
    guided_regex: str | None = None
    guided_choice: Annotated[list[str], Field(min_length=1)] | None = None
    guided_grammar: str | None = None
    guided_decoding_backend: str | None = None  # the server's backend is used whatever it says
    guided_whitespace_pattern: None = None  # would change the output: refused, see below

    def structured_outputs_params(self) -> StructuredOutputsParams | None:
        """The request's one constraint, or None; ValueError naming the fields otherwise."""
        found: dict[str, dict[str, Any]] = {}
        fmt = self.response_format
        if fmt is not None and fmt.type == "json_object":
            found["response_format"] = {"json_object": True}
        elif fmt is not None and fmt.type == "json_schema":
            found["response_format"] = {"json": fmt.json_schema.json_schema}
        if self.structured_outputs is not None:
            spec = self.structured_outputs.model_dump(exclude_none=True, by_alias=True)
            whitespace = spec.pop("disable_any_whitespace", False)
            if spec.get("json_object") is False:
                spec.pop("json_object")
            if spec:
                found["structured_outputs"] = {**spec, "disable_any_whitespace": whitespace}
        for name, kind in (("guided_json", "json"), ("guided_regex", "regex"),
                           ("guided_choice", "choice"), ("guided_grammar", "grammar")):
            if getattr(self, name) is not None:
                found[name] = {kind: getattr(self, name)}
        if len(found) > 1:
            raise ValueError(f"structured_outputs takes one constraint per request, got "
                             f"{', '.join(found)}.")
        return StructuredOutputsParams(**found.popitem()[1]) if found else None

    def naming_the_field(self, message: str, param: str | None) -> tuple[str, str | None]:
        """(message, param) of an error about the request's constraint, naming the field the
        request used: the processor says `structured_outputs.<kind>` whichever field carried
        it. `response_format` (its schema: `response_format.json_schema.schema` in the
        message) or `guided_<kind>`; an error about `structured_outputs` itself, or about
        anything else, is left as it is."""
        if not param or not param.startswith("structured_outputs."):
            return message, param
        fmt, kind = self.response_format, param.split(".")[1]
        if fmt is not None and fmt.type != "text":
            field = "response_format"
            shown = f"{field}.json_schema.schema" if fmt.type == "json_schema" else field
        elif getattr(self, f"guided_{kind}", None) is not None:
            field = shown = f"guided_{kind}"
        else:
            return message, param
        if message.startswith(param):
            message = shown + message[len(param):]
        return message, field
