"""The embedded server's request bodies as pydantic schemas: one schema per endpoint.

One job: say what a valid body is, so that nothing invalid reaches the engine (where one bad
request could fail every request of a step) and nothing invalid turns into a 500. Every schema
is **strict** (no ``"1"`` for 1, no ``1.0`` for an integer, no ``"no"`` for false, no ``true``
for a string; an integer is accepted where a float is expected), refuses unknown keys, bounds
every size, and bounds every number to the range its consumer accepts (``sampling_seed`` within
``torch.Generator.manual_seed``'s range, ``logit_bias`` values within ±100, so no integer can
overflow a float conversion and no adjustment can overflow fp32). A violation is a
:class:`~rollout_server.sampling.RequestError` (HTTP 400) whose message names the field, e.g.
``sampling_params[1].temperature: Input should be a finite number, got nan``.

:func:`parse_body` turns raw bytes into a validated schema instance (invalid JSON, nesting too
deep for the parser and integers beyond Python's digit limit are 400s too). The limits are the
module constants below; docs/rollout.md ("Request validation and isolation") lists them. The weight
and LoRA endpoints' schemas are in :mod:`rollout_server.schemas_weights`, built on the same base.
"""

import json
from typing import Annotated, Any, Literal, Optional, Union

from pydantic import (
    BaseModel,
    ConfigDict,
    Discriminator,
    Field,
    Tag,
    ValidationError,
    ValidationInfo,
    field_validator,
    model_validator,
)
from pydantic_core import PydanticCustomError

from rollout_server.sampling import RequestError, SamplingParams

__all__ = [
    "sampling_params_from_dict",
    "MAX_COUNT",
    "MAX_SEED",
    "MAX_LOGIT_BIAS",
    "MAX_TEMPERATURE",
    "MIN_REPETITION_PENALTY",
    "MAX_NAMED_KEYS",
    "MAX_STOP_STRINGS",
    "MAX_STOP_CHARS",
    "MAX_STOP_TOKEN_IDS",
    "MAX_ID_CHARS",
    "MAX_PATH_CHARS",
    "AbortBody",
    "ContinueBody",
    "GenerateBody",
    "MAX_LORA_NAME_CHARS",
    "PauseBody",
    "SamplingParamsBody",
    "format_validation_error",
    "parse_body",
    "parse_json",
    "validate_body",
]

#: bound of every count, length and index that has no tighter one (a C ``int32``)
MAX_COUNT = 2**31 - 1
#: ``sampling_seed`` range is ``[0, 2**63 - 1]``: the j-th of ``n`` samples seeds ``seed + j``,
#: which stays inside ``torch.Generator.manual_seed``'s ``[-2**63, 2**64 - 1]``
MAX_SEED = 2**63 - 1
#: ``logit_bias`` values lie in ``[-100, 100]`` (OpenAI's range; ±100 already forbids/forces a token)
MAX_LOGIT_BIAS = 100.0
#: ``temperature`` lies in ``[0, 1e4]`` (far above any useful value; the distribution is uniform long before)
MAX_TEMPERATURE = 1e4
#: ``repetition_penalty`` lies in ``[0.01, 2]``: a seen token's logit is divided by it, so a
#: smaller one (1e-300 passed ``> 0``) overflows fp32 logits to inf (issue #31 item 3)
MIN_REPETITION_PENALTY = 0.01
#: an error names at most this many unknown keys, each cut to ``MAX_ID_CHARS // 16`` characters
MAX_NAMED_KEYS = 20
#: ``stop``: at most this many strings of at most ``MAX_STOP_CHARS`` characters (matched every step)
MAX_STOP_STRINGS = 64
MAX_STOP_CHARS = 1024
#: ``stop_token_ids``: at most this many ids (checked every step)
MAX_STOP_TOKEN_IDS = 1024
#: request ids, weight versions, group names, tensor names and dtypes: at most this many characters
MAX_ID_CHARS = 1024
#: ``model_path``, ``master_address``: at most this many characters
MAX_PATH_CHARS = 4096
#: a LoRA adapter's name (``lora_name``, ``lora_path`` of ``/generate``): at most this many characters
MAX_LORA_NAME_CHARS = 256

