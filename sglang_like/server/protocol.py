"""Request bodies of the HTTP APIs (native, OpenAI, tokenizer, dashboard), their sampling params."""

from __future__ import annotations

from typing import Annotated, Any, Literal, TypeVar

from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    StrictBool,
    StrictFloat,
    StrictInt,
    ValidationError,
    WithJsonSchema,
    model_validator,
)

from sglang_like.sampling_params import MAX_STOP_TOKEN_IDS, SamplingParams
from sglang_like.server.errors import ApiError, pydantic_message
from sglang_like.server.json_schemas import (
    SAMPLING_RANGES,
    ImageData,
    NonEmptyStr,
    OpenAIStop,
    TextParts,
    TokenId,
    TokenIds,
    documented,
    exactly_one_of,
    sampling_params_schema,
)

# Keys SGLang's own client sends in sampling_params that this runtime has no use for.
_IGNORED_SAMPLING_KEYS = ("spaces_between_special_tokens",)
# Keys it sends that we accept only when unset.
_UNSUPPORTED_SAMPLING_KEYS = ("stop_regex", "custom_params")
# SGLang's names for our fields; sglang-router passes `sampling_seed` on and drops `seed`.
_SAMPLING_ALIASES = {"sampling_seed": "seed"}
_OPENAI_MAX_N = 16
_M = TypeVar("_M", bound=BaseModel)
_OPENAI_MAX_TOP_LOGPROBS = 20
# any start past the prompt means "no input logprobs"; the bound keeps it a 64-bit int, which
# is what crosses to the engine process (msgspec refuses wider ints)
_MAX_LOGPROB_START_LEN = (1 << 63) - 1


# vLLM's request field: requests of different salts share no cached prefix (on top of the
# server's own separation of API keys)
CacheSalt = Annotated[str, Field(min_length=1, max_length=256)]
_CACHE_SALT_FIELD = Field(None, description="requests with different salts never share a "
                                            "cached prefix (vLLM's field)")
# SGLang's and vLLM's request field: the request's place in the queue under priority
# scheduling (the engine refuses one other than 0 without it); 64-bit, as it crosses processes
Priority = Annotated[StrictInt, Field(ge=-(1 << 63), le=(1 << 63) - 1)]
_PRIORITY_FIELD = Field(None, description="the request's scheduling priority (SGLang's and "
                                          "vLLM's field); needs --enable-priority-scheduling "
                                          "unless null or 0")
# a LoRA adapter's name in a request: bounded like a rid (it also is an OpenAI model id)
_MAX_LORA_NAME_CHARS = 256
LoraPath = Annotated[str, Field(max_length=_MAX_LORA_NAME_CHARS)]


# ---- native /generate ---------------------------------------------------------------------
# Validation stays a plain dict (clean_sampling_params checks it); the schema documents it.
_SamplingDict = Annotated[dict[str, Any], WithJsonSchema(
    sampling_params_schema(_IGNORED_SAMPLING_KEYS, _UNSUPPORTED_SAMPLING_KEYS, _SAMPLING_ALIASES)
)]


