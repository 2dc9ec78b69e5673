"""The package's layout keeps its promises: the data and DALI parts of the server load no
grpc, and the command line uses only public APIs."""

from __future__ import annotations

import ast
import pathlib
import subprocess
import sys

ROOT = pathlib.Path(__file__).resolve().parents[1]


def test_data_and_core_load_no_grpc() -> None:
    code = (
        "import sys\n"
        "import batchwire.server.data, batchwire.server.core\n"
        "from batchwire.server import ServerConfig\n"
        "from batchwire.server.data import Dataset, ingest, read_manifest\n"
        "from batchwire.server.core import Engine, PipelineSpec\n"
        "print(sorted(m for m in sys.modules if m.split('.')[0] in ('grpc', 'grpc_health',"
        " 'grpc_reflection')))\n"
    )
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=120, check=True
    )
    assert out.stdout.strip() == "[]", out.stdout


def test_server_names_load_on_first_use() -> None:
    import batchwire.server
    from batchwire.server.serving import BatchwireServer

    assert batchwire.server.BatchwireServer is BatchwireServer


def _private_imports(path: pathlib.Path) -> list[str]:
    found = []
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.ImportFrom) and node.module:
            parts = node.module.split(".")
            if (
                parts[0] == "batchwire"
                and parts[1] != "cli"
                and any(p.startswith("_") for p in parts)
            ):
                found.append(f"{path.name}:{node.lineno} {node.module}")
    return found


def test_cli_uses_only_public_apis() -> None:
    found = [hit for path in sorted((ROOT / "cli").glob("*.py")) for hit in _private_imports(path)]
    assert not found, "the CLI imports private modules:\n" + "\n".join(found)
