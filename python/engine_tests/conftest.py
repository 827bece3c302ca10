"""Fixtures for the engine integration tests: a real `kvtier serve` over the
Unix socket, and a tiny random-weight Llama written at test time (no
downloads). These tests run in the engines' virtual environment
(`scripts/engine-tests` builds it); they fail, never skip, when a part is
missing."""

import json
import os
import pathlib
import signal
import subprocess
import urllib.request

import pytest

REPO = pathlib.Path(__file__).resolve().parents[2]


def kvtier_binary() -> str:
    path = os.environ.get("KVTIER_BIN") or str(REPO / "target" / "release" / "kvtier")
    assert os.path.exists(path), f"the kvtier binary is not built at {path}: run cargo build --release"
    return path


class KvtierServer:
    """`kvtier serve` on a data directory, Unix socket only, restartable."""

    def __init__(self, data_dir: pathlib.Path, memory: str = "256MiB", disk: str = "1GiB", extra=(),
                 listen: str = "off"):
        self.data_dir = data_dir
        self.memory, self.disk, self.listen = memory, disk, listen
        self.extra = list(extra)
        self.process = None
        self.start()

    @property
    def url(self) -> str:
        return f"unix://{self.data_dir / 'kvtier.sock'}"

    def start(self) -> None:
        self.process = subprocess.Popen(
            [kvtier_binary(), "serve", "--data-dir", str(self.data_dir), "--memory", self.memory,
             "--disk", self.disk, "--listen", self.listen, "--admin", "127.0.0.1:0", *self.extra],
            stdout=subprocess.PIPE, env={**os.environ, "RUST_LOG": "warn"}, text=True,
        )
        line = self.process.stdout.readline()
        assert line.startswith("kvtier serving"), line
        self.line = line
        words = line.replace(",", " ").split()
        self.admin = next(p for p in words if p.startswith("http://"))
        self.tcp_url = next((p for p in words if p.startswith("tcp://")), None)

    def kill(self) -> None:
        """SIGKILL: nothing is flushed or closed."""
        self.process.kill()
        self.process.wait(timeout=60)

    def stop(self) -> None:
        self.process.send_signal(signal.SIGTERM)
        assert self.process.wait(timeout=60) == 0

    def restart(self) -> None:
        self.stop()
        self.start()

    def stats(self) -> dict:
        with urllib.request.urlopen(self.admin + "/stats", timeout=10) as r:
            return json.load(r)

    def op(self, name: str) -> dict:
        return self.stats()["server"]["ops"][name]


@pytest.fixture
def kvtier_server(tmp_path):
    server = KvtierServer(tmp_path / "kvtier-data")
    yield server
    server.stop()


def write_tiny_llama(path: pathlib.Path, seed: int = 1234) -> None:
    """A 4-layer Llama with random weights drawn from ``seed``, float32,
    written to ``path`` (the same file names whatever the seed)."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(seed)
    config = LlamaConfig(
        vocab_size=512, hidden_size=256, intermediate_size=512, num_hidden_layers=4,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=2048,
        torch_dtype="float32", tie_word_embeddings=False,
    )
    model = LlamaForCausalLM(config)
    with torch.no_grad():
        # Larger than the default init, so attention is far from uniform and
        # the output follows the cached keys and values closely.
        for p in model.parameters():
            p.mul_(4.0)
    model.save_pretrained(path)


@pytest.fixture(scope="session")
def tiny_llama(tmp_path_factory) -> str:
    """The tiny Llama, written locally. Wide enough that its greedy tokens
    and logprobs depend on every KV byte (test_vllm_e2e checks that wrong
    KV changes them)."""
    path = tmp_path_factory.mktemp("tiny-llama")
    write_tiny_llama(path)
    return str(path)
