"""Compatibility of `muster store` with the real `torch.distributed.TCPStore` client.

Every scenario runs with the real torch 2.15 client, both `use_libuv=True` and `use_libuv=False`
clients, against `muster store` AND against torch's own libuv server: the same assertions hold for
both servers, so each expectation written here is a fact about torch, not our reading of it.

Scenarios are module-level `scenario_*` functions executed in a separate worker process
(store_harness.ClientWorker) under a deadline, because a torch client blocked on a misbehaving
server cannot be interrupted. They import torch lazily so that pytest itself stays light.
"""

import datetime
import os
import threading
import time

import pytest

from store_harness import Server, client_worker, torch_host  # noqa: F401  (fixtures)

# MUSTER_COMPAT_SERVERS=torch-classic runs the suite against the classic backend too (for study:
# it differs from libuv in documented ways, see shared reference notes).
SERVERS = os.environ.get("MUSTER_COMPAT_SERVERS", "muster,torch-libuv").split(",")
CLIENTS = ["libuv-client", "classic-client"]


@pytest.fixture(params=SERVERS)
def server(request, torch_host):  # noqa: F811
    srv = Server(request.param, torch_host)
    yield srv
    alive = srv.alive()
    note = "" if alive else srv.death_note()
    srv.stop()
    assert alive, note


@pytest.fixture(params=CLIENTS)
def use_libuv(request):
    return request.param == "libuv-client"


def run(worker, server, use_libuv, fn, timeout=30.0, **extra):
    worker.run(fn, timeout=timeout, host=server.host, port=server.port, use_libuv=use_libuv,
               server=server.kind, **extra)


# ---------------------------------------------------------------------------------------------
# helpers used inside scenarios (they run in the worker process)


def _dist():
    import torch.distributed as dist

    return dist


class ClientLacks(Exception):
    """This torch version's client has no such call: the scenario is skipped, not failed
    (store_client_worker.py reports `skip_reason`). Only older torch, through scripts/compat."""

    def __init__(self, what):
        import torch

        super().__init__(what)
        self.skip_reason = f"the torch {torch.__version__} client has no {what}"


def _requires(obj, *calls):
    for call in calls:
        if not hasattr(obj, call):
            raise ClientLacks(f"{type(obj).__name__}.{call}")


def _client(ctx, timeout=5.0, world_size=None):
    # Connect with at least 5 s and then set the scenario's timeout: torch before 2.5 rounds the
    # connect deadline down to whole seconds, so a 0.3 s client could not even connect.
    store = _dist().TCPStore(
        ctx.host, ctx.port, world_size, False, datetime.timedelta(seconds=max(timeout, 5.0)),
        # with a world size, a client announces itself with ADD init/ 1 (no polling: not master)
        wait_for_workers=world_size is not None, use_libuv=ctx.use_libuv,
    )
    if timeout < 5.0:
        store.set_timeout(datetime.timedelta(seconds=timeout))
    return store


def _ms(n):
    return datetime.timedelta(milliseconds=n)


def _raises(exc_types, fn, *args):
    try:
        fn(*args)
    except exc_types as e:  # noqa: PERF203
        return e
    raise AssertionError(f"{getattr(fn, '__name__', fn)}{args!r} did not raise {exc_types}")


def _start(fn, *args):
    """Runs fn in a thread; the thread's outcome is in t.result / t.error."""
    t = threading.Thread(target=lambda: _capture(t, fn, *args), daemon=True)
    t.result, t.error = None, None
    t.start()
    return t


def _capture(t, fn, *args):
    try:
        t.result = fn(*args)
    except BaseException as e:  # noqa: BLE001
        t.error = e


def _finished(t, timeout=5.0):
    t.join(timeout)
    assert not t.is_alive(), "a blocked call was not released"
    if t.error is not None:
        raise t.error
    return t.result


def _still_blocked(t, for_s=0.3):
    t.join(for_s)
    assert t.is_alive(), f"call returned early: result={t.result!r} error={t.error!r}"


# ---------------------------------------------------------------------------------------------
# scenarios


