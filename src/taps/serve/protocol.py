"""The OpenAI wire format: requests checked field by field, responses and stream chunks shaped.

Every mistake in a request raises `RequestError` naming the field (`param`, e.g. `messages[1].content`
or `taps.variant`); the app answers it as `{"error": {"message", "type", "param", "code"}}` with its
status (400 unless said). Fields the server does not use (`user`, `presence_penalty`, ...) are
ignored, as OpenAI-compatible servers do; fields asking for what it cannot do (`n` > 1, `tools`,
`logprobs`) are refused rather than silently dropped. A string that is not valid Unicode (a lone
surrogate such as "\\ud800", which JSON can spell) is refused wherever it is, before any field is
read: the tokenizer and the JSON encoder of the answer would fail on it.
"""

from __future__ import annotations

import json
import math
import os
import time
import uuid
from dataclasses import dataclass, field

ROLES = {"system": "system", "developer": "system", "user": "user", "assistant": "assistant"}
MAX_STOP = 4
FINISH = {"stop_token": "stop", "stop_string": "stop", "max_new_tokens": "length"}  # a cut answer has none
SEED_RANGE = (-(2 ** 63), 2 ** 63 - 1)  # a signed 64-bit integer, as OpenAI's API takes it


class RequestError(Exception):
    def __init__(self, message: str, param: str | None = None, status: int = 400, code: str | None = None,
                 kind: str = "invalid_request_error", headers: dict | None = None):
        super().__init__(message)
        self.message, self.param, self.status, self.code, self.kind = message, param, status, code, kind
        self.headers = headers or {}

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": self.kind, "param": self.param, "code": self.code}}


@dataclass
class GenerationRequest:
    """What a chat or completion request asks for, checked; `prompt` is messages (chat) or text / ids."""

    model: str
    prompt: object
    chat: bool
    max_tokens: int | None = None
    temperature: float = 1.0
    top_p: float = 1.0
    seed: int = 0
    stop: list[str] = field(default_factory=list)
    stream: bool = False
    include_usage: bool = False
    variant: str | None = None
    learn: bool = True  # extra_body.taps.learn = false: this request is not kept by `taps serve --learn`


def parse_json(raw: bytes) -> dict:
    try:
        body = json.loads(raw)
    except (ValueError, UnicodeDecodeError, RecursionError) as err:  # ValueError: JSONDecodeError, > 4300 digits
        why = "nested too deeply" if isinstance(err, RecursionError) else str(err)[:200]
        raise RequestError(f"the request body is not valid JSON ({why})", param="body", code="invalid_json") from None
    if not isinstance(body, dict):
        raise RequestError(f"the request body must be a JSON object, got {_kind(body)}", param="body")
    where = _not_unicode(body)
    if where is not None:
        raise RequestError(f"{where} is not valid Unicode text: it holds a lone surrogate (an unpaired "
                           "\\ud800-\\udfff escape)", param=where, code="invalid_unicode")
    return body


def _not_unicode(body: dict) -> str | None:
    """The path (e.g. `messages[0].content`; `body` for a key) of a string holding a lone
    surrogate; None if there is none. Iterative: the nesting may be as deep as JSON allows."""
    stack = [(body, "")]
    while stack:
        value, where = stack.pop()
        if isinstance(value, str):
            if not (value.isascii() or _encodes(value)):
                return where
        elif isinstance(value, dict):
            if not all(_encodes(key) for key in value):
                return where or "body"
            stack += [(item, f"{where}.{key}" if where else key) for key, item in reversed(value.items())]
        elif isinstance(value, list):
            stack += [(item, f"{where}[{i}]") for i, item in reversed(list(enumerate(value)))
                      if isinstance(item, (str, dict, list))]
    return None


def _encodes(text: str) -> bool:
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        return False
    return True


def _kind(value) -> str:
    return {bool: "a boolean", int: "an integer", float: "a number", str: "a string", list: "an array",
            dict: "an object", type(None): "null"}.get(type(value), type(value).__name__)


def _wrong(param: str, expected: str, value) -> RequestError:
    return RequestError(f"{param} must be {expected}, got {_kind(value)}" + (f" ({value!r})" if _scalar(value) else ""),
                        param=param)


def _scalar(value) -> bool:
    return isinstance(value, (int, float, str)) and len(repr(value)) < 80


def _number(body: dict, key: str, default: float, low: float, high: float, low_open: bool = False) -> float:
    value = body.get(key)
    if value is None:
        return default
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
        raise _wrong(key, "a number", value)
    if value < low or value > high or (low_open and value == low):
        bounds = f"{'(' if low_open else '['}{low:g}, {high:g}]"
        raise RequestError(f"{key} must be in {bounds}, got {value!r}", param=key)
    return float(value)


def _integer(body: dict, key: str, low: int | None = None) -> int | None:
    value = body.get(key)
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int):
        raise _wrong(key, "an integer", value)
    if low is not None and value < low:
        raise RequestError(f"{key} must be >= {low}, got {value}", param=key)
    return value


