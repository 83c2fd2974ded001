"""The Responses API's response store on a fake clock: a response lives ``max_age_s`` and no
longer, the oldest go first past ``max_responses``, and a tenant reads only its own."""

from __future__ import annotations

import pytest

from radixlang.server.response_store import ResponseStore, StoredResponse


class FakeClock:
    def __init__(self, now: float = 1000.0) -> None:
        self.now = now

    def __call__(self) -> float:
        return self.now


def stored(rid: str, tenant: str | None = "ann") -> StoredResponse:
    return StoredResponse(tenant, [{"role": "user", "content": rid}], {"id": rid})


def test_a_response_is_returned_until_max_age_and_gone_after():
    clock = FakeClock()
    store = ResponseStore(max_responses=8, max_age_s=60.0, clock=clock)
    store.put("r0", stored("r0"))
    clock.now += 59.0
    got = store.get("r0", "ann")
    assert got is not None and got.response == {"id": "r0"}
    clock.now += 2.0  # 61 s after it was stored
    assert store.get("r0", "ann") is None
    assert len(store) == 0  # expired responses are dropped, not just hidden


def test_each_response_expires_by_its_own_age():
    clock = FakeClock()
    store = ResponseStore(max_responses=8, max_age_s=60.0, clock=clock)
    store.put("old", stored("old"))
    clock.now += 30.0
    store.put("new", stored("new"))
    clock.now += 31.0  # old: 61 s, new: 31 s
    assert store.get("old", "ann") is None
    assert store.get("new", "ann") is not None
    clock.now += 30.0  # new: 61 s
    assert store.get("new", "ann") is None


def test_storing_again_renews_a_responses_age():
    clock = FakeClock()
    store = ResponseStore(max_responses=8, max_age_s=60.0, clock=clock)
    store.put("r0", stored("r0"))
    clock.now += 50.0
    store.put("r0", stored("r0"))
    clock.now += 50.0  # 100 s after the first put, 50 s after the second
    assert store.get("r0", "ann") is not None


def test_a_put_expires_old_responses_too():
    clock = FakeClock()
    store = ResponseStore(max_responses=8, max_age_s=60.0, clock=clock)
    store.put("r0", stored("r0"))
    clock.now += 61.0
    store.put("r1", stored("r1"))
    assert len(store) == 1 and store.get("r1", "ann") is not None


def test_past_max_responses_the_oldest_go_first():
    clock = FakeClock()
    store = ResponseStore(max_responses=3, max_age_s=3600.0, clock=clock)
    for i in range(5):
        store.put(f"r{i}", stored(f"r{i}"))
        clock.now += 1.0
    assert len(store) == 3
    assert [store.get(f"r{i}", "ann") is not None for i in range(5)] == [
        False, False, True, True, True,
    ]  # fmt: skip


def test_a_tenant_cannot_read_or_delete_another_tenants_response():
    clock = FakeClock()
    store = ResponseStore(max_responses=8, max_age_s=60.0, clock=clock)
    store.put("ann-r", stored("ann-r", "ann"))
    store.put("anon-r", stored("anon-r", None))
    assert store.get("ann-r", "bob") is None and store.get("ann-r", None) is None
    assert store.get("anon-r", "ann") is None and store.get("anon-r", None) is not None
    assert not store.delete("ann-r", "bob")
    assert store.get("ann-r", "ann") is not None  # a refused delete removes nothing
    assert store.delete("ann-r", "ann") and store.get("ann-r", "ann") is None


@pytest.mark.parametrize("kwargs", [{"max_responses": 0}, {"max_age_s": 0.0}])
def test_an_empty_store_is_refused(kwargs):
    with pytest.raises(ValueError):
        ResponseStore(**kwargs)