class GenerateRequest(BaseModel):
    """POST /generate, the shape SGLang's `GenerateReqInput` accepts (fields we serve)."""

    # a field this server does not know is a 400 naming it (an SGLang feature not served here
    # must not be silently dropped); what sglang-router adds is declared below
    model_config = ConfigDict(extra="forbid", json_schema_extra=exactly_one_of("text", "input_ids"))

    text: NonEmptyStr | list[NonEmptyStr] | None = documented(None, minItems=1)
    input_ids: TokenIds | list[TokenIds] | None = documented(None, minItems=1)
    sampling_params: _SamplingDict | list[_SamplingDict] | None = None
    stream: StrictBool = False
    return_logprob: StrictBool | list[StrictBool] | None = None
    logprob_start_len: StrictInt | list[StrictInt] | None = documented(
        None, minimum=-1, maximum=_MAX_LOGPROB_START_LEN)
    top_logprobs_num: StrictInt | list[StrictInt] | None = documented(None, minimum=0, maximum=100)
    return_text_in_logprobs: StrictBool = False
    rid: str | list[str] | None = None
    # What sglang-router adds when it re-serializes a body, at its values: accepted (this
    # server has no hidden-state, byte or entropy outputs and no background requests; asking
    # for one is a 400 naming it, see `engine_kwargs`)
    model: str | None = Field(None, description="ignored (sglang-router sends null)")
    log_metrics: StrictBool = Field(True, description="ignored")
    no_logs: StrictBool = Field(False, description="ignored")
    background: StrictBool = Field(False, description="only false")
    return_hidden_states: StrictBool = Field(False, description="only false: not supported")
    return_bytes: StrictBool = Field(False, description="only false: not supported")
    return_entropy: StrictBool = Field(False, description="only false: not supported")
    # sglang-router's PD mode (--pd-disaggregation): where the prefill and decode workers meet
    bootstrap_host: str | list[str] | None = None
    bootstrap_port: StrictInt | list[StrictInt] | None = None
    bootstrap_room: StrictInt | list[StrictInt] | None = None
    cache_salt: CacheSalt | None = _CACHE_SALT_FIELD
    priority: Priority | None = _PRIORITY_FIELD
    lora_path: LoraPath | list[LoraPath | None] | None = Field(
        None, description="the loaded LoRA adapter to run on (SGLang's field: its name), or "
                          "one per prompt of a batch; null: the base model")
    image_data: ImageData | list[ImageData | list[ImageData] | None] | None = Field(
        None, description="images for a vision-language model (SGLang's field): a data: or "
                          "http(s) URL, base64, or a local path under "
                          "--allowed-local-media-path; one or a list for a text prompt naming "
                          "each with the model's placeholder (<image>), or one entry per "
                          "prompt of a batch. A text-only model answers 400")

    @property
    def is_batch(self) -> bool:
        if self.text is not None:
            return isinstance(self.text, list)
        return bool(self.input_ids) and isinstance(self.input_ids[0], list)

    @property
    def batch_size(self) -> int:
        if not self.is_batch:
            return 1
        return len(self.text if self.text is not None else self.input_ids or [])

    def engine_kwargs(self) -> dict[str, Any]:
        """Checked keyword arguments for `Engine.generate` (ApiError(400) on a bad combination)."""
        if (self.text is None) == (self.input_ids is None):
            raise ApiError(400, "exactly one of `text` and `input_ids` must be given")
        for name in ("background", "return_hidden_states", "return_bytes", "return_entropy"):
            if getattr(self, name):
                raise ApiError(400, f"{name} is not supported by this server", name)
        if self.is_batch and self.batch_size == 0:
            raise ApiError(400, "the batch of prompts is empty")
        if self.text is not None:
            texts = self.text if isinstance(self.text, list) else [self.text]
            if any(t == "" for t in texts):
                raise ApiError(400, "prompt text must not be empty")
        elif any(len(ids) == 0 for ids in _id_lists(self.input_ids)):
            raise ApiError(400, "input_ids must not be empty")
        if self.rid is not None and isinstance(self.rid, list) != self.is_batch:
            raise ApiError(400, "rid must be a list exactly when the input is a batch")
        if isinstance(self.rid, list) and len(self.rid) != self.batch_size:
            raise ApiError(400, "rid list must have one id per prompt")
        sampling = self.sampling_params
        if isinstance(sampling, list):
            if not self.is_batch or len(sampling) != self.batch_size:
                raise ApiError(400, "a list of sampling_params needs one entry per prompt")
            sampling = [clean_sampling_params(sp) for sp in sampling]
        else:
            sampling = clean_sampling_params(sampling)
        logprob_start_len = _collapse("logprob_start_len", self.logprob_start_len, -1)
        top_logprobs_num = _collapse("top_logprobs_num", self.top_logprobs_num, 0)
        if not -1 <= logprob_start_len <= _MAX_LOGPROB_START_LEN:
            raise ApiError(400, f"logprob_start_len must be in [-1, {_MAX_LOGPROB_START_LEN}], "
                                f"got {logprob_start_len}")
        if not 0 <= top_logprobs_num <= 100:
            raise ApiError(400, f"top_logprobs_num must be in [0, 100], got {top_logprobs_num}")
        if self.is_batch and self.image_data is not None and (
                not isinstance(self.image_data, list) or len(self.image_data) != self.batch_size):
            raise ApiError(400, "for a batch of prompts, image_data needs one entry per prompt",
                           "image_data")
        return {
            "prompt": self.text,
            "input_ids": self.input_ids,
            "sampling_params": sampling,
            "return_logprob": _collapse("return_logprob", self.return_logprob, False),
            "logprob_start_len": logprob_start_len,
            "top_logprobs_num": top_logprobs_num,
            "return_text_in_logprobs": self.return_text_in_logprobs,
            "rid": self.rid,
            **bootstrap_kwargs(self),
            **self.lora_kwargs(),
            **({} if self.image_data is None else {"image_data": self.image_data}),
        }

    def lora_kwargs(self) -> dict[str, Any]:
        """`lora_path` for Engine.generate, present only when an adapter is named (an engine
        without LoRA never sees the keyword). SGLang's clients send a one-entry list for a
        single prompt and lists of nulls for the base model: both are taken."""
        lora = self.lora_path
        if isinstance(lora, list):
            if not self.is_batch:
                if len(lora) != 1:
                    raise ApiError(400, "lora_path must be a name, or a list with one entry "
                                        "per prompt of a batch", "lora_path")
                lora = lora[0]
            elif len(lora) != self.batch_size:
                raise ApiError(400, f"lora_path has {len(lora)} entries for "
                                    f"{self.batch_size} prompts", "lora_path")
            elif not any(lora):
                lora = None
        return {"lora_path": lora} if lora else {}


