"""The request bodies as pydantic models, parsed by FastAPI. Types are strict (``"3"`` is not an
integer, ``1`` is not a boolean), unknown fields are refused, and so are OpenAI options this server
does not implement; ``errors.validation_error`` turns each refusal into OpenAI's 400 naming its
``param``. A JSON ``null`` means the field's default. Text the server reads (prompts, messages, stop
strings, names) must be valid Unicode: JSON's ``\\udcff`` escape can spell a lone surrogate, which
no tokenizer encodes."""
from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import AfterValidator, BaseModel, ConfigDict, Field, ValidationInfo, field_validator, model_validator
from pydantic_core import PydanticCustomError

from ..engine.sampling_params import MAX_LOGPROBS, RequestOutputKind, SamplingParams
from ..model.image_inputs import decode_data_url

MAX_N = 16
MAX_STOP = 16
SEED_LIMIT = 2 ** 63


def refuse(message: str, code: str = "invalid_value") -> PydanticCustomError:
    return PydanticCustomError(code, message)


def _unicode(value: str) -> str:
    try:
        value.encode("utf-8")
    except UnicodeEncodeError as exc:
        raise refuse(f"must be valid Unicode text (a lone surrogate at index {exc.start})") from None
    return value


Text = Annotated[str, AfterValidator(_unicode)]


def unsupported(accept):
    """A field OpenAI defines that this server does not implement: refused unless its value is one
    that changes nothing (``accept``), never silently ignored."""
    def check(value):
        if not accept(value):
            raise refuse("not supported by this server", "unsupported_parameter")
        return value
    return Annotated[Any, AfterValidator(check)]


class OpenAIRequest(BaseModel):
    model_config = ConfigDict(strict=True, extra="forbid", allow_inf_nan=False)

    @model_validator(mode="before")
    @classmethod
    def _null_is_default(cls, data):
        return {k: v for k, v in data.items() if v is not None} if isinstance(data, dict) else data


class Sampling(OpenAIRequest):
    """The fields completions and chat completions share (each endpoint has its own
    ``max_tokens`` and its default)."""
    model: Text | None = None
    n: int = Field(1, ge=1, le=MAX_N)
    best_of: int | None = None
    seed: int | None = Field(None, ge=0, lt=SEED_LIMIT)
    temperature: float = Field(1.0, ge=0, le=2)
    top_p: float = Field(1.0, gt=0, le=1)
    top_k: int = 0
    stop: list[Text] = []
    stream: bool = False
    repetition_penalty: float = Field(1.0, gt=0)
    ignore_eos: bool = False
    # which distribution reported logprobs are of (SamplingParams.logprobs_mode, vLLM's name)
    logprobs_mode: Literal["raw_logprobs", "processed_logprobs"] = "raw_logprobs"
    # accepted and ignored: they do not change the tokens
    user: Any = None
    stream_options: Any = None
    metadata: Any = None
    store: Any = None
    service_tier: Any = None
    reasoning_effort: Any = None
    # refused unless they change nothing
    suffix: unsupported(lambda v: v == "") = None
    logit_bias: unsupported(lambda v: v == {}) = None
    presence_penalty: unsupported(lambda v: v == 0) = None
    frequency_penalty: unsupported(lambda v: v == 0) = None
    min_p: unsupported(lambda v: v == 0) = None
    tools: unsupported(lambda v: v == []) = None
    tool_choice: unsupported(lambda v: v == "none") = None
    functions: unsupported(lambda v: False) = None
    function_call: unsupported(lambda v: False) = None
    response_format: unsupported(lambda v: v == {"type": "text"}) = None
    parallel_tool_calls: unsupported(lambda v: False) = None
    audio: unsupported(lambda v: False) = None
    modalities: unsupported(lambda v: v == ["text"]) = None
    prediction: unsupported(lambda v: False) = None

    @field_validator("best_of")
    @classmethod
    def _best_of_is_n(cls, value, info: ValidationInfo):
        if value != info.data.get("n", value):
            raise refuse("values other than n are not supported", "unsupported_parameter")
        return value

    @field_validator("seed")
    @classmethod
    def _seeds_fit(cls, value, info: ValidationInfo):
        if value is not None and value + info.data.get("n", 1) - 1 >= SEED_LIMIT:
            raise refuse("seed + n - 1 must be < 2**63 (choice i uses seed + i)")
        return value

    @field_validator("top_k")
    @classmethod
    def _top_k(cls, value):
        if value == -1:  # vLLM's "off"
            return 0
        if value < 0:
            raise refuse("must be >= 0 (0 or -1: off)")
        return value

    @field_validator("stop", mode="before")
    @classmethod
    def _stop_list(cls, value):
        if isinstance(value, str):
            value = [value]
        if not isinstance(value, list):
            raise refuse("must be a string or a list of strings", "invalid_type")
        if len(value) > MAX_STOP:
            raise refuse(f"takes at most {MAX_STOP} strings")
        return value

    @field_validator("stop")
    @classmethod
    def _stop_nonempty(cls, value):
        return [s for s in value if s]

    def params(self, max_tokens: int, seed: int, logprobs: int | None,
               prompt_logprobs: int | None = None) -> SamplingParams:
        return SamplingParams(max_tokens=max_tokens, temperature=self.temperature, top_k=self.top_k,
                              top_p=self.top_p, seed=seed, stop=list(self.stop),
                              repetition_penalty=self.repetition_penalty, ignore_eos=self.ignore_eos,
                              logprobs=logprobs, prompt_logprobs=prompt_logprobs, logprobs_mode=self.logprobs_mode,
                              # a stream sends each step's new tokens; a whole response needs the last output only
                              output_kind=RequestOutputKind.DELTA if self.stream else RequestOutputKind.FINAL_ONLY)