_ERROR = "asyncrl"  # type of the errors raised by the validators below: their message is complete


def _error(message: str) -> PydanticCustomError:
    return PydanticCustomError(_ERROR, "{message}", {"message": message})


def _one_or_list(item: Any, *, max_items: int = MAX_COUNT, min_items: int = 0) -> Any:
    """``item | list[item]``, told apart by the input's type (so an error names one branch only)."""
    return Annotated[
        Union[
            Annotated[item, Tag("<one>")],
            Annotated[list[item], Tag("<list>"), Field(min_length=min_items, max_length=max_items)],
        ],
        Discriminator(lambda v: "<list>" if isinstance(v, list) else "<one>"),
    ]


def _prompt_kind(v: Any) -> str:
    """``input_ids``: a batch when it is a list of lists, else one prompt (SGLang's rule)."""
    return "<list>" if isinstance(v, list) and v and all(isinstance(t, list) for t in v) else "<one>"


Count = Annotated[int, Field(ge=0, le=MAX_COUNT)]
Id = Annotated[str, Field(max_length=MAX_ID_CHARS)]
TokenIds = Annotated[list[Annotated[int, Field(ge=-MAX_COUNT, le=MAX_COUNT)]], Field(max_length=MAX_COUNT)]


def _version(v: Any) -> Optional[str]:
    """A weight version: a string, or an integer (sent as a number by some clients); never a bool."""
    if v is None:
        return None
    if isinstance(v, bool) or not isinstance(v, (str, int)):
        raise _error(f"must be a string, got {_short(v)}")
    v = str(v) if isinstance(v, str) else _int_str(v)
    if len(v) > MAX_ID_CHARS:
        raise _error(f"must be at most {MAX_ID_CHARS} characters, got {len(v)}")
    return v


def _int_str(v: int) -> str:
    if abs(v) > MAX_SEED:
        raise _error(f"must be a string (or an integer of at most 63 bits), got {_short(v)}")
    return str(v)


class _Strict(BaseModel):
    model_config = ConfigDict(strict=True, extra="forbid", allow_inf_nan=False, frozen=True)

    @model_validator(mode="before")
    @classmethod
    def _none_is_default(cls, data: Any) -> Any:
        """SGLang clients send ``null`` for "not set": a null value takes the field's default."""
        if isinstance(data, dict) and any(v is None for v in data.values()):
            return {k: v for k, v in data.items() if v is not None}
        return data


def _vocab(info: ValidationInfo) -> Optional[int]:
    return (info.context or {}).get("vocab_size")


def _check_token_ids(ids: list[int], info: ValidationInfo, what: str) -> list[int]:
    vocab = _vocab(info)
    if ids:
        lo, hi = min(ids), max(ids)
        bad = lo if lo < 0 else hi
        if lo < 0 or (vocab is not None and hi >= vocab):
            raise _error(f"{what} {bad} out of range [0, {vocab if vocab is not None else 'vocab size'})")
    return ids


# ----------------------------------------------------------------------------------------------
# /generate