# ---- LoRA adapters (sglang_like.server.lora_api) -----------------------------------------
class LoadLoraAdapterRequest(BaseModel):
    """POST /load_lora_adapter, SGLang's `LoadLoRAAdapterReqInput` (the fields we serve)."""

    model_config = ConfigDict(extra="ignore")

    lora_name: NonEmptyStr = documented(..., maxLength=_MAX_LORA_NAME_CHARS,
                                        description="the name requests will use")
    lora_path: NonEmptyStr = Field(description="a PEFT adapter folder on the server's disk")
    pinned: StrictBool = Field(False, description="never evicted by --max-loaded-loras")


class UnloadLoraAdapterRequest(BaseModel):
    """POST /unload_lora_adapter, SGLang's `UnloadLoRAAdapterReqInput`."""

    model_config = ConfigDict(extra="ignore")

    lora_name: NonEmptyStr


class SwitchModeRequest(BaseModel):
    """POST /switch_disaggregation_mode (sglang_like.server.disaggregation_api)."""

    model_config = ConfigDict(extra="forbid")

    mode: str = Field(description="prefill, decode or null (a regular worker)")
    bootstrap_port: StrictInt | None = Field(None, ge=1, le=65535,
                                             description="a prefill worker's bootstrap port")
    # a switch holds a worker thread while it drains: bounded, so a few cannot starve the pool
    drain_timeout: StrictFloat | StrictInt = Field(60.0, ge=0, le=300)


def bootstrap_kwargs(body: Any) -> dict[str, Any]:
    """The PD bootstrap fields, the cache salt and the priority a body carries, as
    Engine.generate keyword arguments (the runner adds the caller's tenant to the salt)."""
    return {k: getattr(body, k) for k in ("bootstrap_host", "bootstrap_port", "bootstrap_room",
                                          "cache_salt", "priority")
            if getattr(body, k, None) is not None}


