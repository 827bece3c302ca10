"""vLLM end to end on CPU: a real engine (scheduler and worker in separate
processes) with the kvtier connector against a real `kvtier serve`."""

import json
import os
import pathlib
import shutil
import subprocess
import sys

import pytest

import kvtier

SCRIPT = pathlib.Path(__file__).with_name("vllm_engine_run.py")
# 6 full blocks of 32 tokens (192 tokens the store can serve) and 8 more.
PROMPT = [(i * 37 + 11) % 509 + 1 for i in range(200)]
BLOCKS = 6


class Engine:
    """A vLLM engine process running `steps` (see vllm_engine_run.py)."""

    def __init__(self, model: str, url: str, steps: list[str], async_loads: bool = True, **more):
        env = {**os.environ, "VLLM_ENABLE_V1_MULTIPROCESSING": "1", "VLLM_CPU_KVCACHE_SPACE": "1"}
        args = json.dumps({"model": model, "url": url, "prompt": PROMPT, "steps": steps, "async_loads": async_loads,
                           **more})
        self.process = subprocess.Popen(
            [sys.executable, str(SCRIPT), args], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT, text=True, env=env,
        )
        self.log: list[str] = []

    def result(self) -> dict:
        for line in self.process.stdout:
            if line.startswith("RESULT "):
                return json.loads(line[len("RESULT "):])
            self.log.append(line)
        self.process.wait()
        raise AssertionError(f"engine exited {self.process.returncode}:\n" + "".join(self.log[-60:]))

    def resume(self) -> None:
        self.process.stdin.write("\n")
        self.process.stdin.flush()

    def finish(self) -> str:
        rest = self.process.stdout.read()
        self.log.append(rest)
        assert self.process.wait(timeout=120) == 0, "".join(self.log[-60:])
        return "".join(self.log)


def same_output(a: dict, b: dict) -> bool:
    return a["tokens"] == b["tokens"] and a["logprobs"] == b["logprobs"]


def same_computation(a: dict, b: dict, tolerance: float = 1e-4) -> bool:
    """Outputs of two engine processes (one without the connector, whose
    kernels batch differently): the same tokens, logprobs within float32
    rounding. Wrong KV moves them by far more (test above)."""
    if a["tokens"] != b["tokens"] or len(a["logprobs"]) != len(b["logprobs"]):
        return False
    for x, y in zip(a["logprobs"], b["logprobs"]):
        if [t for t, _ in x] != [t for t, _ in y] or any(abs(p - q) > tolerance for (_, p), (_, q) in zip(x, y)):
            return False
    return True


@pytest.mark.parametrize("async_loads", [True, False], ids=["async", "sync"])
def test_a_kvtier_hit_matches_a_local_hit_exactly_and_wrong_kv_would_show(kvtier_server, tiny_llama, async_loads):
    engine = Engine(tiny_llama, kvtier_server.url,
                    ["run", "run", "reset", "run", "keys", "pause", "reset", "run", "pause", "reset", "run"],
                    async_loads=async_loads)
    cold, local, hit, keys = engine.result(), engine.result(), engine.result(), engine.result()
    assert cold["cached"] == 0
    assert local["cached"] == BLOCKS * 32, local
    # vLLM's own cache was reset: the 192 cached tokens came from kvtier.
    assert hit["cached"] == BLOCKS * 32, hit
    assert same_output(hit, local), (hit, local)
    loads = kvtier_server.op("batch_get_shm_segments")
    assert loads["keys"] == BLOCKS and loads["errors"] == 0, loads
    assert kvtier_server.op("batch_put")["requests"] == 0  # every byte went through shared memory

    # The test can fail: the same blocks' keys holding other blocks' (valid,
    # verified) bytes change the output.
    assert engine.result() == {"paused": True}
    names = [bytes.fromhex(k) for k in keys["keys"][:BLOCKS]]
    with kvtier.Client(kvtier_server.url, namespace=keys["namespace"]) as client:
        originals = [client.get(k) for k in names]
        assert all(len(v) == len(originals[0]) > 0 for v in originals)
        for i, k in enumerate(names):
            assert client.put(k, originals[(i + 1) % BLOCKS]) == 0
        engine.resume()
        wrong = engine.result()
        assert wrong["cached"] == BLOCKS * 32
        assert not same_output(wrong, local), "output does not depend on the loaded KV: the test would prove nothing"
        assert engine.result() == {"paused": True}
        for k, v in zip(names, originals):
            assert client.put(k, v) == 0
    engine.resume()
    restored = engine.result()
    assert same_output(restored, local)
    engine.finish()


def flip_value_on_disk(data_dir: pathlib.Path, value: bytes) -> None:
    """Flips one byte of `value` where it lies in a region file."""
    probe = value[:4096]
    for region in sorted((data_dir / "regions").glob("*.kvr")):
        data = bytearray(region.read_bytes())
        at = data.find(probe)
        if at >= 0:
            data[at + 100] ^= 0xFF
            region.write_bytes(bytes(data))
            return
    raise AssertionError("value not found in any region file")


