"""KV events from `kvtier serve --kv-events`, read the way a cache-aware
router reads vLLM's: a pyzmq SUB socket, vLLM's own event classes to
decode, and vLLM's replay protocol (a DEALER asking the ROUTER for the
batches from a sequence number on) to fill gaps."""

import hashlib
import hmac
import re
import time
import uuid

import msgspec
import zmq
import zmq.utils.z85
from vllm.distributed.kv_events import AllBlocksCleared, BlockRemoved, BlockStored, KVEventBatch

import kvtier
from conftest import KvtierServer

END_SEQ = (-1).to_bytes(8, "big", signed=True)


def start_server(tmp_path, memory="256MiB", disk="1GiB", extra=()):
    return KvtierServer(tmp_path / "kvtier-data", memory=memory, disk=disk,
                        extra=["--kv-events", "tcp://127.0.0.1:0", "--kv-events-replay", "tcp://127.0.0.1:0",
                               *extra])


class Router:
    """A subscriber keeping every batch in sequence order: a gap (a late
    join, a dropped batch) is filled from the replay socket before any
    later batch is used."""

    def __init__(self, server, password: str | None = None,
                 curve: tuple[bytes, bytes, bytes] | None = None):
        self.pub, self.replay = (a.replace("0.0.0.0", "127.0.0.1") for a in
                                 re.findall(r"(?:kv events|replay) (tcp://[\d.:]+)", server.line))
        self.password = password
        self.curve = curve
        self.ctx = zmq.Context()
        self.sub = self._login(self.ctx.socket(zmq.SUB))
        self.sub.setsockopt(zmq.SUBSCRIBE, b"")
        self.sub.connect(self.pub)
        self.decoder = msgspec.msgpack.Decoder(type=KVEventBatch)
        self.next_seq = 0
        self.batches: list[tuple[str, KVEventBatch]] = []
        self.replays = 0

    def _login(self, socket):
        """ZeroMQ's PLAIN login, as any router configures it, when the
        feed asks for one (`kv_events_auth = "plain"`)."""
        if self.password is not None:
            socket.plain_username = b"router"
            socket.plain_password = self.password.encode()
        if self.curve is not None:
            socket.curve_publickey, socket.curve_secretkey, socket.curve_serverkey = self.curve
        return socket

    def _replay_from(self, start: int) -> None:
        dealer = self._login(self.ctx.socket(zmq.DEALER))
        dealer.connect(self.replay)
        dealer.send_multipart([b"", start.to_bytes(8, "big")])
        self.replays += 1
        while True:
            assert dealer.poll(10_000), "no replay answer"
            _, topic, seq, payload = dealer.recv_multipart()
            if seq == END_SEQ:
                break
            self._take(topic, int.from_bytes(seq, "big"), payload)
        dealer.close(linger=0)

    def _take(self, topic: bytes, seq: int, payload: bytes) -> None:
        if seq < self.next_seq:
            return  # already have it (replayed, then arrived live)
        if seq > self.next_seq:
            self._replay_from(self.next_seq)
            assert self.next_seq >= seq, f"replay did not fill {self.next_seq}..{seq}"
            if seq < self.next_seq:
                return
        self.batches.append((topic.decode(), self.decoder.decode(payload)))
        self.next_seq = seq + 1

    def poll(self, seconds: float, until=None) -> None:
        deadline = time.time() + seconds
        while time.time() < deadline:
            if until is not None and until(self):
                return
            if self.sub.poll(50):
                topic, seq, payload = self.sub.recv_multipart()
                self._take(topic, int.from_bytes(seq, "big"), payload)

    def events(self):
        return [(topic, e) for topic, b in self.batches for e in b.events]

    def held(self) -> dict:
        """(topic, key) -> medium, from the events in order."""
        held = {}
        for topic, e in self.events():
            if isinstance(e, AllBlocksCleared):
                held.clear()
            elif isinstance(e, BlockStored):
                for h in e.block_hashes:
                    held[(topic, h)] = e.medium
            elif isinstance(e, BlockRemoved):
                for h in e.block_hashes:
                    assert (topic, h) in held, f"removal of {h!r} never stored"
                    assert held.pop((topic, h)) == e.medium
        return held

    def close(self):
        self.sub.close(linger=0)
        self.ctx.term()