def clean_sampling_params(params: dict[str, Any] | None) -> dict[str, Any]:
    """Drop keys SGLang's client sends that we ignore, then validate (ValueError -> 400)."""
    params = dict(params or {})
    for key in _IGNORED_SAMPLING_KEYS:
        params.pop(key, None)
    for key in _UNSUPPORTED_SAMPLING_KEYS:
        if params.pop(key, None) not in (None, [], {}, ""):
            raise ApiError(400, f"sampling parameter {key!r} is not supported by this server")
    for alias, name in _SAMPLING_ALIASES.items():
        value = params.pop(alias, None)
        if value is None:
            continue
        if params.get(name) is not None and params[name] != value:
            raise ApiError(400, f"{alias} ({value!r}) and {name} ({params[name]!r}) differ")
        params[name] = value
    if isinstance(params.get("stop"), list) and not params["stop"]:
        params["stop"] = None
    if isinstance(params.get("stop_token_ids"), list) and not params["stop_token_ids"]:
        params["stop_token_ids"] = None
    try:
        SamplingParams.from_dict(params)
    except (TypeError, ValueError) as e:
        raise ApiError(400, str(e)) from None
    return params


def _collapse(name: str, value: Any, default: Any) -> Any:
    """A per-prompt list of one value is served; different values per prompt are not."""
    if value is None:
        return default
    if isinstance(value, list):
        if not value:
            return default
        if any(v != value[0] for v in value):
            raise ApiError(400, f"different {name} values per prompt are not supported")
        return value[0]
    return value


def _id_lists(input_ids: list | None) -> list[list[int]]:
    if not input_ids:
        return [[]]
    return input_ids if isinstance(input_ids[0], list) else [input_ids]


class AbortRequest(BaseModel):
    """POST /abort_request, SGLang's `AbortReq` body: one request id, or every request."""

    model_config = ConfigDict(extra="ignore")

    rid: str | None = None
    abort_all: StrictBool = False


# ---- OpenAI-compatible --------------------------------------------------------------------
class StreamOptions(BaseModel):
    include_usage: StrictBool = False


