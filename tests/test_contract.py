"""The contract package on its own: records, events, routing, layout and training-data validation."""

import json
import time

import pytest

from contract import events, registry
from contract.layout import fine_tuned_model_id, parse_fine_tuned, safe_name
from contract.records import RecordStore, new_id
from contract.routing import NoCapableWorker, Requirement, choose_queue, weights_bytes
from contract.training_data import validate_training_bytes


@pytest.fixture
def store(redis_client):
    return RecordStore(redis_client)


def test_compare_and_set_allows_one_winner(store):
    record = {"id": new_id("ftjob"), "tenant": "t", "status": "queued", "created_at": 0}
    store.create("ftjob", record)
    assert store.transition("ftjob", record["id"], ["queued"], {"status": "running", "attempts": 1})
    assert not store.transition("ftjob", record["id"], ["queued"], {"status": "running", "attempts": 2})
    assert store.get("ftjob", record["id"])["attempts"] == 1
    assert store.get("ftjob", record["id"], tenant="other") is None


def test_a_group_claimed_together_takes_only_the_queued_and_leaves_another_holders_lease(store, redis_client):
    ids = [new_id("chat") for _ in range(4)]
    for record_id, status, attempts in zip(ids, ["queued", "in_progress", "queued"], [None, 1, 2]):
        store.create("chat", {"id": record_id, "tenant": "t", "status": status, "created_at": 0,
                              **({"attempts": attempts} if attempts else {})})
    events.refresh_lease(redis_client, ids[1], "other-node", 60)  # ids[1] runs elsewhere; ids[3] does not exist
    claims = store.claim_many([("chat", i) for i in ids], ["queued"], {"status": "in_progress", "node": "n"},
                              [events.lease_key(i) for i in ids], "n", 30)
    assert [taken for taken, _ in claims] == [True, False, True, False]
    assert [c and (c["status"], c.get("node"), c.get("attempts")) for _, c in claims] == \
        [("in_progress", "n", 1), ("in_progress", None, 1), ("in_progress", "n", 3), None]
    assert claims[0][1] == store.get("chat", ids[0])
    assert events.lease_holders(redis_client, ids) == ["n", "other-node", "n", None]
    assert 0 < redis_client.pttl(events.lease_key(ids[0])) <= 30_000


def test_a_heartbeat_renews_its_own_and_lapsed_leases_never_another_holders(redis_client):
    """A node stalled past its lease comes back while its job runs elsewhere: its beat must not take the lease
    back (then its release would delete the new holder's, and the reconciler requeue a job that runs)."""
    ids = [new_id("chat") for _ in range(3)]
    events.refresh_lease(redis_client, ids[0], "n", 1)
    events.refresh_lease(redis_client, ids[1], "other-node", 60)  # requeued and claimed elsewhere meanwhile
    events.renew_leases(redis_client, ids, "n", 30)  # ids[2]'s lapsed (Redis was away): renewed
    assert events.lease_holders(redis_client, ids) == ["n", "other-node", "n"]
    assert redis_client.pttl(events.lease_key(ids[0])) > 1_000
    assert redis_client.pttl(events.lease_key(ids[1])) > 30_000
    events.release_lease(redis_client, ids[1], "n")
    assert events.lease_holders(redis_client, ids[1:2]) == ["other-node"]


def test_listing_is_newest_first_with_cursor(store):
    tenant = "lister-" + new_id("file")
    ids = [store.create("file", {"id": new_id("file"), "tenant": tenant, "created_at": i})[0]["id"]
           for i in range(5)]
    page, more = store.page("file", tenant, limit=2)
    assert [r["id"] for r in page] == ids[::-1][:2] and more
    page, more = store.page("file", tenant, after=page[-1]["id"], limit=10)
    assert [r["id"] for r in page] == ids[::-1][2:] and not more


def test_idempotency_key(store):
    first, created = store.create("ftjob", {"id": "ftjob-a", "tenant": "i", "status": "queued"}, "k1")
    second, created_again = store.create("ftjob", {"id": "ftjob-b", "tenant": "i", "status": "queued"}, "k1")
    assert created and not created_again and second["id"] == "ftjob-a"
    assert store.get("ftjob", "ftjob-b") is None


def test_event_pages_resume_after_an_id(redis_client):
    job = new_id("ftjob")
    for i in range(5):
        events.emit(redis_client, job, f"event {i}")
    page, more = events.read_newest_first(redis_client, job, None, 2)
    assert [e["message"] for e in page] == ["event 4", "event 3"] and more
    page, more = events.read_newest_first(redis_client, job, page[-1]["id"], 10)
    assert [e["message"] for e in page] == ["event 2", "event 1", "event 0"] and not more


