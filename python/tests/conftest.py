import os
import pathlib
import subprocess
import tempfile

import pytest

import kvtier

REPO = pathlib.Path(__file__).resolve().parents[2]


def kvtier_binary():
    path = os.environ.get("KVTIER_BIN") or str(REPO / "target" / "release" / "kvtier")
    if not os.path.exists(path):
        pytest.skip(f"the kvtier binary is not built at {path} (cargo build --release)")
    return path


@pytest.fixture
def store(tmp_path):
    with kvtier.Store(str(tmp_path / "store"), memory="64MiB", disk="512MiB") as s:
        yield s


@pytest.fixture(scope="module")
def server():
    """A real `kvtier serve` on a scratch directory and free ports."""
    directory = tempfile.mkdtemp(prefix="kvtier-py-")
    process = subprocess.Popen(
        [kvtier_binary(), "serve", "--data-dir", directory, "--memory", "256MiB", "--disk", "1GiB",
         "--listen", "127.0.0.1:0", "--admin", "off"],
        stdout=subprocess.PIPE,
        env={**os.environ, "RUST_LOG": "error"},
        text=True,
    )
    line = process.stdout.readline()
    assert line.startswith("kvtier serving"), line
    parts = line.replace(",", " ").split()
    urls = {
        # TCP needs the token the server generated in its data directory.
        "token": pathlib.Path(directory, "auth-token").read_text().strip(),
        "tcp": next(p for p in parts if p.startswith("tcp://")),
        "unix": next(p for p in parts if p.startswith("unix://")),
    }
    yield urls
    process.terminate()
    assert process.wait(timeout=30) == 0


@pytest.fixture(params=["store", "unix", "tcp"])
def engine(request, tmp_path):
    """The same interface three ways: embedded, Unix socket, TCP."""
    if request.param == "store":
        with kvtier.Store(str(tmp_path / "store"), memory="64MiB", disk="512MiB") as s:
            yield s
    else:
        urls = request.getfixturevalue("server")
        with kvtier.Client(urls[request.param], shm_size="64MiB", auth_token=urls["token"]) as c:
            yield c