class _OpenAISampling(BaseModel):
    """Fields shared by /v1/completions and /v1/chat/completions, plus SGLang-style extras.

    Numbers and flags are strict (an int is a number, but `true` or "0.5" is no temperature),
    as the native path's SamplingParams checks are and the OpenAPI document says. A field not
    declared here (OpenAI's `audio`, `modalities`, `prediction`, `service_tier`, ...) is a 400
    naming it: output the server would not shape as asked is never silently plain text.
    """

    model_config = ConfigDict(extra="forbid")

    model: str | None = None
    n: StrictInt = documented(1, minimum=1, maximum=_OPENAI_MAX_N)
    stream: StrictBool = False
    stream_options: StreamOptions | None = None
    stop: OpenAIStop | None = documented(None, maxItems=16)
    temperature: StrictFloat | None = documented(None, **SAMPLING_RANGES["temperature"])
    top_p: StrictFloat | None = documented(None, **SAMPLING_RANGES["top_p"])
    presence_penalty: StrictFloat | None = documented(None, **SAMPLING_RANGES["presence_penalty"])
    frequency_penalty: StrictFloat | None = documented(
        None, **SAMPLING_RANGES["frequency_penalty"]
    )
    seed: StrictInt | None = documented(None, **SAMPLING_RANGES["seed"])
    user: str | None = None
    # extras (SGLang / vLLM spelling)
    top_k: StrictInt | None = documented(None, anyOf=[
        *SAMPLING_RANGES["top_k"]["anyOf"], {"type": "null"}])
    min_p: StrictFloat | None = documented(None, **SAMPLING_RANGES["min_p"])
    repetition_penalty: StrictFloat | None = documented(
        None, **SAMPLING_RANGES["repetition_penalty"]
    )
    min_tokens: StrictInt | None = documented(None, **SAMPLING_RANGES["min_new_tokens"])
    # llama.cpp's DRY and XTC samplers (llama-server's and vLLM's extra body fields)
    dry_multiplier: StrictFloat | None = documented(None, **SAMPLING_RANGES["dry_multiplier"])
    dry_base: StrictFloat | None = documented(None, **SAMPLING_RANGES["dry_base"])
    dry_allowed_length: StrictInt | None = documented(
        None, **SAMPLING_RANGES["dry_allowed_length"])
    dry_penalty_last_n: StrictInt | None = documented(
        None, **SAMPLING_RANGES["dry_penalty_last_n"])
    dry_sequence_breakers: list[str] | None = documented(
        None, **SAMPLING_RANGES["dry_sequence_breakers"])
    xtc_probability: StrictFloat | None = documented(None, **SAMPLING_RANGES["xtc_probability"])
    xtc_threshold: StrictFloat | None = documented(None, **SAMPLING_RANGES["xtc_threshold"])
    ignore_eos: StrictBool | None = None
    skip_special_tokens: StrictBool | None = None
    no_stop_trim: StrictBool | None = None
    stop_token_ids: list[TokenId] | None = documented(None, maxItems=MAX_STOP_TOKEN_IDS)
    regex: str | None = None
    json_schema: dict[str, Any] | str | None = None
    ebnf: str | None = None
    response_format: ResponseFormat | None = None
    logit_bias: dict[str, StrictFloat | StrictInt] | None = Field(
        None, description="token id -> bias in [-100, 100] added to its logit (-100 bans it)")
    # sglang-router sends it (false) on every OpenAI body
    return_hidden_states: StrictBool = Field(False, description="only false: not supported")
    # sglang-router's PD mode (--pd-disaggregation): where the prefill and decode workers meet
    bootstrap_host: str | None = None
    bootstrap_port: StrictInt | None = None
    bootstrap_room: StrictInt | None = None
    cache_salt: CacheSalt | None = _CACHE_SALT_FIELD
    priority: Priority | None = _PRIORITY_FIELD
    lora_path: LoraPath | None = Field(
        None, description="SGLang's field: the loaded LoRA adapter to run on; a `model` "
                          "naming an adapter (`adapter` or `base:adapter`) comes first")

    def check_common(self) -> None:
        if self.return_hidden_states:
            raise ApiError(400, "return_hidden_states is not supported by this server",
                           "return_hidden_states")
        if not 1 <= self.n <= _OPENAI_MAX_N:
            raise ApiError(400, f"n must be in [1, {_OPENAI_MAX_N}], got {self.n}", "n")
        if isinstance(self.stop, list) and len(self.stop) > 16:
            raise ApiError(400, "at most 16 stop sequences", "stop")

    def sampling_dict(self, max_new_tokens: int) -> dict[str, Any]:
        """SGLang sampling params for one choice; validated (ApiError(400) naming the field)."""
        params: dict[str, Any] = {
            "max_new_tokens": max_new_tokens,
            "temperature": 1.0 if self.temperature is None else self.temperature,
            "top_p": 1.0 if self.top_p is None else self.top_p,
            "stop": self.stop or None,
        }
        optional = {
            "presence_penalty": self.presence_penalty,
            "frequency_penalty": self.frequency_penalty,
            "seed": self.seed,
            "top_k": self.top_k,
            "min_p": self.min_p,
            "repetition_penalty": self.repetition_penalty,
            "min_new_tokens": self.min_tokens,
            "dry_multiplier": self.dry_multiplier,
            "dry_base": self.dry_base,
            "dry_allowed_length": self.dry_allowed_length,
            "dry_penalty_last_n": self.dry_penalty_last_n,
            "dry_sequence_breakers": self.dry_sequence_breakers,
            "xtc_probability": self.xtc_probability,
            "xtc_threshold": self.xtc_threshold,
            "ignore_eos": self.ignore_eos,
            "skip_special_tokens": self.skip_special_tokens,
            "no_stop_trim": self.no_stop_trim,
            "stop_token_ids": self.stop_token_ids,
            "regex": self.regex,
            "json_schema": self.json_schema,
            "ebnf": self.ebnf,
            "logit_bias": self.logit_bias or None,
        }
        params.update({k: v for k, v in optional.items() if v is not None})
        if self.response_format is not None:
            params.update(self.response_format.constraint())
        try:
            SamplingParams.from_dict(params)
        except (TypeError, ValueError) as e:
            raise ApiError(400, _openai_names(str(e))) from None
        return params


