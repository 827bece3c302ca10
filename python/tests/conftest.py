import os
import pathlib
import shutil
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
    # A module's server writes hundreds of MiB: CI runs on one machine
    # again and again, so nothing is left behind.
    shutil.rmtree(directory, ignore_errors=True)


@pytest.fixture(params=["store", "unix", "tcp", "tcp-routing"])
def engine(request, tmp_path):
    """The same interface four ways: embedded, Unix socket, TCP, and TCP with
    client-side routing on (a lone server: the client asks for the cluster
    view, finds none, and talks to the server alone)."""
    if request.param == "store":
        with kvtier.Store(str(tmp_path / "store"), memory="64MiB", disk="512MiB") as s:
            yield s
    else:
        urls = request.getfixturevalue("server")
        url = urls[request.param.removesuffix("-routing")]
        route = request.param.endswith("-routing")
        with kvtier.Client(url, shm_size="64MiB", auth_token=urls["token"], route=route) as c:
            yield c


def make_tls_files(directory):
    """A CA and a server certificate for 127.0.0.1 signed by it, made with the
    `openssl` command (CI installs it; the test fails, never skips, without
    it). Returns (ca, cert, key) paths."""
    d = pathlib.Path(directory)
    (d / "server.ext").write_text("subjectAltName=IP:127.0.0.1\nbasicConstraints=CA:FALSE\n")
    ec = ["-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:prime256v1", "-nodes"]
    for args in (
        ["req", "-x509", *ec, "-keyout", "ca.key", "-out", "ca.pem", "-days", "2", "-subj", "/CN=kvtier test CA"],
        ["req", *ec, "-keyout", "server.key", "-out", "server.csr", "-subj", "/CN=127.0.0.1"],
        ["x509", "-req", "-in", "server.csr", "-CA", "ca.pem", "-CAkey", "ca.key", "-CAcreateserial",
         "-out", "server.pem", "-days", "2", "-extfile", "server.ext"],
    ):
        subprocess.run(["openssl", *args], cwd=d, check=True, capture_output=True)
    return str(d / "ca.pem"), str(d / "server.pem"), str(d / "server.key")


@pytest.fixture(scope="module")
def tls_server():
    """A real `kvtier serve` whose TCP listener speaks TLS."""
    directory = tempfile.mkdtemp(prefix="kvtier-py-tls-")
    ca, cert, key = make_tls_files(directory)
    process = subprocess.Popen(
        [kvtier_binary(), "serve", "--data-dir", os.path.join(directory, "data"), "--memory", "128MiB",
         "--disk", "256MiB", "--listen", "127.0.0.1:0", "--admin", "off", "--socket", "off",
         "--tls-cert", cert, "--tls-key", key],
        stdout=subprocess.PIPE,
        env={**os.environ, "RUST_LOG": "error"},
        text=True,
    )
    line = process.stdout.readline()
    assert line.startswith("kvtier serving"), line
    url = next(p for p in line.replace(",", " ").split() if p.startswith("tls://"))
    token = pathlib.Path(directory, "data", "auth-token").read_text().strip()
    yield {"url": url, "token": token, "ca": ca}
    process.terminate()
    assert process.wait(timeout=30) == 0
    shutil.rmtree(directory, ignore_errors=True)
