"""The thin client works where DALI, LMDB, uvloop and Pillow are not installed."""

from __future__ import annotations

import importlib.metadata
import json
import pathlib
import subprocess
import sys
import textwrap
import urllib.parse

import pytest

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


def _run_cli(argv: list[str], cwd: pathlib.Path) -> subprocess.CompletedProcess[str]:
    """``batchwire ARGV`` where the server packages are missing, in ``cwd``."""
    script = SCRIPT.split("from batchwire.client")[0] + textwrap.dedent(
        """
        from batchwire.cli import main
        sys.exit(main(sys.argv[1:]))
        """
    )
    return subprocess.run(
        [sys.executable, "-c", script, *argv], capture_output=True, text=True, timeout=60, cwd=cwd
    )


def _installed_from() -> pathlib.Path | None:
    """The directory (a checkout) batchwire was installed from, if it was."""
    for dist in importlib.metadata.distributions(name="batchwire"):
        origin = json.loads(dist.read_text("direct_url.json") or "null")
        if isinstance(origin, dict) and "dir_info" in origin:
            return pathlib.Path(urllib.parse.unquote(urllib.parse.urlparse(origin["url"]).path))
    return None


def test_server_commands_without_server_packages_say_what_to_install(
    tmp_path: pathlib.Path,
) -> None:
    result = _run_cli(["serve", "--data-dir", str(tmp_path), "--port", "0"], cwd=tmp_path)
    assert result.returncode == 2, result.stderr
    assert "`batchwire serve` needs the server extra" in result.stderr
    checkout = _installed_from()
    if checkout is None:  # installed from the package index
        assert 'pip install "batchwire[server]"' in result.stderr
        return
    # From a checkout, the command that works there: the index may not have batchwire.
    assert f'"{checkout}[server]"' in result.stderr, result.stderr
    result = _run_cli(["serve", "--data-dir", str(tmp_path), "--port", "0"], cwd=checkout)
    assert '".[server]"' in result.stderr, result.stderr


@pytest.mark.slow
def test_preview_without_pillow_asks_for_the_preview_extra_alone(tmp_path: pathlib.Path) -> None:
    # Nothing listens on port 1: the missing Pillow is found before any streaming.
    argv = ["preview", "--address", "localhost:1", "--dataset", "shapes", "--out", "grid.png"]
    result = _run_cli(argv, cwd=tmp_path)
    assert result.returncode == 2, result.stderr
    assert "PIL is missing: `batchwire preview` needs the preview extra" in result.stderr
    assert "[preview]" in result.stderr and "[server]" not in result.stderr