class SamplingParamsBody(_Strict):
    """One request's ``sampling_params`` (SGLang's keys and ``verify()`` rules, strict and bounded).

    The server's vocabulary size comes in the validation context (``{"vocab_size": V}``) and
    bounds the token ids of ``stop_token_ids`` and ``logit_bias``.
    """

    max_new_tokens: Count = 128
    stop: _one_or_list(Annotated[str, Field(min_length=1, max_length=MAX_STOP_CHARS)], max_items=MAX_STOP_STRINGS) = []
    stop_token_ids: _one_or_list(Annotated[int, Field(ge=-MAX_COUNT, le=MAX_COUNT)], max_items=MAX_STOP_TOKEN_IDS) = []
    temperature: Annotated[float, Field(ge=0.0, le=MAX_TEMPERATURE)] = 1.0
    top_p: Annotated[float, Field(gt=0.0, le=1.0)] = 1.0
    top_k: Annotated[int, Field(ge=-1, le=MAX_COUNT)] = -1
    min_p: Annotated[float, Field(ge=0.0, le=1.0)] = 0.0
    frequency_penalty: Annotated[float, Field(ge=-2.0, le=2.0)] = 0.0
    presence_penalty: Annotated[float, Field(ge=-2.0, le=2.0)] = 0.0
    repetition_penalty: Annotated[float, Field(ge=MIN_REPETITION_PENALTY, le=2.0)] = 1.0
    min_new_tokens: Count = 0
    n: Annotated[int, Field(ge=1, le=MAX_COUNT)] = 1
    ignore_eos: bool = False
    skip_special_tokens: bool = True
    spaces_between_special_tokens: bool = True
    no_stop_trim: bool = False
    custom_params: Optional[dict[str, Any]] = None
    stream_interval: Optional[Annotated[int, Field(ge=1, le=MAX_COUNT)]] = None
    logit_bias: Optional[dict[str, Annotated[float, Field(ge=-MAX_LOGIT_BIAS, le=MAX_LOGIT_BIAS)]]] = None
    sampling_seed: Optional[Annotated[int, Field(ge=0, le=MAX_SEED)]] = None
    json_schema: Any = None
    regex: Any = None
    ebnf: Any = None
    structural_tag: Any = None
    stop_regex: Any = None

    @field_validator("stop_token_ids")
    @classmethod
    def _stop_ids_in_vocab(cls, v: Any, info: ValidationInfo) -> list[int]:
        return _check_token_ids([v] if isinstance(v, int) else v, info, "token id")

    @field_validator("stop", mode="after")
    @classmethod
    def _stop_list(cls, v: Any) -> list[str]:
        return [v] if isinstance(v, str) else v

    @field_validator("logit_bias", mode="before")
    @classmethod
    def _int_keys(cls, v: Any) -> Any:
        """Python callers may key ``logit_bias`` by int; JSON keys are always strings."""
        if isinstance(v, dict) and any(isinstance(k, int) and not isinstance(k, bool) for k in v):
            return {str(k) if isinstance(k, int) and not isinstance(k, bool) else k: x for k, x in v.items()}
        return v

    @field_validator("logit_bias")
    @classmethod
    def _bias_keys_in_vocab(cls, v: Optional[dict[str, float]], info: ValidationInfo) -> Optional[dict[str, float]]:
        if v:
            vocab = _vocab(info)
            for k in v:
                if not (k.isascii() and k.isdigit()) or len(k) > 10 or (vocab is not None and int(k) >= vocab):
                    raise _error(f"key {_short(k)} is not a token id in [0, {vocab if vocab is not None else 'vocab size'})")
        return v

    @field_validator("json_schema", "regex", "ebnf", "structural_tag", "stop_regex")
    @classmethod
    def _no_grammar(cls, v: Any) -> Any:
        if v is not None:
            raise _error("constrained decoding is not supported by the embedded engine")
        return v

    @model_validator(mode="after")
    def _min_le_max(self) -> "SamplingParamsBody":
        if self.min_new_tokens > self.max_new_tokens:
            raise _error(f"min_new_tokens must be in [0, max_new_tokens ({self.max_new_tokens})], got {self.min_new_tokens}")
        return self

    def to_params(self) -> Any:
        """The engine's :class:`~rollout_server.sampling.SamplingParams` for these values."""
        values = {name: getattr(self, name) for name in SamplingParamsBody.model_fields}
        values["stop"] = list(values["stop"])
        values["stop_token_ids"] = list(values["stop_token_ids"])
        if values["top_k"] == 0:
            values["top_k"] = -1  # all tokens (SGLang maps -1 to 1 << 30; 0 is accepted as "off" here too)
        if values["logit_bias"] is not None:
            values["logit_bias"] = dict(values["logit_bias"])
        return SamplingParams(**values)


