"""The package's layout keeps its promises: one package, ``batchwire``, in ``src/`` (no
top-level ``client`` or ``server`` module installed) that mypy sees; the data and DALI parts
of the server load no grpc; the command line uses only public APIs; the paths the docs name
exist."""

from __future__ import annotations

import ast
import importlib.metadata
import json
import pathlib
import re
import subprocess
import sys
import textwrap

import mypy.api

ROOT = pathlib.Path(__file__).resolve().parents[1]
PACKAGE = ROOT / "src" / "batchwire"


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


def _private_imports(path: pathlib.Path, *, own: str = "cli") -> list[str]:
    """Imports of a private module of batchwire in ``path``, but those of package ``own``."""
    found = []
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.ImportFrom) and node.module:
            parts = node.module.split(".")
            if (
                parts[0] == "batchwire"
                and parts[1] != own
                and any(p.startswith("_") for p in parts)
            ):
                found.append(f"{path.name}:{node.lineno} {node.module}")
    return found


def test_cli_uses_only_public_apis() -> None:
    cli = PACKAGE / "cli"
    found = [hit for path in sorted(cli.glob("*.py")) for hit in _private_imports(path)]
    assert not found, "the CLI imports private modules:\n" + "\n".join(found)


def test_benchmarks_use_only_public_apis() -> None:
    """``benchmarks/`` measures what ``batchwire bench`` measures, through ``batchwire.bench``
    and the other public modules, never another package's private parts."""
    benchmarks = pathlib.Path(__file__).parents[1] / "benchmarks"
    paths = sorted(benchmarks.glob("*.py"))
    assert paths, f"no benchmarks found in {benchmarks}"
    found = [hit for path in paths for hit in _private_imports(path, own="")]
    assert not found, "benchmarks/ imports private modules:\n" + "\n".join(found)


def test_one_package_is_installed_and_no_top_level_client_or_server(
    tmp_path: pathlib.Path,
) -> None:
    """Outside the checkout (``-I``: neither the working directory nor PYTHONPATH on
    ``sys.path``), ``batchwire`` and its parts import, and nothing else of the checkout does."""
    code = (
        "import importlib.util\n"
        "import batchwire, batchwire.client, batchwire.common, batchwire.server, batchwire.cli\n"
        "import batchwire.v1.batchwire_pb2, batchwire.v1.batchwire_pb2_grpc\n"
        "print(batchwire.__version__)\n"
        "print(sorted(name for name in ('client', 'server', 'common', 'cli', 'v1', 'src',"
        " 'proto', 'benchmarks') if importlib.util.find_spec(name) is not None))\n"
    )
    out = subprocess.run(
        [sys.executable, "-I", "-c", code],
        capture_output=True,
        text=True,
        timeout=120,
        check=True,
        cwd=tmp_path,
    )
    version, found = out.stdout.split("\n")[:2]
    assert version == importlib.metadata.version("batchwire")
    assert found == "[]", f"top-level modules installed besides batchwire: {found}"


def test_typed_markers_are_in_the_package() -> None:
    assert (PACKAGE / "py.typed").is_file()
    assert (PACKAGE / "client" / "py.typed").is_file()


