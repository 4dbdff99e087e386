"""The client `taps data regenerate --endpoint URL` decodes through: POST {url}/chat/completions of
any OpenAI-compatible server that serves the target (vLLM, SGLang, `taps serve`), standard library
only, and its options (EndpointSettings). data/regenerate.py drives it record by record.

Only a complete answer is kept: finish_reason "stop" or "length" (a "length" answer with fewer
tokens than asked is not complete either); any other answer (a server cut short by its shutdown, a
missing or unknown finish_reason) is asked again like a 503, and after the retries the run stops
with the record unsaved. Retry-After is honoured as seconds or as an HTTP date.
"""

from __future__ import annotations

import email.utils
import json
import time
from dataclasses import dataclass
from datetime import timezone

from taps.core.config import setting


class EndpointError(ValueError):
    """The server cannot be reached (after retries) or refuses the requests; what is written stays."""

    def __init__(self, message: str, status: int | None = None):
        super().__init__(message)
        self.status = status

    @property
    def too_long(self) -> bool:
        """A 400 about the context window: that record is skipped, the run goes on."""
        return self.status == 400 and "context" in str(self).lower()


@dataclass
class EndpointSettings:
    # `taps data regenerate --endpoint`'s options (cli/args.add_settings); None: not given
    concurrency: int | None = setting(None, "--endpoint: records in flight at once (default 1; with more, records "
                                            "are written as they finish)", at_least=1)
    model: str | None = setting(None, "--endpoint: the served model's id (default: the first of GET /v1/models)")
    api_key: str | None = setting(None, "--endpoint: bearer token (default: $OPENAI_API_KEY)")
    retries: int | None = setting(None, "--endpoint: retries of a request that failed for want of the server "
                                        "(connection refused, timeout, 429, 5xx), waiting 1, 2, 4, ... s (default "
                                        "5); then the run stops and a rerun resumes")

    def __post_init__(self) -> None:
        if self.retries is not None and self.retries < 0:
            raise ValueError(f"--retries must be >= 0, got {self.retries}")


FINISH_REASONS = {"stop": "stop_token", "length": "max_new_tokens"}
MAX_RETRY_AFTER_S = 3600.0  # a server's Retry-After beyond an hour is taken as an hour


def retry_after(value: str | None, default: float) -> float:
    """Seconds to wait for a Retry-After header (seconds or an HTTP date); `default` without one."""
    if not value:
        return default
    try:
        seconds = float(value)
    except ValueError:
        try:
            when = email.utils.parsedate_to_datetime(value)
        except (TypeError, ValueError):
            return default
        if when.tzinfo is None:
            when = when.replace(tzinfo=timezone.utc)
        seconds = when.timestamp() - time.time()
    return min(max(seconds, 0.0), MAX_RETRY_AFTER_S) if seconds == seconds else default