def wait_connected(router: Router, client) -> None:
    """A SUB joins asynchronously: put a marker until its event arrives
    (earlier batches come through the replay)."""
    marker = f"marker-{uuid.uuid4().hex}".encode()
    for _ in range(100):
        client.put(marker, b"x" * 4096)
        client.flush()  # a write-through put is announced once durable
        router.poll(0.1, until=lambda r: any(marker in getattr(e, "block_hashes", ()) for _, e in r.events()))
        if any(marker in getattr(e, "block_hashes", ()) for _, e in router.events()):
            return
    raise AssertionError("the subscriber never received an event")


def test_every_event_of_a_memory_workload_arrives_in_order(tmp_path):
    # A memory-only store: 2 MiB of pool, so puts evict.
    server = start_server(tmp_path, memory="2MiB", disk="0")
    router = Router(server)
    try:
        with kvtier.Client(server.url, namespace="engine-a") as client:
            wait_connected(router, client)
            # The start's AllBlocksCleared (before we joined) came by replay.
            assert router.replays >= 1
            assert isinstance(router.batches[0][1].events[0], AllBlocksCleared)
            keys = [f"block-{i}".encode() for i in range(64)]
            for i, key in enumerate(keys):
                assert client.put(key, bytes([i % 251]) * 65536) == 0
                if i % 9 == 0:
                    assert client.remove(key) == 0
            present = {k for k, e in zip(keys, client.batch_is_exist(keys)) if e}
            last = keys[-1]
            router.poll(10, until=lambda r: any(last in getattr(e, "block_hashes", ()) for _, e in r.events()))
        held = router.held()
        topics = {t for t, _ in router.events()}
        assert all(t.startswith("kv@") and t.endswith("@engine-a") for t in topics if t.endswith("engine-a"))
        announced = {k for (t, k), medium in held.items() if t.endswith("@engine-a") and k in set(keys)}
        assert announced == present, (sorted(announced - present)[:3], sorted(present - announced)[:3])
        assert all(m == "CPU" for m in held.values())
        removed = [e for _, e in router.events() if isinstance(e, BlockRemoved)]
        assert removed, "the workload evicted and removed nothing"
        # Sequence numbers had no hole left.
        assert router.next_seq == len(router.batches)
        stats = server.stats()["kv_events"]
        assert stats["enabled"] and stats["store_dropped"] == 0 and stats["replay_requests"] >= 1
    finally:
        router.close()
        server.stop()


def test_a_put_killed_before_its_flush_is_never_announced(tmp_path):
    server = start_server(tmp_path, memory="64MiB", disk="256MiB", extra=["--flush", "on-demand"])
    router = Router(server)
    try:
        with kvtier.Client(server.url, namespace="engine-b") as client:
            wait_connected(router, client)
            durable = b"durable-block"
            assert client.put(durable, b"d" * 65536) == 0
            client.flush()
            router.poll(10, until=lambda r: any(durable in getattr(e, "block_hashes", ()) for _, e in r.events()))
            assert router.held()[(next(t for t, _ in router.events() if t.endswith("engine-b")), durable)] == "STORAGE"
            pending = b"pending-block"
            assert client.put(pending, b"p" * 65536) == 0
            assert client.batch_is_exist([pending]) == [1]
            # Well past the batch interval: nothing about it goes out.
            router.poll(1.5)
        assert not any(pending in getattr(e, "block_hashes", ()) for _, e in router.events())
        server.kill()
        router.poll(0.5)
        assert not any(pending in getattr(e, "block_hashes", ()) for _, e in router.events())
        # And indeed it did not survive: the events told the truth.
        server.start()
        with kvtier.Client(server.url, namespace="engine-b") as client:
            assert client.batch_is_exist([durable, pending]) == [1, 0]
    finally:
        router.close()
        server.stop()