def scenario_set_get(ctx):
    a, b = _client(ctx), _client(ctx)
    a.set("k", "v1")
    assert b.get("k") == b"v1"
    a.set("k", "v2")
    assert b.get("k") == b"v2"
    a.set("bin", b"\x00\xff\x01")
    assert b.get("bin") == b"\x00\xff\x01"
    a.set("empty", b"")
    assert b.get("empty") == b""
    big = bytes(range(256)) * 4096  # 1 MiB: the client sends it in many segments
    a.set("big", big)
    assert b.get("big") == big
    a.set("ключ/ü", "значение")
    assert b.get("ключ/ü") == "значение".encode()


def scenario_get_missing_times_out_then_usable(ctx):
    dist = _dist()
    c, other = _client(ctx, timeout=0.3), _client(ctx)
    t0 = time.monotonic()
    _raises(dist.DistStoreError, c.get, "nope")
    assert 0.25 <= time.monotonic() - t0 < 3.0
    # The cancel after the timeout must leave the connection in sync: a late "stop waiting" would
    # be read as the reply to the next request.
    other.set("nope", "there")
    assert c.add("counter", 7) == 7
    assert c.get("nope") == b"there"
    assert c.add("counter", 1) == 8


def scenario_add_semantics(ctx):
    c = _client(ctx)
    assert c.add("c", 5) == 5
    assert c.add("c", -7) == -2
    assert c.get("c") == b"-2"
    assert c.add("c", 0) == -2
    cases = {
        "  7": (1, 8),
        "\t\n3": (1, 4),
        " 12abc": (1, 13),
        "+5": (1, 6),
        "0x10": (1, 1),
        "-0": (3, 3),
        str(2**63 - 1): (1, -(2**63)),
        str(-(2**63)): (-1, 2**63 - 1),
    }
    for i, (stored, (delta, want)) in enumerate(cases.items()):
        key = f"w{i}"
        c.set(key, stored)
        got = c.add(key, delta)
        assert got == want, f"{stored!r} + {delta}: got {got}, want {want}"
        assert c.get(key) == str(want).encode()


def scenario_add_non_numeric_closes_that_connection_only(ctx):
    bad, other = _client(ctx), _client(ctx)
    bad.set("nn", ctx.value)
    _raises(Exception, bad.add, "nn", 1)
    assert other.get("nn") == ctx.value.encode()
    assert other.add("fine", 2) == 2
    assert _client(ctx).add("fine", 1) == 3


def scenario_check(ctx):
    c = _client(ctx)
    assert c.check(["a"]) is False
    c.set("a", "1")
    assert c.check(["a"]) is True
    assert c.check(["a", "b"]) is False
    c.set("b", "")
    assert c.check(["a", "b"]) is True
    assert c.check([]) is True


def scenario_wait_and_timeouts(ctx):
    dist = _dist()
    c, other = _client(ctx), _client(ctx)
    c.set("here", "1")
    c.wait(["here"])
    c.wait(["here", "here"], _ms(100))
    t0 = time.monotonic()
    _raises(dist.DistStoreError, c.wait, ["later"], _ms(200))
    assert 0.15 <= time.monotonic() - t0 < 3.0
    _raises(dist.DistStoreError, c.wait, ["later"], _ms(0))
    other.set("later", "x")
    assert c.add("n", 41) == 41  # in sync after two cancels and a write to the waited key
    c.wait(["later"], _ms(100))
    assert c.get("later") == b"x"
    # a wait that times out while part of its keys exist
    _raises(dist.DistStoreError, c.wait, ["here", "missing"], _ms(100))
    assert c.add("n", 1) == 42


def scenario_wait_released_only_by_last_key(ctx):
    waiter, writer = _client(ctx), _client(ctx)
    t = _start(waiter.wait, ["a", "b", "a"], _ms(10_000))
    _still_blocked(t)
    writer.set("a", "1")
    _still_blocked(t)
    writer.set("b", "2")
    _finished(t)
    assert waiter.add("sync", 1) == 1