def test_routing():
    small = {"node": "a@h", "backend": "cuda", "devices": [{"total_memory": 10}], "bf16": True}
    big = {"node": "b@h", "backend": "cuda", "devices": [{"total_memory": 10}, {"total_memory": 30}], "bf16": True}
    cpu = {"node": "c@h", "backend": "cpu", "devices": [{"total_memory": 100}], "bf16": False}
    assert choose_queue([small, big, cpu], Requirement(5)) == "xpujobs.cuda"
    assert choose_queue([small, big, cpu], Requirement(35)) == "xpujobs.node.b@h"
    assert choose_queue([small, big, cpu], Requirement(80)) == "xpujobs.cpu"
    with pytest.raises(NoCapableWorker, match="bf16"):
        choose_queue([cpu], Requirement(1, bf16=True))
    with pytest.raises(NoCapableWorker, match="GiB"):
        choose_queue([small], Requirement(11))
    with pytest.raises(NoCapableWorker, match="no worker is running"):
        choose_queue([], Requirement())


def test_routing_counts_free_memory_and_loaded_models():
    """A device that other processes fill is judged by what is free on it plus what the worker could give back
    by evicting its idle models; a worker that has the model loaded already needs nothing more for it."""
    crowded = {"node": "a@h", "backend": "cuda", "bf16": True, "reclaimable_memory": 2,
               "devices": [{"total_memory": 40, "free_memory": 3}], "models": [{"model": "m-loaded"}]}
    roomy = {"node": "b@h", "backend": "cuda", "bf16": True, "reclaimable_memory": 0,
             "devices": [{"total_memory": 40, "free_memory": 30}], "models": []}
    assert choose_queue([crowded, roomy], Requirement(20)) == "xpujobs.node.b@h"
    assert choose_queue([crowded, roomy], Requirement(5)) == "xpujobs.cuda"  # 3 free + 2 reclaimable is enough
    assert choose_queue([crowded], Requirement(20, model="m-loaded")) == "xpujobs.cuda"
    with pytest.raises(NoCapableWorker, match="GiB"):
        choose_queue([crowded], Requirement(20, model="m-other"))


def test_weights_bytes_follow_the_model_directory(tmp_path):
    """Read once per version of the directory: a shard added (or removed) is counted at the next request."""
    model = tmp_path / "m"
    assert weights_bytes(tmp_path, "m") == 0
    model.mkdir()
    (model / "model-1.safetensors").write_bytes(b"x" * 10)
    assert weights_bytes(tmp_path, "m") == 10
    time.sleep(0.01)  # a coarse-grained mtime would hide the change
    (model / "model-2.safetensors").write_bytes(b"x" * 5)
    assert weights_bytes(tmp_path, "m") == 15
    (model / "model-1.safetensors").unlink()
    assert weights_bytes(tmp_path, "m") == 5


def test_model_ids_and_names():
    model = fine_tuned_model_id("Qwen/Qwen3-0.6B", "mine", "ftjob-1")
    assert model == "ft:Qwen/Qwen3-0.6B:mine:ftjob-1"
    ref = parse_fine_tuned(model)
    assert (ref.base, ref.suffix, ref.job_id, ref.checkpoint_step) == ("Qwen/Qwen3-0.6B", "mine", "ftjob-1", None)
    assert parse_fine_tuned(model + ":ckpt-step-20").checkpoint_step == 20
    assert parse_fine_tuned("demo-tiny") is None and parse_fine_tuned("ft:only") is None
    assert safe_name("../../etc/passwd") == "passwd" and safe_name("..") == "file"


def test_training_validation_reports_lines():
    good = json.dumps({"messages": [{"role": "user", "content": "a"}, {"role": "assistant", "content": "b"}]})
    data = "\n".join([good, "{oops", json.dumps({"prompt": "p", "completion": ""}), "[1]", ""]).encode()
    count, errors = validate_training_bytes(data)
    assert count == 1
    assert [e.split(":")[0] for e in errors] == ["line 2", "line 3", "line 4"]
    assert validate_training_bytes(b"\xff\xfe")[1][0].startswith("the file is not UTF-8")


def test_registry_lists_live_nodes_and_drops_lapsed_ones(redis_url):
    import redis

    # Database 9, apart from the running workers' registry in 0 (a URL's own database wins over a db= argument).
    client = redis.Redis.from_url(redis_url.rsplit("/", 1)[0] + "/9", decode_responses=True)
    assert client.connection_pool.connection_kwargs["db"] == 9
    client.delete(registry.INDEX, registry.KEY_PREFIX + "steady@host", registry.KEY_PREFIX + "brief@host")
    registry.register(client, "steady@host", {"node": "steady@host"}, ttl_seconds=30)
    registry.register(client, "brief@host", {"node": "brief@host"}, ttl_seconds=0.2)
    assert sorted(w["node"] for w in registry.live_workers(client)) == ["brief@host", "steady@host"]
    time.sleep(0.4)
    assert [w["node"] for w in registry.live_workers(client)] == ["steady@host"]
    assert client.smembers(registry.INDEX) == {"steady@host"}
    registry.register(client, "brief@host", {"node": "brief@host"}, ttl_seconds=30)  # it comes back
    assert len(registry.live_workers(client)) == 2
    registry.unregister(client, "steady@host")
    assert [w["node"] for w in registry.live_workers(client)] == ["brief@host"]
