"""Namespaces an operator can see and retire, from Python: the embedded
store and a real server, and the manifest an engine integration stores
when it connects."""

import json
import uuid

import pytest

import kvtier
from kvtier import errors
from kvtier.integrations import _common


def listed(engine):
    return {n["name"]: n for n in engine.namespaces()["namespaces"]}


def test_an_embedded_store_lists_describes_and_retires_its_namespace(tmp_path):
    with kvtier.Store(str(tmp_path / "s"), memory="64MiB", disk="512MiB", namespace="model/a") as s:
        for i in range(10):
            assert s.put(f"block-{i}".encode(), bytes([i + 1]) * 5000) == errors.OK
        s.describe_namespace({"model": "a", "dtype": "bfloat16"})
        got = listed(s)["model/a"]
        assert (got["blocks"], got["bytes"], got["memory_only_blocks"]) == (10, 50_000, 0)
        assert got["manifest"] == {"model": "a", "dtype": "bfloat16"}
        with pytest.raises(kvtier.KvtierError):
            s.describe_namespace("x" * (16 * 1024 + 1))
        retired = s.retire_namespace()
        assert retired["blocks"] == 11  # the manifest is retired with the blocks
        assert retired["bytes"] > 50_000
        assert s.get(b"block-0") == b""
        assert listed(s) == {}


def test_a_server_keeps_the_first_description_and_retires_one_namespace(server):
    mine, other = f"py/{uuid.uuid4().hex}", f"py/{uuid.uuid4().hex}"
    with kvtier.Client(server["unix"], namespace=mine) as a, kvtier.Client(server["unix"], namespace=other) as b:
        for i in range(6):
            assert a.put(f"k{i}".encode(), b"a" * 1000) == errors.OK
            assert b.put(f"k{i}".encode(), b"b" * 2000) == errors.OK
        a.describe_namespace(json.dumps({"engine": "test"}))
        first = listed(a)[mine]["manifest"]["first_described_unix_s"]
        a.describe_namespace({"engine": "test", "again": True})
        got = listed(a)[mine]
        assert (got["blocks"], got["bytes"]) == (6, 6000)
        assert got["manifest"]["again"] is True
        assert got["manifest"]["first_described_unix_s"] == first
        assert got["last_used_unix_s"] is not None
        assert a.retire_namespace()["blocks"] == 7
        assert a.get(b"k0") == b""
        assert b.get(b"k0") == b"b" * 2000
        names = listed(b)
        assert mine not in names and names[other]["blocks"] == 6


def test_an_integration_stores_the_fields_its_namespace_hashes(server):
    fields = {"label": "llama", "fingerprint": uuid.uuid4().hex, "dtype": "float16", "rank": "tp0of1"}
    namespace = _common.namespace_for("test-engine", fields)
    client = _common.connect(server["unix"], namespace)
    try:
        manifest = listed(client)[namespace]["manifest"]
        assert manifest["fingerprint"] == fields["fingerprint"]
        assert manifest["engine"] == "test-engine" and manifest["dtype"] == "float16"
    finally:
        client.close()


def test_a_manifest_too_large_for_the_server_is_shortened_not_refused():
    big = {"label": "m", "hf_overrides": {f"k{i}": "v" * 100 for i in range(500)}}
    namespace = _common.namespace_for("test-engine", big)
    text = _common._MANIFESTS[namespace]
    assert len(text.encode()) <= 12 * 1024
    assert json.loads(text)["hf_overrides"].startswith("sha256:")
