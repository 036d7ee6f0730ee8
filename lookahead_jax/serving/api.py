"""OpenAI-compatible request bodies -> validated `SlotRequest`s, and the response objects.

Fields read (OpenAI's meaning and defaults unless noted):
  model           the served model's name (its preset); another name is refused
  prompt          /v1/completions: a string, or token ids (a list of ints), or a list of one
  messages        /v1/chat/completions: [{"role": "system"|"user"|"assistant", "content": str}]
  max_tokens      default 16 for completions and the server's maximum for chat
                  (`max_completion_tokens` is accepted as its synonym)
  temperature     default 1.0; 0 is greedy (the output of plain greedy decoding)
  top_p           default 1.0, in (0, 1]
  top_k           (extension, as vLLM) default 0 = off; -1 also means off
  seed            default: drawn by the server; the same seed gives the same tokens
  stop            a string or up to 4 strings; the text ends before the first one
  stream          server-sent events, one chunk per step (several tokens when a step
                  accepts several)
  n, echo, logprobs, logit_bias, presence/frequency_penalty: only their defaults (n=1, ...)
Extensions:
  lookahead       {"method": "lookahead" | "prompt_lookup" | "ar", "W": .., "N": .., "G": ..,
                  "pl_tokens": .., "pl_ngram": ..}: the decoding method and its settings, each
                  at most the server's maximum (default: the server's --method and settings)
  return_token_ids  true: each choice (and each streamed chunk) also carries its token ids
A response's `lookahead` object reports the method, its settings, the request's forward
passes (`steps`, the prefill counted) and `step_compression` (tokens per forward pass).
"""

from __future__ import annotations

import dataclasses
import random
import time
from typing import Any, Callable

from lookahead_jax.sampling import Sampling
from lookahead_jax.serving.slots import METHOD_SETTINGS, RequestError, SERVED_METHODS, SlotRequest

ROLES = ("system", "user", "assistant")
# fields this server takes only at values that change nothing (absent = the first value)
_DEFAULT_ONLY = {"n": (1,), "echo": (False,), "logprobs": (None, False),
                 "top_logprobs": (None, 0), "logit_bias": (None, {}),
                 "presence_penalty": (0,), "frequency_penalty": (0,), "best_of": (1,),
                 "suffix": (None,), "tools": (None, []), "response_format": (None, {"type": "text"})}


@dataclasses.dataclass
class Parsed:
    request: SlotRequest
    stop: tuple[str, ...]
    stream: bool
    return_ids: bool
    chat: bool


def _same(value: Any, accepted: Any) -> bool:
    """value == accepted, where 0 and 0.0 are the same but False and 0 are not."""
    numbers = (int, float)
    if isinstance(value, numbers) and isinstance(accepted, numbers) and not (
            isinstance(value, bool) or isinstance(accepted, bool)):
        return value == accepted
    return type(value) is type(accepted) and value == accepted


def _number(body: dict, name: str, default: float) -> float:
    value = body.get(name, default)
    if value is None:
        return default
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise RequestError(name, f"{name} must be a number, got {value!r}")
    return float(value)


def _integer(body: dict, name: str, default: int | None) -> int | None:
    value = body.get(name, default)
    if value is None:
        return default
    if isinstance(value, bool) or not isinstance(value, int):
        raise RequestError(name, f"{name} must be an integer, got {value!r}")
    return value


def parse(body: Any, *, chat: bool, model_name: str, default_method: str, max_tokens: int,
          max_len: int,
          encode_text: Callable[[str], list[int]] | None,
          encode_chat: Callable[[list[dict]], list[int]] | None) -> Parsed:
    """Validates an OpenAI request body; raises RequestError naming the field at fault."""
    if not isinstance(body, dict):
        raise RequestError("body", "the request body must be a JSON object")
    model = body.get("model", model_name)
    if model != model_name:
        raise RequestError("model", f"unknown model {model!r}: this server serves "
                                    f"{model_name!r}")
    for name, accepted in _DEFAULT_ONLY.items():
        value = body.get(name, accepted[0])
        if value is not None and not any(_same(value, a) for a in accepted if a is not None):
            raise RequestError(name, f"{name}={value!r} is not supported (only "
                                     f"{' or '.join(repr(a) for a in accepted)})")
    ids = _messages(body, encode_chat) if chat else _prompt(body, encode_text)

    n_tokens = _integer(body, "max_tokens", None)
    if n_tokens is None and chat:
        n_tokens = _integer(body, "max_completion_tokens", None)
    if n_tokens is None:  # chat: the most the server allows within the context
        n_tokens = min(max_tokens, max_len - len(ids)) if chat else 16
    temperature = _number(body, "temperature", 1.0)
    if not temperature >= 0:
        raise RequestError("temperature", f"temperature must be >= 0, got {temperature}")
    top_p = _number(body, "top_p", 1.0)
    if not 0.0 < top_p <= 1.0:
        raise RequestError("top_p", f"top_p must be in (0, 1], got {top_p}")
    top_k = _integer(body, "top_k", 0)
    if top_k < -1:
        raise RequestError("top_k", f"top_k must be >= 0 (0 or -1: off), got {top_k}")
    sampling = Sampling(temperature, max(top_k, 0), top_p) if temperature > 0 else Sampling()
    seed = _integer(body, "seed", None)
    if seed is None:
        seed = random.SystemRandom().randrange(2 ** 31)
    seed %= 2 ** 32  # jax.random.key takes a 32-bit seed here (x64 off)

    stop = body.get("stop")
    if stop is None:
        stop = ()
    elif isinstance(stop, str):
        stop = (stop,)
    elif (isinstance(stop, list) and len(stop) <= 4
          and all(isinstance(s, str) and s for s in stop)):
        stop = tuple(stop)
    else:
        raise RequestError("stop", "stop must be a string or a list of at most 4 non-empty "
                                   "strings")
    stream = body.get("stream", False)
    if not isinstance(stream, bool):
        raise RequestError("stream", "stream must be true or false")
    return_ids = body.get("return_token_ids", False)
    if not isinstance(return_ids, bool):
        raise RequestError("return_token_ids", "return_token_ids must be true or false")

    method, settings = _lookahead(body.get("lookahead"), default_method)
    request = SlotRequest(ids, method=method, settings=settings, sampling=sampling, seed=seed,
                          max_tokens=n_tokens)
    return Parsed(request, stop, stream, return_ids, chat)


