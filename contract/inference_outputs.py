"""OpenAI's response bodies for a finished inference, shared by the live endpoints and batch output files.

`result` is the worker's outcome: {text, finish_reason, prompt_tokens, completion_tokens}, plus `choices` (a list
of {text, finish_reason, completion_tokens}) when the request asked for several. A choice (or the result) also
holds `tool_calls` (and `content`, the text before them) when the model called tools, and `logprobs` (chat's
per-token entries, of every output token) when asked for, with `content_tokens` (how many of them wrote
`content`) where there are both.
"""


def choices_of(result: dict) -> list[dict]:
    return result.get("choices") or [result]


def usage(result: dict) -> dict:
    return {"prompt_tokens": result["prompt_tokens"], "completion_tokens": result["completion_tokens"],
            "total_tokens": result["prompt_tokens"] + result["completion_tokens"]}


def assistant_message(choice: dict) -> dict:
    """The chat message of a choice; one with tool calls has content null, as OpenAI's does."""
    calls = choice.get("tool_calls")
    return {"role": "assistant", "content": choice["text"] if not calls else choice.get("content"),
            "refusal": None, **({"tool_calls": calls} if calls else {})}


def chat_logprobs(choice: dict) -> dict | None:
    """`choice["logprobs"]` holds chat's per-token entries {token, logprob, bytes, top_logprobs} already. OpenAI's
    `logprobs.content` are the message content's tokens: where the model called tools, those that wrote `content`
    (the calls' tokens are not content)."""
    if choice.get("logprobs") is None:
        return None
    return {"content": choice["logprobs"][:choice.get("content_tokens")], "refusal": None}


def completion_logprobs(choice: dict, start: int = 0) -> dict | None:
    """The legacy completions shape: parallel lists, and each step's top tokens as {token: logprob}; text offsets
    count from `start` (where a streamed chunk's tokens begin)."""
    entries = choice.get("logprobs")
    if entries is None:
        return None
    offsets, at = [], start
    for e in entries:
        offsets.append(at)
        at += len(e["token"])
    return {"tokens": [e["token"] for e in entries], "token_logprobs": [e["logprob"] for e in entries],
            "top_logprobs": [{t["token"]: t["logprob"] for t in e["top_logprobs"]} for e in entries],
            "text_offset": offsets}


def chat_completion(request_id: str, created: int, model: str, result: dict) -> dict:
    return {
        "id": request_id, "object": "chat.completion", "created": created, "model": model,
        "system_fingerprint": result.get("system_fingerprint"),
        "choices": [{"index": i, "message": assistant_message(c), "finish_reason": c["finish_reason"],
                     "logprobs": chat_logprobs(c)}
                    for i, c in enumerate(choices_of(result))],
        "usage": usage(result),
    }


def completion(request_id: str, created: int, model: str, result: dict) -> dict:
    return {
        "id": request_id, "object": "text_completion", "created": created, "model": model,
        "system_fingerprint": result.get("system_fingerprint"),
        "choices": [{"index": i, "text": c["text"], "finish_reason": c["finish_reason"],
                     "logprobs": completion_logprobs(c)}
                    for i, c in enumerate(choices_of(result))],
        "usage": usage(result),
    }


def response_status(status: str, result: dict | None) -> tuple[str, dict | None]:
    """(status, incomplete_details): a response cut at max_output_tokens is "incomplete", as OpenAI's is."""
    if status == "completed" and result and result["finish_reason"] == "length":
        return "incomplete", {"reason": "max_output_tokens"}
    return status, None


def output_message(request_id: str, text: str, status: str = "completed", logprobs: list | None = None) -> dict:
    return {"type": "message", "id": "msg_" + request_id.removeprefix("resp_"), "status": status,
            "role": "assistant", "content": [{"type": "output_text", "text": text, "annotations": [],
                                              "logprobs": logprobs or []}]}


def function_call_item(call: dict, status: str = "completed") -> dict:
    return {"type": "function_call", "id": "fc_" + call["id"].removeprefix("call_"), "call_id": call["id"],
            "name": call["function"]["name"], "arguments": call["function"]["arguments"], "status": status}


def output_items(request_id: str, result: dict, status: str) -> list[dict]:
    """A response's output: one message (the text before any calls, with the logprobs of the tokens that wrote it:
    `content_tokens` of them where there are calls, else all), then each function call as a function_call item."""
    calls = result.get("tool_calls") or []
    text = result.get("content") if calls else result["text"]
    logprobs = (result.get("logprobs") or [])[:result.get("content_tokens")]
    message = [output_message(request_id, text, status, logprobs)] if text or not calls else []
    return message + [function_call_item(call) for call in calls]


def echo_options(request: dict) -> dict:
    """What a response object repeats of its request's tools and text format, in the Responses API's shapes."""
    choice = request.get("tool_choice") or "none"
    return {"parallel_tool_calls": bool(request.get("parallel_tool_calls")),
            "tool_choice": choice if choice in ("auto", "none", "required") else {"type": "function", "name": choice},
            "tools": [{"type": "function", **t} for t in request.get("tools") or []],
            "text": {"format": request.get("response_format") or {"type": "text"}},
            "top_logprobs": request.get("logprobs")}


def response(request_id: str, created: int, model: str, status: str, result: dict | None, request: dict,
             *, background: bool = False, metadata: dict | None = None, error: dict | None = None,
             options: dict | None = None) -> dict:
    """`options`: what the live API echoes of the request (store, previous_response_id, user, ...)."""
    status, incomplete = response_status(status, result)
    output = []
    if result and status in ("completed", "incomplete", "cancelled"):
        output = output_items(request_id, result, "incomplete" if incomplete else "completed")
    usage = None
    if result:
        usage = {"input_tokens": result["prompt_tokens"], "output_tokens": result["completion_tokens"],
                 "total_tokens": result["prompt_tokens"] + result["completion_tokens"],
                 "input_tokens_details": {"cached_tokens": 0}, "output_tokens_details": {"reasoning_tokens": 0}}
    return {
        "id": request_id, "object": "response", "created_at": created, "status": status, "model": model,
        "output": output, "background": background, "error": error, "incomplete_details": incomplete,
        "instructions": request.get("instructions"), "max_output_tokens": request.get("max_output_tokens"),
        "temperature": request.get("temperature"), "top_p": request.get("top_p"), "metadata": metadata or {},
        **echo_options(request),
        "usage": usage, "store": True, "previous_response_id": None, "truncation": "disabled",
        "service_tier": "default", "user": None, "safety_identifier": None, **(options or {}),
    }


BUILDERS = {"/v1/chat/completions": chat_completion, "/v1/completions": completion}