@dataclass
class Endpoint:
    """A minimal client of POST {url}/chat/completions (standard library only): retries connection
    errors, timeouts, 429, 500, 502, 503 and 504 with exponential backoff (or the server's
    Retry-After), and gives up with an EndpointError after `retries` retries."""

    url: str
    model: str | None = None
    api_key: str | None = None
    retries: int = 5
    backoff: float = 1.0  # seconds before the first retry; doubles each time
    timeout: float = 600.0

    def __post_init__(self) -> None:
        url = self.url.rstrip("/")
        if not url.startswith(("http://", "https://")):
            raise ValueError(f"--endpoint {self.url!r}: expected an http:// or https:// URL, e.g. "
                             "http://127.0.0.1:8000/v1")
        self.url = url if url.endswith("/v1") else url + "/v1"

    def _call(self, method: str, path: str, body: dict | None = None, untrusted=lambda reply: None) -> dict:
        """The JSON answer; `untrusted(answer)`: why an answer cannot be used (then it is asked again,
        as after a 503), or None."""
        import urllib.error
        import urllib.request

        headers = {"Content-Type": "application/json"}
        if self.api_key:
            headers["Authorization"] = f"Bearer {self.api_key}"
        data = json.dumps(body).encode() if body is not None else None
        for attempt in range(self.retries + 1):
            wait = self.backoff * 2 ** attempt
            try:
                request = urllib.request.Request(self.url + path, data=data, headers=headers, method=method)
                with urllib.request.urlopen(request, timeout=self.timeout) as reply:
                    answer = json.loads(reply.read())
                why = untrusted(answer)
                if why is None:
                    return answer
            except urllib.error.HTTPError as err:
                text = err.read().decode("utf-8", "replace")
                if err.code not in (408, 429, 500, 502, 503, 504):
                    raise EndpointError(f"{self.url}{path} answered {err.code}: {_server_message(text)}",
                                        err.code) from None
                why = f"{err.code} {_server_message(text)}"
                wait = retry_after(err.headers.get("Retry-After"), wait) if err.code in (429, 503) else wait
            except (urllib.error.URLError, OSError, json.JSONDecodeError) as err:
                why = str(getattr(err, "reason", err))
            if attempt < self.retries:
                time.sleep(wait)
        raise EndpointError(f"{self.url}{path}: {why} (gave up after {self.retries} retries); the records written "
                            "so far are kept, rerun to resume")

    def served_model(self) -> str:
        if self.model is None:
            models = self._call("GET", "/models")
            listed = models.get("data") if isinstance(models, dict) else None
            if not isinstance(listed, list) or not all(isinstance(m, dict) and isinstance(m.get("id"), str)
                                                       for m in listed):
                raise EndpointError(f"{self.url}/models answered {_excerpt(models)}; expected an OpenAI model list "
                                    '{"data": [{"id": ...}, ...]} (or name the model with --model)')
            if not listed:
                raise EndpointError(f"{self.url}/models lists no model; name one with --model")
            self.model = listed[0]["id"]
        return self.model

    def chat(self, messages: list[dict], max_tokens: int, temperature: float, top_p: float,
             seed: int) -> tuple[str, str, int]:
        """(reply, stop reason as the local path names it, new tokens)."""
        body = {"model": self.served_model(), "messages": messages, "max_tokens": max_tokens,
                "temperature": temperature, "top_p": top_p, "seed": seed}
        reply = self._call("POST", "/chat/completions", body, lambda answer: _incomplete(answer, max_tokens))
        choice = _first_choice(reply, f"{self.url}/chat/completions")
        usage = reply.get("usage")
        tokens = usage.get("completion_tokens") if isinstance(usage, dict) else None
        if tokens is not None and (not isinstance(tokens, int) or isinstance(tokens, bool)):
            raise EndpointError(f"{self.url}/chat/completions answered usage.completion_tokens {_excerpt(tokens)}; "
                                "expected an integer")
        return (choice["message"].get("content") or "", FINISH_REASONS[choice["finish_reason"]],
                tokens if tokens is not None else -1)


def _incomplete(answer, max_tokens: int) -> str | None:
    """Why a chat completion is not a complete answer that can be saved, or None."""
    choices = answer.get("choices") if isinstance(answer, dict) else None
    choice = choices[0] if isinstance(choices, list) and choices else None
    if not isinstance(choice, dict) or not isinstance(choice.get("message"), dict):
        return None  # not a chat completion at all: _first_choice names what came back
    finish = choice.get("finish_reason")
    if finish not in FINISH_REASONS:
        return (f"an answer whose finish_reason is {finish!r}, neither 'stop' nor 'length': it may be cut short, "
                "so it is not saved")
    tokens = (answer.get("usage") or {}).get("completion_tokens") if isinstance(answer.get("usage"), dict) else None
    if finish == "length" and isinstance(tokens, int) and tokens < max_tokens:
        return (f"an answer with finish_reason 'length' after {tokens} of {max_tokens} tokens: cut "
                "short, so it is not saved")
    return None


def _excerpt(value) -> str:
    """A value of a server's answer, cut short enough for a one-line error."""
    text = json.dumps(value, ensure_ascii=False)
    return text if len(text) <= 120 else text[:117] + "..."


def _first_choice(reply, where: str) -> dict:
    """choices[0] of a chat completion, checked: a malformed answer is an EndpointError naming the
    endpoint and what came back, never a KeyError from deep inside the run."""
    choices = reply.get("choices") if isinstance(reply, dict) else None
    choice = choices[0] if isinstance(choices, list) and choices else None
    message = choice.get("message") if isinstance(choice, dict) else None
    if not isinstance(message, dict) or not isinstance(message.get("content"), (str, type(None))):
        raise EndpointError(f"{where} answered {_excerpt(reply)}; expected an OpenAI chat completion "
                            '{"choices": [{"message": {"content": ...}, "finish_reason": ...}], ...}')
    return choice


def _server_message(text: str) -> str:
    try:
        error = json.loads(text).get("error")
        return error.get("message", text) if isinstance(error, dict) else str(error or text)
    except (json.JSONDecodeError, AttributeError):
        return " ".join(text.split())[:300]