def test_a_subscriber_that_fell_behind_fills_its_gap_from_the_replay(tmp_path):
    server = start_server(tmp_path, memory="64MiB", disk="0")
    early = Router(server)
    try:
        with kvtier.Client(server.url, namespace="engine-c") as client:
            wait_connected(early, client)
            keys = [f"k-{i}".encode() for i in range(200)]
            for k in keys:
                assert client.put(k, b"v" * 4096) == 0
                time.sleep(0.002)  # many small batches
            early.poll(10, until=lambda r: any(keys[-1] in getattr(e, "block_hashes", ()) for _, e in r.events()))
            # A router that joins now sees its first batch far past 0 and
            # must replay everything before it.
            late = Router(server)
            try:
                wait_connected(late, client)
                assert late.replays >= 1
                assert [b for _, b in late.batches[:len(early.batches)]] == [b for _, b in early.batches]
                early_keys = {k for (_, k) in early.held()}
                assert set(keys) <= early_keys and set(keys) <= {k for (_, k) in late.held()}
            finally:
                late.close()
    finally:
        early.close()
        server.stop()


def test_bad_peers_are_dropped_and_the_publisher_keeps_going(tmp_path):
    import socket

    server = start_server(tmp_path, memory="64MiB", disk="0")
    router = Router(server)
    try:
        host, port = router.pub.removeprefix("tcp://").rsplit(":", 1)
        # Garbage instead of a greeting; a greeting then a huge frame.
        for attack in (b"GET / HTTP/1.1\r\n\r\n" + b"x" * 100,
                       b"\xff" + b"\0" * 8 + b"\x7f\x03\x00NULL" + b"\0" * 48 + b"\x06" + b"\xff" * 8):
            s = socket.create_connection((host, int(port)), timeout=10)
            s.sendall(attack)
            s.settimeout(10)
            try:
                while s.recv(65536):
                    pass
            except OSError:
                pass
            s.close()
        with kvtier.Client(server.url, namespace="engine-d") as client:
            wait_connected(router, client)
    finally:
        router.close()
        server.stop()


SERVER_TOKEN = "feed-server-token-0123456789"
TENANT_TOKENS = {"a": "feed-tenant-a-token-0123456789", "b": "feed-tenant-b-token-0123456789"}


def check_tenant_scoping(server, routers: dict, strangers: list[str]) -> None:
    """Both tenants put blocks until the server's router ("all") and tenant
    a's ("a") have events; then "a" saw its own namespaces only, live and
    replayed, "all" saw both, and each router in `strangers` saw nothing."""
    clients = {name: kvtier.Client(server.url, namespace=f"team-{name}/llama", auth_token=token)
               for name, token in TENANT_TOKENS.items()}

    def namespaces(router):
        return {topic.split("@")[-1] for topic, e in router.events() if not isinstance(e, AllBlocksCleared)}

    for i in range(200):
        for client in clients.values():
            client.put(f"block-{i}".encode(), b"x" * 4096)
            client.flush()
        for router in routers.values():
            router.poll(0.05)
        if {"team-a/llama", "team-b/llama"} <= namespaces(routers["all"]) and namespaces(routers["a"]):
            break
    assert {"team-a/llama", "team-b/llama"} <= namespaces(routers["all"])
    assert namespaces(routers["a"]) == {"team-a/llama"}, namespaces(routers["a"])
    # The replay from the start: tenant a's batches only.
    routers["a"].batches.clear()
    routers["a"].next_seq = 0
    routers["a"]._replay_from(0)
    assert namespaces(routers["a"]) == {"team-a/llama"}
    for name in strangers:
        routers[name].poll(1.0)
        assert routers[name].batches == [], f"the {name} router received events"
    for client in clients.values():
        client.close()