def _seed(body: dict) -> int:
    seed = _integer(body, "seed")
    low, high = SEED_RANGE
    if seed is not None and not low <= seed <= high:
        raise RequestError(f"seed must be a 64-bit signed integer, in [{low}, {high}], got {seed}", param="seed")
    return seed or 0


def _boolean(body: dict, key: str, where: str | None = None) -> bool:
    value = body.get(key)
    if value is None:
        return False
    if not isinstance(value, bool):
        raise _wrong(where or key, "true or false", value)
    return value


def _stop(body: dict) -> list[str]:
    value = body.get("stop")
    if value is None:
        return []
    stops = [value] if isinstance(value, str) else value
    if not isinstance(stops, list) or not all(isinstance(s, str) for s in stops):
        raise _wrong("stop", "a string or an array of strings", value)
    if len(stops) > MAX_STOP or any(not s for s in stops):
        raise RequestError(f"stop takes 1 to {MAX_STOP} non-empty strings, got {len(stops)}"
                           + (" with an empty one" if any(not s for s in stops) else ""), param="stop")
    return stops


def _unsupported(body: dict) -> None:
    n = _integer(body, "n", low=1)
    if n is not None and n != 1:
        raise RequestError(f"n must be 1 (one choice per request), got {n}", param="n")
    for key in ("tools", "functions"):
        if body.get(key):
            raise RequestError(f"{key} are not supported by this server", param=key)
    if body.get("logprobs") not in (None, False):
        raise RequestError("logprobs are not supported by this server", param="logprobs")
    if body.get("echo") not in (None, False):
        raise RequestError("echo is not supported by this server", param="echo")


def _taps_options(body: dict) -> tuple[str | None, bool]:
    """extra_body.taps: (the variant, whether the request may be learned from)."""
    options = body.get("taps")
    if options is None:
        return None, True
    if not isinstance(options, dict):
        raise _wrong("taps", 'an object such as {"variant": "math"}', options)
    unknown = sorted(set(options) - {"variant", "learn"})
    if unknown:
        raise RequestError(f"taps has unknown key {unknown[0]!r}; expected variant or learn", param=f"taps.{unknown[0]}")
    variant = options.get("variant")
    if variant is not None and (not isinstance(variant, str) or not variant.strip()):
        raise _wrong("taps.variant", "a variant name or spec string", variant)
    learn = options.get("learn", True)
    if not isinstance(learn, bool):
        raise _wrong("taps.learn", "true or false", learn)
    return variant, learn


def _common(body: dict, chat: bool, prompt: object) -> GenerationRequest:
    model = body.get("model")
    if model is None:
        raise RequestError("model is required", param="model")
    if not isinstance(model, str):
        raise _wrong("model", "a string", model)
    _unsupported(body)
    max_tokens = _integer(body, "max_completion_tokens", low=1) if chat else None
    given = _integer(body, "max_tokens", low=1)
    max_tokens = given if given is not None else max_tokens
    options = body.get("stream_options")
    if options is not None and not isinstance(options, dict):
        raise _wrong("stream_options", "an object", options)
    include_usage = _boolean(options or {}, "include_usage", "stream_options.include_usage")
    variant, learn = _taps_options(body)
    return GenerationRequest(
        model=model, prompt=prompt, chat=chat, max_tokens=max_tokens,
        temperature=_number(body, "temperature", 1.0, 0.0, 2.0), top_p=_number(body, "top_p", 1.0, 0.0, 1.0, True),
        seed=_seed(body), stop=_stop(body), stream=_boolean(body, "stream"),
        include_usage=include_usage, variant=variant, learn=learn)


def parse_chat(body: dict) -> GenerationRequest:
    messages = body.get("messages")
    if messages is None:
        raise RequestError("messages is required", param="messages")
    if not isinstance(messages, list) or not messages:
        raise _wrong("messages", "a non-empty array of messages", messages) if not isinstance(messages, list) else \
            RequestError("messages must not be empty", param="messages")
    checked = []
    for i, message in enumerate(messages):
        where = f"messages[{i}]"
        if not isinstance(message, dict):
            raise _wrong(where, 'an object such as {"role": "user", "content": "..."}', message)
        role = message.get("role")
        if role not in ROLES:
            raise RequestError(f"{where}.role must be one of {', '.join(ROLES)}, got {role!r}", param=f"{where}.role")
        checked.append({"role": ROLES[role], "content": _content(message.get("content"), f"{where}.content")})
    return _common(body, True, checked)


def _content(content, where: str) -> str:
    if isinstance(content, str):
        return content
    if isinstance(content, list):  # [{"type": "text", "text": "..."}, ...]
        texts = []
        for j, part in enumerate(content):
            if not isinstance(part, dict) or part.get("type") != "text" or not isinstance(part.get("text"), str):
                raise RequestError(f"{where}[{j}] must be a text part {{\"type\": \"text\", \"text\": \"...\"}} "
                                   "(this server reads text only)", param=f"{where}[{j}]")
            texts.append(part["text"])
        return "".join(texts)
    raise _wrong(where, "a string or an array of text parts", content)