def _openai_names(message: str) -> str:
    return message.replace("max_new_tokens", "max_tokens").replace("min_new_tokens", "min_tokens")


def check_max_tokens(value: int | None, name: str, context_length: int) -> None:
    if value is None:
        return
    if value < 1:
        raise ApiError(400, f"{name} must be at least 1, got {value}", name)
    if value > context_length:
        raise ApiError(
            400, f"{name} ({value}) exceeds the model's context length ({context_length})", name
        )


class CompletionRequest(_OpenAISampling):
    """POST /v1/completions."""

    prompt: NonEmptyStr | list[NonEmptyStr] | TokenIds | list[TokenIds] = documented(
        ..., minItems=1
    )
    max_tokens: StrictInt | None = documented(
        16, minimum=0, description="0 (with echo): score the prompt only, generate nothing"
    )
    logprobs: StrictInt | None = documented(None, minimum=0, maximum=_OPENAI_MAX_TOP_LOGPROBS)
    echo: StrictBool = documented(
        False, description="prepend the prompt to the text; with logprobs, the prompt tokens' "
        "logprobs come first (the first one null)"
    )
    suffix: str | None = documented(None, maxLength=0, description="not supported")
    best_of: StrictInt | None = None

    def prompts(self) -> list[str | list[int]]:
        """The prompts as a list of strings or token-id lists (ApiError(400) when empty)."""
        p = self.prompt
        if isinstance(p, str):
            items: list[Any] = [p]
        elif p and all(isinstance(x, int) for x in p):
            items = [p]
        else:
            items = list(p)
        if not items:
            raise ApiError(400, "prompt must not be empty", "prompt")
        for item in items:
            if len(item) == 0:
                raise ApiError(400, "prompt must not be empty", "prompt")
        return items

    @property
    def max_new_tokens(self) -> int:
        return 16 if self.max_tokens is None else self.max_tokens

    def check(self, context_length: int) -> None:
        self.check_common()
        if self.max_tokens == 0:  # vLLM's scoring request: prefill only, echo the prompt
            if not self.echo:
                raise ApiError(400, "max_tokens 0 is only allowed with echo", "max_tokens")
        else:
            check_max_tokens(self.max_tokens, "max_tokens", context_length)
        if self.logprobs is not None and not 0 <= self.logprobs <= _OPENAI_MAX_TOP_LOGPROBS:
            raise ApiError(400, f"logprobs must be in [0, {_OPENAI_MAX_TOP_LOGPROBS}]", "logprobs")
        if self.suffix:
            raise ApiError(400, "suffix is not supported", "suffix")
        if self.best_of is not None and self.best_of != self.n:
            raise ApiError(400, "best_of other than n is not supported", "best_of")


class JsonSchemaFormat(BaseModel):
    model_config = ConfigDict(extra="ignore", populate_by_name=True)

    name: str | None = None
    schema_: dict[str, Any] | None = Field(default=None, alias="schema")
    strict: StrictBool | None = None