def _prompt(body: dict, encode_text) -> list[int]:
    prompt = body.get("prompt")
    if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], (str, list)):
        prompt = prompt[0]  # a batch of one
    if isinstance(prompt, str):
        if not prompt:
            raise RequestError("prompt", "empty prompt")
        if encode_text is None:
            raise RequestError("prompt", "this model has no tokenizer: send token ids")
        return encode_text(prompt)
    if isinstance(prompt, list) and all(isinstance(t, int) and not isinstance(t, bool)
                                        for t in prompt):
        if not prompt:
            raise RequestError("prompt", "empty prompt")
        return list(prompt)
    if prompt is None:
        raise RequestError("prompt", "prompt is required")
    raise RequestError("prompt", "prompt must be a string, a list of token ids, or a list of "
                                 "one of those (one prompt per request)")


def _messages(body: dict, encode_chat) -> list[int]:
    messages = body.get("messages")
    if not isinstance(messages, list) or not messages:
        raise RequestError("messages", "messages must be a non-empty list")
    for i, m in enumerate(messages):
        if not isinstance(m, dict) or m.get("role") not in ROLES:
            raise RequestError(f"messages[{i}].role", f"each message needs a role in {ROLES}")
        content = m.get("content")
        if isinstance(content, list):  # [{"type": "text", "text": ...}, ...]
            if not all(isinstance(p, dict) and p.get("type") == "text" for p in content):
                raise RequestError(f"messages[{i}].content", "only text content is supported")
            content = "".join(str(p.get("text", "")) for p in content)
        if not isinstance(content, str):
            raise RequestError(f"messages[{i}].content", "content must be a string")
        messages[i] = {"role": m["role"], "content": content}
    if not any(m["content"].strip() for m in messages):
        raise RequestError("messages", "every message is empty")
    if encode_chat is None:
        raise RequestError("messages", "this model has no chat template: use /v1/completions")
    return encode_chat(messages)


def _lookahead(value: Any, default_method: str) -> tuple[str, dict[str, int]]:
    if value is None:
        return default_method, {}
    if not isinstance(value, dict):
        raise RequestError("lookahead", "lookahead must be an object, e.g. "
                                        '{"method": "lookahead", "W": 7, "N": 5, "G": 7}')
    settings = dict(value)
    method = settings.pop("method", default_method)
    if method not in SERVED_METHODS:
        raise RequestError("lookahead.method", f"unknown method {method!r}: expected one of "
                                               f"{', '.join(SERVED_METHODS)}")
    for key in settings:
        if key not in METHOD_SETTINGS[method]:
            raise RequestError(f"lookahead.{key}", f"setting {key!r} does not apply to method "
                                                   f"{method!r}")
    return method, settings


# -- responses ---------------------------------------------------------------------------------
def completion_id(chat: bool, job_id: str) -> str:
    return ("chatcmpl-" if chat else "cmpl-") + job_id


def response(parsed: Parsed, job_id: str, model: str, text: str, ids: list[int],
             finish_reason: str, usage: dict, stats: dict) -> dict:
    choice: dict[str, Any] = {"index": 0, "finish_reason": finish_reason}
    if parsed.chat:
        choice["message"] = {"role": "assistant", "content": text}
    else:
        choice.update(text=text, logprobs=None)
    if parsed.return_ids:
        choice["token_ids"] = ids
    return {"id": completion_id(parsed.chat, job_id),
            "object": "chat.completion" if parsed.chat else "text_completion",
            "created": int(time.time()), "model": model, "choices": [choice], "usage": usage,
            "lookahead": stats}


def chunk(parsed: Parsed, job_id: str, model: str, text: str | None, ids: list[int],
          finish_reason: str | None = None, first: bool = False, usage: dict | None = None,
          stats: dict | None = None) -> dict:
    choice: dict[str, Any] = {"index": 0, "finish_reason": finish_reason}
    if parsed.chat:
        delta: dict[str, Any] = {"role": "assistant"} if first else {}
        if text:
            delta["content"] = text
        choice["delta"] = delta
    else:
        choice.update(text=text or "", logprobs=None)
    if parsed.return_ids:
        choice["token_ids"] = ids
    out = {"id": completion_id(parsed.chat, job_id),
           "object": "chat.completion.chunk" if parsed.chat else "text_completion",
           "created": int(time.time()), "model": model, "choices": [choice]}
    if usage is not None:
        out["usage"] = usage
    if stats is not None:
        out["lookahead"] = stats
    return out


def error_body(message: str, param: str | None = None, kind: str = "invalid_request_error"):
    return {"error": {"message": message, "type": kind, "param": param, "code": None}}
