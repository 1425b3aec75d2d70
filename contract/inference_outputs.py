"""OpenAI's response bodies for a finished inference, shared by the live endpoints and batch output files.

`result` is the worker's outcome: {text, finish_reason, prompt_tokens, completion_tokens}, plus `choices` (a list
of {text, finish_reason, completion_tokens}) when the request asked for several.
"""


def choices_of(result: dict) -> list[dict]:
    return result.get("choices") or [result]


def usage(result: dict) -> dict:
    return {"prompt_tokens": result["prompt_tokens"], "completion_tokens": result["completion_tokens"],
            "total_tokens": result["prompt_tokens"] + result["completion_tokens"]}


def chat_completion(request_id: str, created: int, model: str, result: dict) -> dict:
    return {
        "id": request_id, "object": "chat.completion", "created": created, "model": model,
        "system_fingerprint": result.get("system_fingerprint"),
        "choices": [{"index": i, "message": {"role": "assistant", "content": c["text"], "refusal": None},
                     "finish_reason": c["finish_reason"], "logprobs": None}
                    for i, c in enumerate(choices_of(result))],
        "usage": usage(result),
    }


def completion(request_id: str, created: int, model: str, result: dict) -> dict:
    return {
        "id": request_id, "object": "text_completion", "created": created, "model": model,
        "system_fingerprint": result.get("system_fingerprint"),
        "choices": [{"index": i, "text": c["text"], "finish_reason": c["finish_reason"], "logprobs": None}
                    for i, c in enumerate(choices_of(result))],
        "usage": usage(result),
    }


def response_status(status: str, result: dict | None) -> tuple[str, dict | None]:
    """(status, incomplete_details): a response cut at max_output_tokens is "incomplete", as OpenAI's is."""
    if status == "completed" and result and result["finish_reason"] == "length":
        return "incomplete", {"reason": "max_output_tokens"}
    return status, None


def output_message(request_id: str, text: str, status: str = "completed") -> dict:
    return {"type": "message", "id": "msg_" + request_id.removeprefix("resp_"), "status": status,
            "role": "assistant", "content": [{"type": "output_text", "text": text, "annotations": [], "logprobs": []}]}


def response(request_id: str, created: int, model: str, status: str, result: dict | None, request: dict,
             *, background: bool = False, metadata: dict | None = None, error: dict | None = None,
             options: dict | None = None) -> dict:
    """`options`: what the live API echoes of the request (store, previous_response_id, user, ...)."""
    status, incomplete = response_status(status, result)
    output = []
    if result and status in ("completed", "incomplete", "cancelled"):
        output = [output_message(request_id, result["text"], "incomplete" if incomplete else "completed")]
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
        "parallel_tool_calls": False, "tool_choice": "none", "tools": [], "text": {"format": {"type": "text"}},
        "usage": usage, "store": True, "previous_response_id": None, "truncation": "disabled",
        "service_tier": "default", "user": None, "safety_identifier": None, **(options or {}),
    }


BUILDERS = {"/v1/chat/completions": chat_completion, "/v1/completions": completion}
