"""The thin client works where DALI, LMDB, uvloop and Pillow are not installed."""

from __future__ import annotations

import subprocess
import sys
import textwrap

from batchwire.server import BatchwireServer

SCRIPT = textwrap.dedent(
    """
    import importlib.abc, sys

    class Missing(importlib.abc.MetaPathFinder):
        # Behave as if the server-only packages were not installed.
        def find_spec(self, name, path=None, target=None):
            if name.split(".")[0] in {"nvidia", "lmdb", "uvloop", "PIL"}:
                raise ModuleNotFoundError(f"No module named {name!r}", name=name)
            return None

    sys.meta_path.insert(0, Missing())

    from batchwire.client import RemoteLoader

    with RemoteLoader(sys.argv[1], dataset="shapes", batch_size=8, params={"size": 32}) as loader:
        images, labels = next(iter(loader))
    assert tuple(images.shape) == (8, 3, 32, 32), images.shape
    assert not {"nvidia", "lmdb", "uvloop", "PIL"} & {m.split(".")[0] for m in sys.modules}
    print("ok", len(loader))
    """
)


def test_client_imports_and_streams_without_server_packages(server: BatchwireServer) -> None:
    result = subprocess.run(
        [sys.executable, "-c", SCRIPT, server.target],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert result.returncode == 0, result.stderr
    assert result.stdout.split() == ["ok", str(520 // 8)]


def test_health_command_needs_no_server_packages(server: BatchwireServer) -> None:
    script = SCRIPT.split("from batchwire.client")[0] + textwrap.dedent(
        """
        from batchwire.cli import main
        sys.exit(main(["health", "--address", sys.argv[1]]))
        """
    )
    result = subprocess.run(
        [sys.executable, "-c", script, server.target], capture_output=True, text=True, timeout=60
    )
    assert result.returncode == 0, result.stderr
    assert "SERVING" in result.stdout


def test_server_commands_without_server_packages_say_what_to_install(tmp_path) -> None:  # type: ignore[no-untyped-def]
    script = SCRIPT.split("from batchwire.client")[0] + textwrap.dedent(
        """
        from batchwire.cli import main
        sys.exit(main(["serve", "--data-dir", sys.argv[1], "--port", "0"]))
        """
    )
    result = subprocess.run(
        [sys.executable, "-c", script, str(tmp_path)], capture_output=True, text=True, timeout=60
    )
    assert result.returncode == 2, result.stderr
    assert 'pip install "batchwire[server]"' in result.stderr