#: fields of SGLang's ``GenerateReqInput`` that the embedded engine refuses (400) when they are set
#: (``lora_path`` is accepted: the name of an adapter registered by ``/load_lora_adapter``,
#: applied to this request only; rollout_server/engine_lora.py)
UNSUPPORTED_IF_SET = ("input_embeds", "custom_logit_processor", "image_data", "video_data",
                      "audio_data", "session_params", "token_ids_logprob")

LoraName = Annotated[str, Field(min_length=1, max_length=MAX_LORA_NAME_CHARS, pattern=r"^\S+$")]


class GenerateBody(_Strict):
    """A ``/generate`` body: SGLang's ``GenerateReqInput`` keys (the rest is a 400).

    Context: ``vocab_size`` (token ids are checked against it). Fields that SGLang accepts and
    the embedded engine has no use for (``priority``, ``extra_key``, ``bootstrap_*``, ...) are
    accepted and ignored; the ones in :data:`UNSUPPORTED_IF_SET` are a 400 when set.
    """

    text: Optional[_one_or_list(str, min_items=1)] = None
    input_ids: Optional[Annotated[
        Union[Annotated[TokenIds, Tag("<one>")],
              Annotated[list[TokenIds], Tag("<list>"), Field(max_length=MAX_COUNT)]],
        Discriminator(_prompt_kind),
    ]] = None
    sampling_params: Optional[_one_or_list(SamplingParamsBody)] = None
    rid: Optional[_one_or_list(Id)] = None
    return_logprob: Optional[_one_or_list(Optional[bool])] = None
    logprob_start_len: Annotated[int, Field(ge=-1, le=MAX_COUNT)] = -1
    top_logprobs_num: Count = 0
    stream: bool = False
    lora_path: Optional[_one_or_list(Optional[LoraName])] = None
    """SGLang's: the name of a loaded LoRA adapter (``/load_lora_adapter``) for the request, or one
    per prompt of a batch (null: the base model); an unknown name is a 400."""
    # refused when set
    input_embeds: Any = None
    custom_logit_processor: Any = None
    image_data: Any = None
    video_data: Any = None
    audio_data: Any = None
    session_params: Any = None
    token_ids_logprob: Any = None
    # accepted and ignored
    return_text_in_logprobs: Any = None
    return_hidden_states: Any = None
    return_routed_experts: Any = None
    priority: Any = None
    extra_key: Any = None
    routed_dp_rank: Any = None
    data_parallel_rank: Any = None
    return_prompt_token_ids: Any = None
    log_metrics: Any = None
    modalities: Any = None
    bootstrap_host: Any = None
    bootstrap_port: Any = None
    bootstrap_room: Any = None
    no_logs: Any = None
    background: Any = None
    conversation_id: Any = None
    label: Any = None

    @field_validator(*UNSUPPORTED_IF_SET)
    @classmethod
    def _unsupported(cls, v: Any, info: ValidationInfo) -> Any:
        if v not in (None, [], {}):
            raise _error("not supported by the embedded engine")
        return None

    @field_validator("input_ids")
    @classmethod
    def _ids_in_vocab(cls, v: Any, info: ValidationInfo) -> Any:
        for p in (v if v and isinstance(v[0], list) else [v]):
            _check_token_ids(p, info, "token id")
        return v

    @field_validator("top_logprobs_num")
    @classmethod
    def _top_le_vocab(cls, v: int, info: ValidationInfo) -> int:
        vocab = _vocab(info)
        if vocab is not None and v > vocab:
            raise _error(f"must be an integer in [0, {vocab}], got {v}")
        cap = (info.context or {}).get("max_top_logprobs_num")
        if cap is not None and v > cap:
            raise _error(f"must be at most {cap} (the server's --max-top-logprobs-num, "
                         f"rollout.engine_max_top_logprobs_num), got {v}")
        return v

    @model_validator(mode="after")
    def _one_input(self) -> "GenerateBody":
        if (self.text is None) == (self.input_ids is None):
            raise _error("Either text, input_ids or input_embeds should be provided."
                         if self.text is None else "provide either text or input_ids, not both")
        if self.input_ids is not None and (not self.input_ids or any(p == [] for p in self.input_ids if isinstance(p, list))):
            raise _error("input_ids cannot be empty.")
        return self

    def lora_names(self, nb: int) -> list[Optional[str]]:
        """The adapter name of each of the ``nb`` prompts (None: the base model).

        Raises:
            RequestError: a list of ``lora_path`` whose length is not the batch's.
        """
        v = self.lora_path
        if isinstance(v, list):
            if len(v) != nb:
                raise RequestError(f"lora_path has {len(v)} entries for a batch of {nb}")
            return list(v)
        return [v] * nb

    def prompts(self) -> tuple[Optional[list[str]], Optional[list[list[int]]], bool]:
        """``(texts, input_ids, is_batch)``: the prompts as lists (one of them None)."""
        if self.text is not None:
            return ([self.text], None, False) if isinstance(self.text, str) else (list(self.text), None, True)
        ids = self.input_ids
        if isinstance(ids[0], list):
            return None, [list(p) for p in ids], True
        return None, [list(ids)], False