class ResponseFormat(BaseModel):
    type: Literal["text", "json_object", "json_schema"]
    json_schema: JsonSchemaFormat | None = None

    def constraint(self) -> dict[str, Any]:
        """The sampling-params constraint this format asks for."""
        if self.type == "json_object":
            return {"json_object": True}
        if self.type == "json_schema":
            if self.json_schema is None or self.json_schema.schema_ is None:
                raise ApiError(400, "response_format json_schema needs json_schema.schema")
            return {"json_schema": self.json_schema.schema_}
        return {}


def _image_url(part: dict[str, Any]) -> str:
    image = part.get("image_url")
    url = image.get("url") if isinstance(image, dict) else image
    if not isinstance(url, str) or not url:
        raise ApiError(400, "an image_url part needs image_url.url (a data: or http(s) URL)",
                       "messages")
    if isinstance(image, dict) and image.get("detail", "auto") != "auto":
        # OpenAI's low/high pick its own tiling; here the model's processor decides
        raise ApiError(400, "image_url.detail: only auto is served (the model's own "
                            "preprocessing sizes the image)", "messages")
    return url


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="allow")

    role: Literal["system", "user", "assistant", "tool", "developer"]
    content: str | TextParts | None = None
    name: str | None = None
    tool_calls: list[dict[str, Any]] | None = None  # an assistant turn's calls
    tool_call_id: str | None = None  # a tool result: the call it answers

    def template_dict(self) -> dict[str, Any]:
        """The message for the chat template: text parts joined into one string, or where it
        has images, its parts as the templates of vision-language models read them
        ({"type": "text", "text": ...} and {"type": "image"})."""
        out = self.model_dump(exclude_none=True)
        content = self.content
        if isinstance(content, list):
            parts: list[dict[str, Any]] = []
            for part in content:
                if part.get("type") == "text" and isinstance(part.get("text"), str):
                    parts.append({"type": "text", "text": part["text"]})
                elif part.get("type") == "image_url":
                    _image_url(part)  # checked here: a 400 before the template runs
                    parts.append({"type": "image"})
                else:
                    raise ApiError(400, "content parts must be text or image_url",
                                   "messages")
            content = parts if any(p["type"] == "image" for p in parts) else "".join(
                p["text"] for p in parts)
        out["content"] = content or ""
        if out["role"] == "developer":
            out["role"] = "system"
        return out

    def image_urls(self) -> list[str]:
        """The URLs of the message's image_url parts, in order."""
        if not isinstance(self.content, list):
            return []
        return [_image_url(p) for p in self.content if p.get("type") == "image_url"]


class ChatCompletionRequest(_OpenAISampling):
    """POST /v1/chat/completions."""

    messages: list[ChatMessage] = documented(..., minItems=1)
    max_tokens: StrictInt | None = documented(None, minimum=1)
    max_completion_tokens: StrictInt | None = documented(None, minimum=1)
    logprobs: StrictBool = False
    top_logprobs: StrictInt | None = documented(
        None, minimum=0, maximum=_OPENAI_MAX_TOP_LOGPROBS, description="needs logprobs: true"
    )
    tools: list[dict[str, Any]] | None = Field(
        None, description='function tools: {"type": "function", "function": {name, '
                          'description, parameters}}')
    tool_choice: Literal["none", "auto", "required"] | dict[str, Any] | None = Field(
        None, description='"none", "auto" (default with tools), "required", or '
                          '{"type": "function", "function": {"name": ...}}')
    parallel_tool_calls: StrictBool | None = Field(
        None, description="false: at most one tool call (default true)")
    continue_final_message: StrictBool = False
    # reasoning models (--reasoning-parser; sglang-router sends the first two on every body)
    separate_reasoning: StrictBool = Field(
        True, description="with --reasoning-parser: the think block as message.reasoning_content "
                          "(delta.reasoning_content when streamed); false: the raw text")
    stream_reasoning: StrictBool = Field(
        True, description="false: the reasoning in one delta once the block closes (needs "
                          "--reasoning-parser)")
    thinking_budget: StrictInt | None = documented(
        None, minimum=0, description="at most this many answer tokens before the server "
        "closes the think block (needs --reasoning-parser; default --reasoning-budget)")
    chat_template_kwargs: dict[str, Any] | None = Field(
        None, description='variables for the chat template, e.g. {"enable_thinking": false}; '
                          "each must be one the template reads")

    @property
    def requested_max_tokens(self) -> int | None:
        return self.max_completion_tokens if self.max_completion_tokens is not None else (
            self.max_tokens
        )

    def check(self, context_length: int) -> None:
        self.check_common()
        if not self.messages:
            raise ApiError(400, "messages must not be empty", "messages")
        check_max_tokens(self.max_tokens, "max_tokens", context_length)
        check_max_tokens(self.max_completion_tokens, "max_completion_tokens", context_length)
        if self.top_logprobs is not None:
            if not 0 <= self.top_logprobs <= _OPENAI_MAX_TOP_LOGPROBS:
                raise ApiError(
                    400, f"top_logprobs must be in [0, {_OPENAI_MAX_TOP_LOGPROBS}]", "top_logprobs"
                )
            if not self.logprobs:
                raise ApiError(400, "top_logprobs needs logprobs: true", "top_logprobs")
        if self.thinking_budget is not None and self.thinking_budget < 0:
            raise ApiError(400, "thinking_budget must be at least 0", "thinking_budget")


