"""OpenAI's response bodies for a finished inference, shared by the live endpoints and batch output files.

`result` is the worker's outcome: {text, finish_reason, prompt_tokens, completion_tokens}.
"""


def chat_completion(request_id: str, created: int, model: str, result: dict) -> dict:
    return {
        "id": request_id, "object": "chat.completion", "created": created, "model": model,
        "system_fingerprint": None,
        "choices": [{"index": 0, "message": {"role": "assistant", "content": result["text"], "refusal": None},
                     "finish_reason": result["finish_reason"], "logprobs": None}],
        "usage": {"prompt_tokens": result["prompt_tokens"], "completion_tokens": result["completion_tokens"],
                  "total_tokens": result["prompt_tokens"] + result["completion_tokens"]},
    }


def completion(request_id: str, created: int, model: str, result: dict) -> dict:
    return {
        "id": request_id, "object": "text_completion", "created": created, "model": model,
        "choices": [{"index": 0, "text": result["text"], "finish_reason": result["finish_reason"],
                     "logprobs": None}],
        "usage": {"prompt_tokens": result["prompt_tokens"], "completion_tokens": result["completion_tokens"],
                  "total_tokens": result["prompt_tokens"] + result["completion_tokens"]},
    }


def response(request_id: str, created: int, model: str, status: str, result: dict | None, request: dict,
              *, background: bool = False, metadata: dict | None = None, error: dict | None = None) -> dict:
    output = []
    if result and status in ("completed", "incomplete", "cancelled"):
        output = [{"type": "message", "id": "msg_" + request_id.removeprefix("resp_"), "status": "completed",
                   "role": "assistant",
                   "content": [{"type": "output_text", "text": result["text"], "annotations": []}]}]
    usage = None
    if result:
        usage = {"input_tokens": result["prompt_tokens"], "output_tokens": result["completion_tokens"],
                 "total_tokens": result["prompt_tokens"] + result["completion_tokens"],
                 "input_tokens_details": {"cached_tokens": 0}, "output_tokens_details": {"reasoning_tokens": 0}}
    return {
        "id": request_id, "object": "response", "created_at": created, "status": status, "model": model,
        "output": output, "background": background, "error": error, "incomplete_details": None,
        "instructions": request.get("instructions"), "max_output_tokens": request.get("max_output_tokens"),
        "temperature": request.get("temperature"), "top_p": request.get("top_p"), "metadata": metadata or {},
        "parallel_tool_calls": False, "tool_choice": "none", "tools": [], "text": {"format": {"type": "text"}},
        "usage": usage,
    }


BUILDERS = {"/v1/chat/completions": chat_completion, "/v1/completions": completion}
