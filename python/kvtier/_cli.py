"""The `kvtier` command a wheel installs: runs the server binary the wheel
carries (`kvtier serve`, `kvtier bench`, ...), so that `pip install kvtier`
brings the server with the client and the integrations, with no Rust
toolchain. An install built from source (`maturin develop`) carries no
binary: build it with `cargo build --release -p kvtier-cli`."""

import os
import pathlib
import sys

BINARY = pathlib.Path(__file__).resolve().parent / "bin" / "kvtier"


def main() -> None:
    if not os.access(BINARY, os.X_OK):
        sys.stderr.write(
            f"kvtier: this install carries no server binary ({BINARY} is missing): it was built "
            "from source. Install a kvtier wheel (scripts/wheel builds one), or build the server "
            "with `cargo build --release --locked -p kvtier-cli` and run target/release/kvtier\n"
        )
        raise SystemExit(1)
    os.execv(BINARY, [str(BINARY), *sys.argv[1:]])


if __name__ == "__main__":
    main()