for _model in (CompletionRequest, ChatCompletionRequest):
    _model.model_rebuild()


# ---- tokenizer and dashboard routes -------------------------------------------------------
# Kept here, not beside their routes, so openapi.py lists their schemas without importing the
# route modules (which import openapi.py for `operation`).
_MAX_PROMPTS = 1024


class TokenizeRequest(BaseModel):
    """POST /tokenize: vLLM's and SGLang's body (text prompts; `model` is not checked)."""

    model_config = ConfigDict(extra="ignore")

    model: str | None = None
    prompt: str | list[str] = documented(..., maxItems=_MAX_PROMPTS)
    add_special_tokens: StrictBool = documented(
        True, description="add the BOS/EOS the tokenizer's post-processor adds, as a text "
        "prompt to /v1/completions gets; special tokens written in the text are always parsed"
    )
    return_token_strs: StrictBool = documented(False, description="also the token strings")


class DetokenizeRequest(BaseModel):
    """POST /detokenize: token ids (or a list of such lists) back to text."""

    model_config = ConfigDict(extra="ignore")

    model: str | None = None
    tokens: list[TokenId] | list[list[TokenId]] = documented(..., maxItems=1 << 20)
    skip_special_tokens: StrictBool = documented(
        False, description="drop special tokens (vLLM keeps them; SGLang's default drops them)"
    )


class _Message(BaseModel):
    model_config = ConfigDict(extra="forbid")
    role: Literal["system", "user", "assistant", "tool"]
    content: str


class CacheMatchRequest(BaseModel):
    """Exactly one of `text` (a raw prompt), `input_ids`, or `messages` (put through the chat
    template with the generation prompt, as /v1/chat/completions would)."""

    model_config = ConfigDict(extra="forbid")
    text: str | None = None
    input_ids: list[int] | None = Field(default=None, max_length=1_000_000)
    messages: list[_Message] | None = Field(default=None, min_length=1)

    @model_validator(mode="after")
    def _one_input(self) -> CacheMatchRequest:
        given = [k for k in ("text", "input_ids", "messages") if getattr(self, k) is not None]
        if len(given) != 1:
            raise ValueError("give exactly one of text, input_ids, messages")
        return self


def parse_model(model: type[_M], data: Any) -> _M:
    """Validate a decoded JSON body into `model`; ApiError(400) with the field errors."""
    if not isinstance(data, dict):
        raise ApiError(400, f"request body must be a JSON object, got {type(data).__name__}")
    try:
        return model.model_validate(data)
    except ValidationError as e:
        raise ApiError(400, pydantic_message(e)) from None
