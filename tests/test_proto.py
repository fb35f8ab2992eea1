"""The generated gRPC modules match the .proto files they come from (`make proto`)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

from tests.procs import REPO


def test_generated_code_is_up_to_date(tmp_path: Path) -> None:
    protos = ["shared/proto/api.proto", "shared/proto/kv.proto"]
    subprocess.run(
        [
            sys.executable,
            "-m",
            "grpc_tools.protoc",
            "-I.",
            f"--python_out={tmp_path}",
            f"--grpc_python_out={tmp_path}",
            *protos,
        ],
        cwd=REPO,
        check=True,
    )
    for name in ("api_pb2.py", "api_pb2_grpc.py", "kv_pb2.py", "kv_pb2_grpc.py"):
        fresh = (tmp_path / "shared/proto" / name).read_text()
        assert fresh == (REPO / "shared/proto" / name).read_text(), f"run `make proto`: {name}"