# ----------------------------------------------------------------------------------------------
# control endpoints


class AbortBody(_Strict):
    """``/abort_request``: abort requests whose rid starts with ``rid``, or all of them."""

    rid: Id = ""
    abort_all: bool = False
    abort_message: Optional[Annotated[str, Field(max_length=MAX_PATH_CHARS)]] = None  # SGLang's; ignored


class PauseBody(_Strict):
    """``/pause_generation`` (an empty body is ``abort``)."""

    mode: Literal["abort", "retract", "in_place"] = "abort"


class ContinueBody(_Strict):
    """``/continue_generation``: no fields (SGLang's ``ContinueGenerationReqInput``)."""


# ----------------------------------------------------------------------------------------------
# parsing and error messages


def parse_json(raw: bytes) -> Any:
    """``json.loads`` whose every failure is a :class:`RequestError` (400), never a 500.

    Raises:
        RequestError: not UTF-8, not JSON, nested too deeply for the parser, or an integer
            beyond Python's digit limit.
    """
    try:
        return json.loads(raw)
    except RecursionError:
        raise RequestError("the request body is not valid JSON: nested too deeply") from None
    except (ValueError, UnicodeDecodeError) as exc:  # JSONDecodeError, the int digit limit, bad UTF-8
        raise RequestError(f"the request body is not valid JSON: {_truncate(str(exc), 200)}") from None


def validate_body(schema: type[BaseModel], body: Any, *, context: Optional[dict] = None, what: str = "") -> Any:
    """``schema.model_validate(body)`` with a :class:`RequestError` naming the field on failure.

    Args:
        what: where the body is (``"/generate request"``), for messages about unknown keys.
    """
    if not isinstance(body, dict):
        raise RequestError("the request body must be a JSON object")
    try:
        return schema.model_validate(body, context=context or {})
    except ValidationError as exc:
        raise RequestError(format_validation_error(exc, schema, what=what)) from None
    except RecursionError:  # pragma: no cover - the JSON parser refuses such nesting first
        raise RequestError("the request body is nested too deeply") from None


def parse_body(schema: type[BaseModel], raw: bytes, *, allow_empty: bool = True, context: Optional[dict] = None,
               what: str = "") -> Any:
    """Raw request bytes -> a validated ``schema`` instance (an empty body is ``{}`` if ``allow_empty``).

    Raises:
        RequestError: anything wrong; the message names the field.
    """
    if not raw.strip():
        if not allow_empty:
            raise RequestError("the request body must be a JSON object")
        return validate_body(schema, {}, context=context, what=what)
    return validate_body(schema, parse_json(raw), context=context, what=what)