class CompletionRequest(Sampling):
    prompt: list[str | list[int]]
    echo: bool = False
    logprobs: int | None = Field(None, ge=0, le=MAX_LOGPROBS)
    max_tokens: int = Field(16, ge=0)  # OpenAI's default; after echo, which allows 0

    @field_validator("prompt", mode="before")
    @classmethod
    def _prompts(cls, value):
        """A string, a list of strings, a list of token ids or a list of token-id lists -> a list of
        prompts, each a string or a list of ints."""
        if isinstance(value, str):
            return [_unicode(value)]
        if isinstance(value, list) and value:
            if all(isinstance(p, str) for p in value):
                return [_unicode(p) for p in value]
            if all(type(t) is int for t in value):
                return [value]
            if all(isinstance(p, list) and p and all(type(t) is int for t in p) for p in value):
                return value
        raise refuse("must be a string, a list of strings, a list of token ids or a list of non-empty "
                     "token-id lists (non-empty)", "invalid_type")

    @field_validator("max_tokens")
    @classmethod
    def _zero_needs_echo(cls, value, info: ValidationInfo):
        if value == 0 and not info.data.get("echo", False):
            raise refuse("must be >= 1 (0 is allowed with echo: prompt logprobs only)")
        return value


def decode_image_url(part: dict):
    """An ``image_url`` part's image: HxWx3 uint8. Only base64 ``data:`` URLs: a server should not fetch
    from the network on a request's behalf."""
    image_url = part.get("image_url")
    url = image_url.get("url") if isinstance(image_url, dict) else image_url
    if not isinstance(url, str) or not url.startswith("data:"):
        raise refuse("image_url: only base64 data: URLs are accepted (data:image/png;base64,...); this server does "
                     "not fetch images from the network", "unsupported_parameter")
    try:
        return decode_data_url(url)
    except ValueError as exc:
        raise refuse(f"image_url: {exc}") from None


class Message(BaseModel):
    model_config = ConfigDict(strict=True, extra="ignore")
    role: Text
    content: Any  # text, or the parts that hold an image (checked by ``_parts``)

    @field_validator("content", mode="before")
    @classmethod
    def _parts(cls, value):
        """Text; ``[{"type": "text", "text": ...}, ...]`` -> their text joined; with ``image_url`` parts, the
        parts as ``{"type": "text", "text": ...}`` and ``{"type": "image", "image": HxWx3 uint8}``; others are
        refused."""
        if isinstance(value, str):
            return _unicode(value)
        if not isinstance(value, list):
            raise refuse("Input should be a valid string or a list of content parts", "string_type")
        parts = []
        for part in value:
            kind = part.get("type") if isinstance(part, dict) else None
            if kind == "text" and isinstance(part.get("text"), str):
                parts.append({"type": "text", "text": _unicode(part["text"])})
            elif kind == "image_url":
                parts.append({"type": "image", "image": decode_image_url(part)})
            else:
                raise refuse("only text and image_url parts are supported", "unsupported_parameter")
        if all(p["type"] == "text" for p in parts):
            return "".join(p["text"] for p in parts)
        return parts

    def images(self) -> list:
        return [] if isinstance(self.content, str) else [p["image"] for p in self.content if p["type"] == "image"]

    def for_template(self) -> dict:
        """The message as chat templates take it: image parts as ``{"type": "image"}``."""
        if isinstance(self.content, str):
            return {"role": self.role, "content": self.content}
        return {"role": self.role, "content": [p if p["type"] == "text" else {"type": "image"} for p in self.content]}


class ChatCompletionRequest(Sampling):
    messages: list[Message] = Field(min_length=1)
    logprobs: bool = False
    top_logprobs: int | None = Field(None, ge=0, le=MAX_LOGPROBS)
    max_tokens: int | None = Field(None, ge=1)
    max_completion_tokens: int | None = Field(None, ge=1)

    @field_validator("top_logprobs")
    @classmethod
    def _needs_logprobs(cls, value, info: ValidationInfo):
        if value is not None and not info.data.get("logprobs", False):
            raise refuse("needs 'logprobs': true")
        return value


class TokenizeRequest(BaseModel):
    """lm-eval's remote tokenizer: a prompt, or chat messages through the chat template."""
    model_config = ConfigDict(strict=True, extra="ignore")
    prompt: Text | None = None
    messages: list[Message] | None = None
    add_special_tokens: bool = True
    add_generation_prompt: bool = True


class DetokenizeRequest(BaseModel):
    model_config = ConfigDict(strict=True, extra="ignore")
    tokens: list[int]


DEFAULT_DRAIN_TIMEOUT_S = 120.0


class UpdateWeightsFromDiskRequest(OpenAIRequest):
    """SGLang's body: a checkpoint directory on the server's disk, and (an extension) how many
    seconds to wait for the requests in flight to finish."""
    model_path: Text = Field(min_length=1)
    timeout: float = Field(DEFAULT_DRAIN_TIMEOUT_S, gt=0, le=3600)