def parse_completion(body: dict) -> GenerationRequest:
    prompt = body.get("prompt")
    if prompt is None:
        raise RequestError("prompt is required", param="prompt")
    if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], (str, list)):
        prompt = prompt[0]  # a batch of one
    if isinstance(prompt, list):
        if not prompt or not all(isinstance(t, int) and not isinstance(t, bool) for t in prompt):
            raise _wrong("prompt", "a string or a non-empty array of token ids (one prompt per request)", prompt)
    elif not isinstance(prompt, str):
        raise _wrong("prompt", "a string or an array of token ids", prompt)
    if body.get("suffix"):
        raise RequestError("suffix is not supported by this server", param="suffix")
    return _common(body, False, prompt)


# ---- responses ---------------------------------------------------------------------------------
def new_id(chat: bool) -> str:
    return ("chatcmpl-" if chat else "cmpl-") + uuid.uuid4().hex[:24]


def usage(outcome, variant) -> dict:
    """OpenAI's usage plus the acceptance figures of this response, where its decode time went
    (`seconds` by phase: setup, prefill, draft, target, other) and the mean verified tree size (for
    compositions, also the share of steps each head had)."""
    completion = len(outcome.tokens)
    figures = {"prompt_tokens": outcome.prompt_tokens, "completion_tokens": completion,
               "total_tokens": outcome.prompt_tokens + completion,
               "accepted_tokens": outcome.accepted_tokens, "verifier_calls": outcome.verifier_calls,
               "acceptance_length": round(outcome.acceptance_length, 4), "variant": variant.label,
               "tokens_per_second": round(completion / outcome.decode_s, 2) if outcome.decode_s > 0 else None,
               "seconds": {phase: round(s, 4) for phase, s in outcome.seconds.items()},
               "mean_tree_tokens": round(sum(outcome.tree_tokens) / len(outcome.tree_tokens), 2)
               if outcome.tree_tokens else None}
    if variant.composition:
        steps = len(outcome.heads)
        shares = {name: sum(h == name for h in outcome.heads) / steps if steps else 0.0 for name in variant.members}
        none = sum(h is None for h in outcome.heads)
        if none and variant.spec.strategy == "merge":
            shares["none"] = none / steps  # merged steps that accepted no draft token
        figures["head_step_shares"] = {k: round(v, 4) for k, v in shares.items()}
    return figures


def response(request: GenerationRequest, rid: str, model: str, text: str, finish: str, use: dict) -> dict:
    choice = {"index": 0, "finish_reason": FINISH[finish], "logprobs": None}
    if request.chat:
        choice["message"] = {"role": "assistant", "content": text}
    else:
        choice["text"] = text
    return {"id": rid, "object": "chat.completion" if request.chat else "text_completion", "created": int(time.time()),
            "model": model, "choices": [choice], "usage": use}


def chunk(request: GenerationRequest, rid: str, model: str, text: str | None = None, finish: str | None = None,
          use: dict | None = None, role: bool = False) -> str:
    """One server-sent event of a stream (OpenAI's chunk shape); `use` alone: the usage chunk."""
    if use is not None and finish is None:
        choices = []
    elif request.chat:
        delta = {"role": "assistant", "content": ""} if role else ({"content": text} if text else {})
        choices = [{"index": 0, "delta": delta, "finish_reason": FINISH[finish] if finish else None, "logprobs": None}]
    else:
        choices = [{"index": 0, "text": text or "", "finish_reason": FINISH[finish] if finish else None,
                    "logprobs": None}]
    event = {"id": rid, "object": "chat.completion.chunk" if request.chat else "text_completion",
             "created": int(time.time()), "model": model, "choices": choices}
    if use is not None and finish is None:
        event["usage"] = use
    return f"data: {json.dumps(event)}\n\n"


DONE = "data: [DONE]\n\n"


class TextStream:
    """Text deltas from a growing token list: holds back a partial UTF-8 character and any tail that
    could be the start of a stop string; `stopped` once a stop string appears (the text ends
    before it)."""

    def __init__(self, detokenize, stops: list[str]):
        self.detokenize, self.stops = detokenize, stops
        self.tokens: list[int] = []
        self.sent = ""
        self.stopped = False

    def push(self, tokens: list[int], final: bool = False) -> str:
        self.tokens += tokens
        if self.stopped:
            return ""
        text = self.detokenize(self.tokens)
        cut = min((i for i in (text.find(s) for s in self.stops) if i >= 0), default=-1)
        if cut >= 0:
            text, self.stopped, final = text[:cut], True, True
        if not final:
            text = text.rstrip("\ufffd")  # an incomplete multi-byte character
            hold = max((k for s in self.stops for k in range(1, len(s)) if text.endswith(s[:k])), default=0)
            text = text[:len(text) - hold]
        if not text.startswith(self.sent):  # the tokenizer rewrote earlier text: wait for the end
            if not final:
                return ""
            delta, self.sent = text[len(os.path.commonprefix([text, self.sent])):], text
            return delta
        delta, self.sent = text[len(self.sent):], text
        return delta