def test_a_second_engine_hits_and_a_corrupt_block_is_recomputed(kvtier_server, tiny_llama):
    first = Engine(tiny_llama, kvtier_server.url, ["run", "run", "keys"])
    _cold, reference, keys = first.result(), first.result(), first.result()
    first.finish()

    # Another engine process, started afterwards, hits what the first saved.
    second = Engine(tiny_llama, kvtier_server.url, ["run", "pause", "reset", "run"])
    hit = second.result()
    assert hit["cached"] == BLOCKS * 32, hit
    assert same_output(hit, reference)

    # Restart the server (memory empty: loads come from disk) with one
    # block's bytes corrupted on disk, under the running engine.
    assert second.result() == {"paused": True}
    names = [bytes.fromhex(k) for k in keys["keys"][:BLOCKS]]
    with kvtier.Client(kvtier_server.url, namespace=keys["namespace"]) as client:
        victim = client.get(names[2])
        client.flush()
    kvtier_server.stop()
    flip_value_on_disk(kvtier_server.data_dir, victim)
    kvtier_server.start()
    assert kvtier_server.stats()["store"]["memory_entries"] == 0
    second.resume()
    recomputed = second.result()
    log = second.finish()
    # The lookup still finds all 6 blocks; the load of block 2 fails its
    # checksum, vLLM is told and recomputes: the output is unchanged.
    assert recomputed["cached"] == BLOCKS * 32, recomputed
    assert same_output(recomputed, reference)
    stats = kvtier_server.stats()
    assert stats["store"]["checksum_failures"] == 1, stats["store"]
    assert "missing or corrupt, vLLM recomputes them" in log
    # The reconnected client kept using its shared memory.
    assert stats["server"]["ops"]["batch_get_shm_segments"]["keys"] == BLOCKS


def rewrite_weights(model: pathlib.Path, seed: int) -> None:
    """Other weights in place, as a rolling model update writes them: same
    path, same config and file names, same sizes."""
    from conftest import write_tiny_llama

    before = {p.name: p.stat().st_size for p in model.iterdir()}
    write_tiny_llama(model, seed=seed)
    assert {p.name: p.stat().st_size for p in model.iterdir()} == before


def test_kv_of_other_weights_or_numerics_never_hits_and_a_copied_checkpoint_does(
    kvtier_server, tiny_llama, tmp_path
):
    """The namespace names the model by its content: a copy of the
    checkpoint at another path (another host) hits; the same path with
    other weights, or other numerics (hf_overrides), gets 0 external hits
    and computes what an engine without kvtier computes."""
    model = tmp_path / "llama"
    shutil.copytree(tiny_llama, model)
    first = Engine(str(model), kvtier_server.url, ["run"])
    truth = first.result()
    first.finish()
    assert truth["cached"] == 0

    copy = tmp_path / "elsewhere" / "llama-copy"
    shutil.copytree(model, copy)
    copied = Engine(str(copy), kvtier_server.url, ["run"])
    hit = copied.result()
    copied.finish()
    assert hit["cached"] == BLOCKS * 32 and same_output(hit, truth), hit

    # Weights replaced in place: the blocks stored above must not be used.
    rewrite_weights(model, seed=99)
    updated = Engine(str(model), kvtier_server.url, ["run", "reset", "run"])
    cold, own = updated.result(), updated.result()
    updated.finish()
    assert cold["cached"] == 0, "KV of the old weights was loaded for the new ones"
    assert own["cached"] == BLOCKS * 32 and same_output(own, cold)  # the new weights' own blocks hit
    plain = Engine(str(model), kvtier_server.url, ["run"], connector=False)
    reference = plain.result()
    plain.finish()
    assert same_computation(cold, reference), (cold, reference)
    assert not same_computation(reference, truth), "the weights do not change the output: the test would prove nothing"

    # Same path and weights, other numerics.
    tuned = Engine(str(model), kvtier_server.url, ["run"], hf_overrides={"rms_norm_eps": 0.5})
    other = tuned.result()
    tuned.finish()
    assert other["cached"] == 0, "KV of other numerics was loaded"
    assert not same_output(other, cold), "rms_norm_eps does not change the output: the test would prove nothing"


@pytest.mark.parametrize("async_loads", [True, False], ids=["async", "sync"])
def test_wrong_size_and_removed_values_cost_one_recompute_never_a_loop(kvtier_server, tiny_llama, async_loads):
    """Every stored block of the prompt overwritten with a value of the
    wrong size (shorter, longer) and one removed: the next request's loads
    fail once, vLLM reschedules it once, it finishes with the right output;
    its recompute replaces the wrong values, so the next request hits."""
    engine = Engine(tiny_llama, kvtier_server.url, ["run", "keys", "pause", "reset", "run", "reset", "run"],
                    async_loads=async_loads)
    truth, keys = engine.result(), engine.result()
    assert engine.result() == {"paused": True}
    names = [bytes.fromhex(k) for k in keys["keys"][:BLOCKS]]
    with kvtier.Client(kvtier_server.url, namespace=keys["namespace"]) as client:
        size = len(client.get(names[0]))
        for n, name in enumerate(names):
            if n == BLOCKS - 1:
                assert client.remove(name) == 0
            else:
                assert client.put(name, b"\x07" * (size // 2 if n % 2 else size + 4096)) == 0
        engine.resume()
        recovered, replaced = engine.result(), engine.result()
        log = engine.finish()
        assert same_output(recovered, truth), (recovered, truth)
        # The hit ended where the removed block is (fewer tokens counted
        # once vLLM took the failure back); every load of it failed once.
        assert recovered["cached"] <= (BLOCKS - 1) * 32, recovered
        assert log.count("Recovered from KV load failure") == 1, log[-4000:]
        assert "offered to no request until stored again" in log
        # The recompute replaced every value, the removed one included, and
        # nothing computed over the unfilled blocks was kept (in-step loads).
        assert all(len(client.get(name)) == size for name in names)
    assert replaced["cached"] == BLOCKS * 32 and same_output(replaced, truth), replaced
