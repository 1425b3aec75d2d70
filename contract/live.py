"""The live path. Inference requests (responses, chat completions, completions) reach a worker node's engine
through Redis lists that an intake thread of each node pulls from as soon as it has room: no Celery queue,
prefetch or task-thread limit stands between them and the engine, and batch chunks or fine-tunes on Celery's
queues never delay them. Durability stays with the record: a claimed request holds a lease, and the reconciler
puts a request whose node died back on a live list.

A streaming request's output comes back through a Redis stream per request: one entry per engine delta
({"c": choice, "t": content text, "l"?: JSON of its tokens' logprobs in chat's per-token shape, "tc"?: JSON of
tool-call fragments in chat's delta.tool_calls shape}), then {"end": "1"} once the record holds the final status
and result.
"""

import redis

LIVE_KINDS = ("response", "chat", "completion")
# How long a finished request's output stream stays readable.
OUTPUT_TTL_SECONDS = 3600


def live_list(queue: str) -> str:
    """Requests routed to a Celery-style queue name (a backend's or one node's), as "<kind>:<record id>"."""
    return f"live:{queue}"


def taken_list(node: str) -> str:
    """What a node has pulled and not yet claimed: a node that restarts puts these back."""
    return f"live-taken:{node}"


def push(client: redis.Redis, queue: str, kind: str, record_id: str) -> None:
    client.lpush(live_list(queue), f"{kind}:{record_id}")


def output_key(record_id: str) -> str:
    return f"output:{record_id}"