def _truncate(s: str, limit: int) -> str:
    return s if len(s) <= limit else s[:limit] + "..."


def _short(v: Any, limit: int = 80) -> str:
    """A bounded description of a (possibly huge or deeply nested) input value."""
    if isinstance(v, list):
        return f"a list of {len(v)} items"
    if isinstance(v, dict):
        return f"an object with {len(v)} keys"
    try:
        r = repr(v)
    except (ValueError, RecursionError):  # an int beyond the digit limit
        r = f"an integer of {v.bit_length()} bits" if isinstance(v, int) else f"a {type(v).__name__}"
    return _truncate(r, limit)


def _loc(parts: tuple) -> str:
    out = ""
    for p in parts:
        if isinstance(p, int):
            out += f"[{p}]"
        elif isinstance(p, str) and (p.startswith("<") or p.startswith("[")):
            continue  # a union tag or pydantic's '[key]' marker
        elif isinstance(p, str) and p.isidentifier():
            out += f".{p}" if out else p
        else:
            out += f"[{_short(p, 40)}]"
    return out


def format_validation_error(exc: ValidationError, schema: type[BaseModel], what: str = "") -> str:
    """One line naming the field and what is wrong with it (unknown keys first, then the first error)."""
    errors = exc.errors(include_url=False)
    extra = [e for e in errors if e["type"] == "extra_forbidden"]
    if extra:
        parent = extra[0]["loc"][:-1]
        found = sorted(str(e["loc"][-1]) for e in extra if e["loc"][:-1] == parent)
        names = [_truncate(n, MAX_ID_CHARS // 16) for n in found[:MAX_NAMED_KEYS]]
        if len(found) > MAX_NAMED_KEYS:  # 100k unknown keys must not make a 1 MB error
            names.append(f"... and {len(found) - MAX_NAMED_KEYS} more")
        model = SamplingParamsBody if ("sampling_params" in parent or schema is SamplingParamsBody) else schema
        accepted = ", ".join(sorted(model.model_fields))
        if model is SamplingParamsBody:
            where = _loc(parent)
            where = f" in {where}" if where not in ("", "sampling_params") else ""
            return f"unknown sampling_params key(s) {names}{where}; accepted keys: {accepted}"
        return f"unknown field(s) {names}{' in ' + what if what else ''}; accepted fields: {accepted or 'none'}"
    e = errors[0]
    where = _loc(e["loc"])
    if e["type"] == _ERROR:
        msg = e["msg"]
    elif e["type"] == "model_type" and not e["loc"]:
        msg = "the request body must be a JSON object"
    elif e["type"] == "missing":
        msg = f"missing required field {where!r}"
        where = ""
    else:
        msg = f"{e['msg']}, got {_short(e.get('input'))}"
    more = f" (and {len(errors) - 1} more problem(s))" if len(errors) > 1 else ""
    return (f"{where}: {msg}" if where else msg) + more


def sampling_params_from_dict(raw: Any, vocab_size: int) -> SamplingParams:
    """Validate a JSON ``sampling_params`` object (``None`` is all defaults) into the engine's record.

    The rules are :class:`SamplingParamsBody`'s: SGLang's keys and ``verify()`` ranges, strict
    types, every number bounded to what the sampler accepts.

    Raises:
        RequestError: not an object, an unknown key, a wrong type or an out-of-range value
            (the message names the key), or a grammar option (unsupported here).
    """
    if raw is None:
        raw = {}
    if not isinstance(raw, dict):
        raise RequestError(f"sampling_params must be an object, got {type(raw).__name__}")
    return validate_body(SamplingParamsBody, raw, context={"vocab_size": int(vocab_size)}).to_params()