def scenario_many_clients_wait_same_keys(ctx):
    clients = [_client(ctx) for _ in range(16)]
    threads = [_start(c.wait, ["x", "y"], _ms(10_000)) for c in clients]
    _still_blocked(threads[0])
    writer = _client(ctx)
    writer.set("x", "1")
    time.sleep(0.2)
    assert all(t.is_alive() for t in threads), "released before y existed"
    writer.set("y", "2")
    for t in threads:
        _finished(t)
    assert [c.get("y") for c in clients] == [b"2"] * 16


def scenario_writes_wake_waiters(ctx):
    waiter, writer = _client(ctx), _client(ctx)
    writes = {
        "set": lambda k: writer.set(k, "v"),
        "add": lambda k: writer.add(k, 1),
        "append": lambda k: writer.append(k, "v"),
        "multi_set": lambda k: writer.multi_set([k + "-other", k], ["o", "v"]),
        "compare_set_create": lambda k: writer.compare_set(k, "", "v"),
    }
    for name, write in writes.items():
        key = "wake-" + name
        t = _start(waiter.get, key)
        _still_blocked(t, 0.2)
        write(key)
        value = _finished(t)
        assert value in (b"v", b"1"), (name, value)


def scenario_compare_set_cases(ctx):
    c = _client(ctx)
    # missing key, empty expected: created, returns desired
    assert c.compare_set("cs1", "", "new") == b"new"
    assert c.get("cs1") == b"new"
    # missing key, non-empty expected: returns expected, key not created
    assert c.compare_set("cs2", "old", "new") == b"old"
    assert c.check(["cs2"]) is False
    # existing, matching: replaced, returns the new value
    assert c.compare_set("cs1", "new", "newer") == b"newer"
    assert c.get("cs1") == b"newer"
    # existing, not matching: unchanged, returns current value
    assert c.compare_set("cs1", "wrong", "x") == b"newer"
    assert c.get("cs1") == b"newer"
    # existing, empty expected does not match a non-empty value
    assert c.compare_set("cs1", "", "y") == b"newer"
    # existing empty value, empty expected: matches
    c.set("cs3", "")
    assert c.compare_set("cs3", "", "filled") == b"filled"
    # binary values
    assert c.compare_set("cs4", "", b"\x00\x01") == b"\x00\x01"
    assert c.compare_set("cs4", b"\x00\x01", b"\xff") == b"\xff"
    # the rendezvous sentinel dance of torchrun's c10d backend
    key = "torch.rendezvous.job"
    assert c.compare_set(key, "", "Y2FuaW1hZGFt") == b"Y2FuaW1hZGFt"
    assert c.compare_set(key, "Y2FuaW1hZGFt", "c3RhdGU=") == b"c3RhdGU="


def scenario_compare_set_wakes_like_libuv(ctx):
    # libuv wakes waiters on every COMPARE_SET, even one that changes nothing: the waiter's WAIT
    # returns although the key still does not exist.
    waiter, writer = _client(ctx), _client(ctx)
    t = _start(waiter.wait, ["spurious"], _ms(10_000))
    _still_blocked(t, 0.2)
    assert writer.compare_set("spurious", "expected", "x") == b"expected"
    _finished(t)
    assert waiter.check(["spurious"]) is False


def scenario_append_multi_delete(ctx):
    dist = _dist()
    c = _client(ctx, timeout=0.3)
    c.append("ap", "a")
    c.append("ap", b"\x00c")
    assert c.get("ap") == b"a\x00c"
    c.multi_set(["m1", "m2", "m3"], ["v1", b"", "v3"])
    assert c.multi_get(["m3", "m1", "m2", "m1"]) == [b"v3", b"v1", b"", b"v1"]
    _raises(dist.DistStoreError, c.multi_get, ["m1", "absent"])
    assert c.add("sync", 3) == 3
    assert c.delete_key("m1") is True
    assert c.delete_key("m1") is False
    assert c.check(["m1"]) is False
    assert c.check(["m2", "m3"]) is True


def scenario_num_keys_and_list_keys(ctx):
    c = _client(ctx, world_size=1)  # announces itself with ADD init/ 1
    _requires(c, "list_keys")
    assert c.num_keys() == 1
    for i in range(5):
        c.set(f"key{i}", str(i))
    assert c.num_keys() == 6  # torch's own test_store expects 5 user keys + init/
    assert sorted(c.list_keys()) == [f"key{i}" for i in range(5)]  # init/ is hidden
    c.delete_key("key0")
    assert c.num_keys() == 5
    _client(ctx, world_size=1)
    assert c.add("probe", 0) == 0
    assert c.num_keys() == 6
    assert sorted(c.list_keys()) == ["key1", "key2", "key3", "key4", "probe"]