def test_routers_log_in_with_plain_and_a_tenant_sees_only_its_namespaces(tmp_path):
    """Issue 39, finding 3: beside --tenants the feed asks for ZeroMQ's
    PLAIN login (pyzmq's plain_username/plain_password; the password is a
    kvtier token). A tenant's router receives its own namespaces' events,
    live and replayed; the server's token sees every namespace; a router
    without a login receives nothing."""
    tenants = tmp_path / "tenants.toml"
    tenants.write_text("".join(
        f'[[tenant]]\nname = "{name}"\ntoken = "{token}"\nnamespaces = ["team-{name}"]\n'
        for name, token in TENANT_TOKENS.items()))
    tenants.chmod(0o600)
    config = tmp_path / "serve.toml"
    config.write_text('kv_events_auth = "plain"\n')
    server = start_server(tmp_path, extra=["--auth-token", SERVER_TOKEN, "--tenants", str(tenants),
                                           "--config", str(config)])
    routers = {"a": Router(server, TENANT_TOKENS["a"]), "all": Router(server, SERVER_TOKEN),
               "none": Router(server)}
    try:
        check_tenant_scoping(server, routers, strangers=["none"])
    finally:
        for router in routers.values():
            router.close()
        server.stop()



def curve_client_keys(token: str) -> tuple[bytes, bytes]:
    """docs/integrations.md's recipe: a router's CURVE keys from its kvtier
    token (HMAC-SHA256 of a fixed label, keyed with the token)."""
    secret = zmq.utils.z85.encode(
        hmac.new(token.encode(), b"kvtier kv-events CURVE client key", hashlib.sha256).digest())
    return zmq.curve_public(secret), secret


def test_routers_subscribe_over_curve_off_the_host_and_see_what_their_token_opens(tmp_path):
    """Issue 39, item 3: with `kv_events_auth = "curve"` the feed may bind
    off loopback; routers use ZeroMQ's own CURVE (pyzmq's curve_* socket
    options, libzmq's implementation) with keys derived from their kvtier
    token and the server key the server prints. A tenant receives its own
    namespaces' events, live and replayed; the server's token sees all; a
    key of no token, a router holding the wrong server key, a PLAIN login
    and a router without a login receive nothing."""
    assert zmq.has("curve"), "this pyzmq was built without CURVE"
    tenants = tmp_path / "tenants.toml"
    tenants.write_text("".join(
        f'[[tenant]]\nname = "{name}"\ntoken = "{token}"\nnamespaces = ["team-{name}"]\n'
        for name, token in TENANT_TOKENS.items()))
    tenants.chmod(0o600)
    config = tmp_path / "serve.toml"
    config.write_text('kv_events_auth = "curve"\n')
    server = KvtierServer(tmp_path / "kvtier-data", memory="256MiB", disk="1GiB",
                          extra=["--kv-events", "tcp://0.0.0.0:0", "--kv-events-replay", "tcp://0.0.0.0:0",
                                 "--auth-token", SERVER_TOKEN, "--tenants", str(tenants), "--config", str(config)])
    routers = {}
    try:
        server_key = re.search(r"CURVE server key (.{40})", server.line).group(1).encode()
        stranger_public, stranger_secret = zmq.curve_keypair()
        wrong_server, _ = zmq.curve_keypair()
        routers["a"] = Router(server, curve=(*curve_client_keys(TENANT_TOKENS["a"]), server_key))
        routers["all"] = Router(server, curve=(*curve_client_keys(SERVER_TOKEN), server_key))
        routers["stranger"] = Router(server, curve=(stranger_public, stranger_secret, server_key))
        routers["wrong server"] = Router(server, curve=(*curve_client_keys(TENANT_TOKENS["a"]), wrong_server))
        routers["plain"] = Router(server, TENANT_TOKENS["a"])
        routers["none"] = Router(server)
        check_tenant_scoping(server, routers, strangers=["stranger", "wrong server", "plain", "none"])
    finally:
        for router in routers.values():
            router.close()
        server.stop()