def _module_name(path: pathlib.Path) -> str:
    parts = list(path.relative_to(PACKAGE.parent).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _package_imports(path: pathlib.Path, modules: set[str]) -> set[str]:
    """The modules of ``modules`` that ``path`` imports anywhere (under ``TYPE_CHECKING``
    and inside functions too)."""
    found: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            # ``from package import module`` imports the module; any other name, the package.
            named = {f"{node.module}.{alias.name}" for alias in node.names}
            found |= named & modules
            if not named <= modules:
                found.add(node.module)
        elif isinstance(node, ast.Import):
            found |= {alias.name for alias in node.names}
    return found & modules


def _a_cycle(graph: dict[str, set[str]]) -> list[str]:
    """One import loop in ``graph`` (module -> the modules it imports), or []."""
    done: set[str] = set()

    def visit(module: str, path: list[str]) -> list[str]:
        if module in path:
            return [*path[path.index(module) :], module]
        if module in done:
            return []
        for imported in sorted(graph[module]):
            loop = visit(imported, [*path, module])
            if loop:
                return loop
        done.add(module)
        return []

    return next((loop for module in sorted(graph) if (loop := visit(module, []))), [])


def test_the_package_imports_no_cycle() -> None:
    """No module of batchwire imports itself around a loop, not even for a type under
    ``TYPE_CHECKING`` or inside a function: a name that needs a loop sits in the wrong
    module, and a reader has no place to start. (``from package import module`` counts as
    importing the module, not the package's ``__init__``.)"""
    paths = {
        _module_name(path): path
        for path in sorted(PACKAGE.rglob("*.py"))
        if path.relative_to(PACKAGE).parts[0] != "v1"  # generated by protoc
    }
    graph = {name: _package_imports(path, set(paths)) - {name} for name, path in paths.items()}
    assert sum(map(len, graph.values())) > 100, "few imports found: the walk misreads modules"
    loop = _a_cycle(graph)
    assert not loop, "an import loop: " + " -> ".join(loop)
    assert _a_cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == ["a", "b", "c", "a"]


# Run in a process of its own, so that no thread of another test is profiled with it.
_BATCH_PATH = """
import json, pathlib, sys, threading
from conftest import start_server
from batchwire.client import RemoteLoader

package = str(pathlib.Path(sys.modules["batchwire"].__file__).parent)
seen, recording = set(), threading.Event()

def profile(frame, event, arg):
    path = frame.f_code.co_filename
    if event == "call" and recording.is_set() and path.startswith(package):
        seen.add(str(pathlib.Path(path).relative_to(package)))

threading.setprofile(profile)  # the server's threads and the pullers start after this
sys.setprofile(profile)
# No timed rescan of the data directory: it is no batch's path (it would run in the window).
server = start_server(pathlib.Path(sys.argv[1]), rescan_interval=0)
try:
    with RemoteLoader(server.target, dataset="shapes", pipeline="val", batch_size=8) as remote:
        batches = iter(remote)
        for _ in range(5):
            next(batches)
        recording.set()
        for _ in range(10):
            next(batches)
        recording.clear()
finally:
    sys.setprofile(None)
    threading.setprofile(None)
    server.stop(grace=1.0)
print(json.dumps(sorted(seen)))
"""


def test_a_batch_crosses_at_most_twenty_files(data_dir: pathlib.Path) -> None:
    """The path of a steady-state batch, from the records the server reads to the tensors
    the loop gets, in every thread of a server and a loader started for it: the package's
    files it runs in. A reader following one batch opens at most 22 files, 7 of them the
    client's and ``batchwire.common``'s; a new hop on that path shows up here."""
    out = subprocess.run(
        [sys.executable, "-c", _BATCH_PATH, str(data_dir)],
        capture_output=True,
        text=True,
        timeout=240,
        cwd=pathlib.Path(__file__).parent,
    )
    assert out.returncode == 0, out.stderr[-3000:]
    lines = out.stdout.strip().splitlines()
    seen = {path for path in json.loads(lines[-1]) if not path.startswith("v1/")}  # protoc's
    # The server: the servicer and the stream, the scheduler and its fair queue, the
    # runner, DALI, health, the record path (the dataset, the shard's index that locates a
    # record in its file, the Datum walk that locates the image in the record, the screen)
    # and its read-ahead; the client: the loop, the pass and its book, _delivery, and the
    # codec.
    for path in ("server/core/_runner.py", "server/data/_dataset.py", "client/_delivery.py"):
        assert path in seen, sorted(seen)
    assert len(seen) <= 22, "\n".join(sorted(seen))
    client = {path for path in seen if path.startswith(("client/", "common/"))}
    assert len(client) <= 7, "\n".join(sorted(client))


def test_the_paths_the_docs_name_exist() -> None:
    """Files of the checkout named in README, the docs and the development page's layout
    table (``src/...``, ``proto/...`` and the table's first column) are where they say."""
    pages = [ROOT / "README.md", *sorted((ROOT / "docs").rglob("*.md"))]
    named = {
        (page.name, path)
        for page in pages
        for path in re.findall(r"`((?:src|proto)/[\w./-]+)`", page.read_text())
    }
    table = (ROOT / "docs" / "development.md").read_text().split("## Layout", 1)[1]
    named |= {("development.md", p) for p in re.findall(r"^\| `([^`]+)` \|", table, re.M)}
    assert named, "no paths found: the patterns no longer match the docs"
    missing = sorted(f"{page}: {path}" for page, path in named if not (ROOT / path).exists())
    assert not missing, "the docs name paths that do not exist:\n" + "\n".join(missing)


def test_mypy_sees_the_real_types_of_the_installed_package() -> None:
    """With the project's mypy settings (missing imports ignored), ``batchwire`` names
    resolve to their classes: a package mypy could not find would be ``Any``, silently."""
    snippet = textwrap.dedent(
        """
        from batchwire.client import RemoteLoader
        from batchwire.common.sampler import Share

        def f(loader: RemoteLoader, share: Share) -> None:
            reveal_type(loader)
            reveal_type(share.plan(10))
            reveal_type(loader.state_dict())
        """
    )
    stdout, stderr, status = mypy.api.run(
        [
            "--config-file",
            str(ROOT / "pyproject.toml"),
            "--cache-dir",
            str(ROOT / ".mypy_cache"),
            "-c",
            snippet,
        ]
    )
    # Older mypy releases spell builtins out ("builtins.dict[builtins.str, Any]").
    revealed = [
        name.replace("builtins.", "") for name in re.findall(r'Revealed type is "([^"]+)"', stdout)
    ]
    assert revealed == [
        "batchwire.client._loader.RemoteLoader",
        "batchwire.common.sampler.Plan",
        "dict[str, Any]",
    ], stdout + stderr
    assert status == 0, stdout + stderr


def test_the_slow_integration_tests_carry_their_markers() -> None:
    """``-m docker``, ``-m frameworks`` and ``-m docs`` select exactly their modules, and
    nothing else is marked, so ``-m "not docker and not frameworks and not docs"`` (the
    development guide's quick run) leaves out just those."""
    tests = pathlib.Path(__file__).parent
    expected = {
        "docker": {"test_compose_up.py"},
        "frameworks": {"test_frameworks.py", "test_elastic_frameworks.py"},
        "docs": {"test_docs.py"},
    }
    for marker, modules in expected.items():
        out = subprocess.run(
            [sys.executable, "-m", "pytest", "--collect-only", "-q", "-m", marker, str(tests)],
            capture_output=True,
            text=True,
            timeout=300,
            cwd=tests.parent,
        )
        assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
        collected = [line for line in out.stdout.splitlines() if "::" in line]
        assert collected, f"-m {marker} selected no test:\n{out.stdout[-3000:]}"
        files = {line.split("::")[0].rsplit("/", 1)[-1] for line in collected}
        assert files == modules, f"-m {marker} selected tests in {sorted(files)}"


def test_no_module_over_400_lines_and_no_function_over_60() -> None:
    """Each module of the package reads in one sitting: at most 400 lines, and no function
    (or method) over 60 (the code protoc generates aside)."""
    too_long = []
    for path in sorted(PACKAGE.rglob("*.py")):
        if path.relative_to(PACKAGE).parts[0] == "v1":
            continue
        text = path.read_text()
        name = str(path.relative_to(PACKAGE))
        if len(text.splitlines()) > 400:
            too_long.append(f"{name}: {len(text.splitlines())} lines")
        for node in ast.walk(ast.parse(text, name)):
            if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef):
                lines = (node.end_lineno or node.lineno) - node.lineno + 1
                if lines > 60:
                    too_long.append(f"{name}:{node.lineno} {node.name}: {lines} lines")
    assert not too_long, "\n".join(too_long)