def scenario_init_key_counts_clients(ctx):
    clients = [_client(ctx, world_size=3) for _ in range(3)]
    _requires(clients[0], "list_keys")
    # every client adds 1 to the one `init/` key (sent without the "/" prefix, hidden by
    # list_keys); num_keys counts it once
    assert clients[0].num_keys() == 1
    assert clients[0].list_keys() == []


def scenario_prefix_store(ctx):
    dist = _dist()
    base = _client(ctx)
    p = dist.PrefixStore("pre", base)
    _requires(p, "list_keys")
    p.set("k", "v")
    assert base.get("pre/k") == b"v"
    inner = dist.PrefixStore("inner", p)
    inner.set("x", "1")
    assert base.get("pre/inner/x") == b"1"
    assert p.get("inner/x") == b"1"
    assert p.add("n", 2) == 2
    assert base.get("pre/n") == b"2"
    assert p.check(["k", "n"]) is True
    assert base.check(["k"]) is False
    assert p.compare_set("k", "v", "w") == b"w"
    assert p.multi_get(["k", "n"]) == [b"w", b"2"]
    p.multi_set(["a", "b"], ["1", "2"])
    assert base.multi_get(["pre/a", "pre/b"]) == [b"1", b"2"]
    assert p.num_keys() == base.num_keys() == 5
    assert sorted(p.list_keys()) == ["a", "b", "inner/x", "k", "n"]
    assert p.delete_key("a") is True
    assert base.check(["pre/a"]) is False
    # process-group style nesting: PrefixStore("default_pg") over PrefixStore("0/")
    pg = dist.PrefixStore("0/", dist.PrefixStore("default_pg", base))
    pg.set("cpu/0", "addr")
    assert base.get("default_pg/0//cpu/0") == b"addr"


def scenario_clone(ctx):
    c = _client(ctx)
    _requires(c, "clone")
    c2 = c.clone()
    c2.set("cl", "1")
    assert c.get("cl") == b"1"
    # a separate connection: c can block in a wait while c2 keeps working
    t = _start(c.wait, ["cz"], _ms(10_000))
    _still_blocked(t, 0.2)
    assert c2.add("cnt", 1) == 1
    c2.set("cz", "z")
    _finished(t)
    c3 = c2.clone()
    assert c3.get("cz") == b"z"


def scenario_barrier(ctx):
    dist = _dist()
    a, b = _client(ctx), _client(ctx)
    _requires(a, "barrier", "list_keys")
    a.barrier("bar", 1)
    assert a.get("bar") == b"1"
    t = _start(a.barrier, "b2", 2, _ms(10_000))
    _still_blocked(t, 0.2)
    b.barrier("b2", 2)
    _finished(t)
    assert b.get("b2") == b"2"
    # a timed-out barrier is not rolled back, and its connection stays usable
    _raises(dist.DistStoreError, a.barrier, "b3", 2, _ms(200))
    assert a.get("b3") == b"1"
    assert a.add("sync", 5) == 5
    b.barrier("b3", 2)  # the count reaches 2 with the earlier, abandoned arrival
    assert a.get("b3") == b"2"
    # barrier keys are ordinary keys
    assert "b2" in a.list_keys()


def scenario_queues(ctx):
    dist = _dist()
    c, other = _client(ctx, timeout=0.3), _client(ctx)
    _requires(c, "queue_push")
    if not ctx.use_libuv:
        # the classic client refuses queues locally, whatever the server
        _raises(NotImplementedError, c.queue_push, "q", "a")
        return
    c.queue_push("q", "a")
    c.queue_push("q", b"\x00b")
    assert c.queue_len("q") == 2
    assert c.check(["q"]) is True  # a non-empty queue counts as existing
    assert c.num_keys() == 0  # queues are not keys
    assert c.queue_pop("q") == b"a"
    assert c.queue_pop("q", False) == b"\x00b"
    assert c.queue_len("q") == 0
    _raises(dist.QueueEmptyError, c.queue_pop, "q", False)
    assert c.queue_len("never") == 0
    # a blocking pop on an empty queue times out, then the connection is still in sync
    _raises(dist.DistStoreError, c.queue_pop, "q2")
    assert c.add("sync", 1) == 1
    # QUEUE_PUSH wakes one waiter per push; each popper gets one item
    p1, p2 = _client(ctx, timeout=10), _client(ctx, timeout=10)
    t1, t2 = _start(p1.queue_pop, "q3"), _start(p2.queue_pop, "q3")
    _still_blocked(t1, 0.2)
    other.queue_push("q3", "one")
    other.queue_push("q3", "two")
    assert sorted([_finished(t1), _finished(t2)]) == [b"one", b"two"]
    assert other.queue_len("q3") == 0


def scenario_many_clients_add(ctx):
    clients = [_client(ctx) for _ in range(8)]

    def work(c):
        for _ in range(200):
            c.add("total", 1)

    threads = [_start(work, c) for c in clients]
    for t in threads:
        _finished(t, 30)
    assert clients[0].get("total") == b"1600"


def scenario_oversized_closes_that_connection_only(ctx):
    what = ctx.what
    bad, good = _client(ctx, timeout=2), _client(ctx)
    good.set("before", "1")
    if what == "key":
        fn = lambda: bad.set("k" * 9000, "v")  # noqa: E731
    elif what == "value":
        fn = lambda: bad.set("big", b"x" * (8 * 1024 * 1024 + 1))  # noqa: E731
    else:
        fn = lambda: bad.check([f"k{i}" for i in range(128 * 1024 + 1)])  # noqa: E731

    def go():
        fn()
        bad.add("after", 1)  # SET has no reply: the close shows on the next request

    _raises(Exception, go)
    assert good.get("before") == b"1"
    assert good.check(["big", "after"]) is False
    assert good.add("fine", 1) == 1


def scenario_limits_accepted(ctx):
    c = _client(ctx)
    key = "/" + "k" * (8 * 1024 - 2)  # the wire key gains a "/": 8 KiB exactly
    c.set(key, "v")
    assert c.get(key) == b"v"
    payload = b"y" * (8 * 1024 * 1024)
    c.set("max", payload)
    assert c.get("max") == payload
    keys = [f"{i}" for i in range(128 * 1024)]
    assert c.check(keys) is False


# ---------------------------------------------------------------------------------------------
# tests


@pytest.mark.timeout(60)
@pytest.mark.parametrize(
    "scenario",
    [
        scenario_set_get,
        scenario_get_missing_times_out_then_usable,
        scenario_add_semantics,
        scenario_check,
        scenario_wait_and_timeouts,
        scenario_wait_released_only_by_last_key,
        scenario_many_clients_wait_same_keys,
        scenario_writes_wake_waiters,
        scenario_compare_set_cases,
        scenario_compare_set_wakes_like_libuv,
        scenario_append_multi_delete,
        scenario_num_keys_and_list_keys,
        scenario_init_key_counts_clients,
        scenario_prefix_store,
        scenario_clone,
        scenario_barrier,
        scenario_queues,
        scenario_many_clients_add,
    ],
    ids=lambda f: f.__name__.removeprefix("scenario_"),
)
def test_store(client_worker, server, use_libuv, scenario):
    run(client_worker, server, use_libuv, scenario)


@pytest.mark.timeout(60)
@pytest.mark.parametrize("value", ["abc", "", "   ", "99999999999999999999"])
def test_add_non_numeric(client_worker, server, value):
    run(client_worker, server, True, scenario_add_non_numeric_closes_that_connection_only,
        value=value)


@pytest.mark.timeout(60)
@pytest.mark.parametrize("what", ["key", "value", "key_count"])
def test_oversized(client_worker, server, what):
    run(client_worker, server, True, scenario_oversized_closes_that_connection_only, what=what)


@pytest.mark.timeout(60)
def test_limits_accepted(client_worker, server):
    run(client_worker, server, True, scenario_limits_accepted)
