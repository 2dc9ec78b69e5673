"""Shared memory tried as an attacker and a broken host would try it, with real trainer
processes: a same-uid process hunting for a ring to write, a trainer of another user,
the kernel refusing what either side needs, SIGKILL and fork in the middle of a pass.
Each epoch comes out whole and byte-identical to the socket path, and nothing of a ring
outlives the stream."""

from __future__ import annotations

import contextlib
import errno
import json
import mmap
import os
import pathlib
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
from collections.abc import Iterator

import namespaces
import numpy as np
import pytest
import seccomp
import torch
from processes import serve_process
from test_shared_memory import (
    RING,
    assert_same,
    epoch,
    eventually,
    loader,
    nothing_held,
    ring_mappings,
    shared_bytes,
)

from batchwire.client._transport._ring_pages import MAP_NORESERVE
from batchwire.server import BatchwireServer

pytestmark = pytest.mark.skipif(
    seccomp.unsupported_reason() is not None or sys.platform != "linux",
    reason=str(seccomp.unsupported_reason()),
)

# A trainer: one epoch, as test_shared_memory.epoch streams it, saved for comparison.
# {on_batch} runs after each batch n; `report` is printed as JSON at the end.
TRAINER = """
import json, os, sys, threading
import numpy as np
from batchwire.client import RemoteLoader

report = {{}}
loader = RemoteLoader(
    sys.argv[1], dataset="shapes", pipeline="val", batch_size=32, return_ids=True,
    normalize=False, params={{"size": 32}}, shuffle=True, seed=7,
)
loader.set_epoch(3)
images, labels, ids = [], [], []
with loader:
    for n, (i, l, d) in enumerate(loader):
        images.append(i.numpy()); labels.append(l.numpy()); ids.append(d.numpy())
{on_batch}
np.savez(  # the batches one after the other (the last may be short), and their sizes
    sys.argv[2], images=np.concatenate(images), labels=np.concatenate(labels),
    ids=np.concatenate(ids), sizes=np.array([len(d) for d in ids]),
)
print(json.dumps(report), flush=True)
"""


def run_trainer(
    target: str,
    out: pathlib.Path,
    on_batch: str = "",
    prelude: str = "",
    launcher: tuple[str, ...] = (),
    env: dict[str, str] | None = None,
) -> dict[str, object]:
    script = prelude + TRAINER.format(on_batch=_indent(on_batch))
    done = subprocess.run(
        [*launcher, sys.executable, "-c", script, target, str(out)],
        capture_output=True,
        text=True,
        timeout=240,
        env=env,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    report = json.loads(done.stdout.strip().splitlines()[-1])
    report["stderr"] = done.stderr
    return report


def _indent(code: str) -> str:
    return "\n".join("        " + line for line in code.strip().splitlines())


@pytest.fixture(scope="module")
def over_the_socket(server: BatchwireServer) -> list[tuple[torch.Tensor, ...]]:
    """The epoch every test here streams, as the socket path delivers it."""
    return epoch(server.target, shared_memory=False)


def assert_saved_same(saved: pathlib.Path, expected: list[tuple[torch.Tensor, ...]]) -> None:
    got = np.load(saved)
    cuts = np.cumsum(got["sizes"])[:-1]
    batches = zip(*(np.split(got[k], cuts) for k in ("images", "labels", "ids")), strict=True)
    assert_same([tuple(map(torch.from_numpy, batch)) for batch in batches], expected)


# Run by a process of the server's own uid while a ring is in use: every way it could
# find one (a name in /dev/shm, a descriptor or a mapping under /proc) and every way it
# could change one (write, a writable mapping, resizing).
ATTACKER = """
import glob, json, mmap, os
found, changed = [], []
named = [n for n in os.listdir("/dev/shm") if n.startswith("batchwire") and "loader" not in n]
for link in glob.glob("/proc/[0-9]*/fd/*") + glob.glob("/proc/[0-9]*/map_files/*"):
    try:
        if not os.readlink(link).startswith(%(ring)r):
            continue
        fd = os.open(link, os.O_RDWR)
    except OSError:
        continue
    found.append(link)
    attempts = {
        "write": lambda: os.pwrite(fd, b"\\xff" * 4096, 0),
        "map": lambda: mmap.mmap(fd, 4096, prot=mmap.PROT_READ | mmap.PROT_WRITE),
        "shrink": lambda: os.ftruncate(fd, 0),
        "grow": lambda: os.posix_fallocate(fd, 0, 1 << 34),
    }
    for how, attempt in attempts.items():
        try:
            attempt()
            changed.append((link, how))
        except (OSError, ValueError):
            pass
    os.close(fd)
print(json.dumps({"named": named, "found": found, "changed": changed}))
"""


def test_a_same_uid_process_can_find_no_ring_by_name_and_change_none_it_finds(
    server: BatchwireServer, over_the_socket: list[tuple[torch.Tensor, ...]]
) -> None:
    loader_epoch = []
    with loader(server.target) as reading:
        for n, batch in enumerate(reading):
            loader_epoch.append(batch)
            if n == 1:
                assert ring_mappings() >= 2  # the server's and the loader's
                attack = subprocess.run(
                    [sys.executable, "-c", ATTACKER % {"ring": RING}],
                    capture_output=True,
                    text=True,
                    timeout=60,
                    check=True,
                )
                report = json.loads(attack.stdout)
    assert report["named"] == []  # nothing in /dev/shm to find
    assert report["found"]  # the descriptors and mappings under /proc: found, opened
    assert report["changed"] == []  # and not one write, writable mapping or resize
    assert_same(loader_epoch, over_the_socket)


def test_a_trainer_of_another_uid_gets_its_batches_through_shared_memory_and_no_secret(
    server: BatchwireServer,
    request: pytest.FixtureRequest,
    over_the_socket: list[tuple[torch.Tensor, ...]],
) -> None:
    if os.geteuid() != 0 or shutil.which("setpriv") is None:
        pytest.skip("needs root and setpriv (util-linux) to run a trainer as another user")
    uid = 12345
    become = ("setpriv", f"--reuid={uid}", f"--regid={uid}", "--clear-groups")
    probe = subprocess.run([*become, sys.executable, "-c", "import batchwire.client"], check=False)
    if probe.returncode != 0:
        pytest.skip("the checkout or its virtualenv is not readable by other users here")
    # pytest's tmp_path is root's alone: the trainer's files lie where any user may look.
    visible = pathlib.Path(tempfile.mkdtemp(prefix="batchwire-uid-test-", dir="/tmp"))
    request.addfinalizer(lambda: shutil.rmtree(visible, ignore_errors=True))
    visible.chmod(0o755)
    secret = visible / "tokens"
    secret.write_text("a-bearer-token\n")
    secret.chmod(0o400)  # as compose.secure.yaml asks of the server's files
    out_dir = visible / "out"
    out_dir.mkdir()
    out_dir.chmod(0o777)
    before = shared_bytes(server, "val")
    tried = f"""
if n == 0:
    for path in ({str(secret)!r}, "/proc/{os.getpid()}/environ"):
        try:
            open(path, "rb").read()
            report[path] = "read"
        except OSError as exc:
            report[path] = exc.errno
"""
    env = {**os.environ, "HOME": str(out_dir)}
    report = run_trainer(server.target, out_dir / "epoch.npz", tried, launcher=become, env=env)
    assert report[str(secret)] == errno.EACCES
    assert report[f"/proc/{os.getpid()}/environ"] == errno.EACCES
    assert shared_bytes(server, "val") - before == 520 * 3 * 32 * 32  # all of it shared
    assert_saved_same(out_dir / "epoch.npz", over_the_socket)


def test_a_trainer_whose_dev_shm_is_full_gets_its_batches_through_shared_memory(
    server: BatchwireServer, tmp_path: pathlib.Path, over_the_socket: list[tuple[torch.Tensor, ...]]
) -> None:
    # Docker's 64 MiB /dev/shm, filled by DataLoader workers: the ring is not there, and
    # the loader's ledger goes elsewhere.
    before = shared_bytes(server, "val")
    script = TRAINER.format(on_batch="")
    out = tmp_path / "epoch.npz"
    done = namespaces.run_python(script, server.target, str(out), shm="full", timeout=240)
    assert done.returncode == 0, done.stderr[-3000:]
    assert shared_bytes(server, "val") - before == 520 * 3 * 32 * 32  # all of it shared
    assert_saved_same(out, over_the_socket)


def test_a_fork_during_a_pass_leaves_the_child_no_ring(
    server: BatchwireServer, tmp_path: pathlib.Path, over_the_socket: list[tuple[torch.Tensor, ...]]
) -> None:
    fork = f"""
if n == 2:
    read, write = os.pipe()
    child = os.fork()
    if child == 0:
        maps = open("/proc/self/maps").read().count({RING!r})
        held = 0
        for fd in os.listdir("/proc/self/fd"):
            try:
                held += os.readlink(f"/proc/self/fd/{{fd}}").startswith({RING!r})
            except OSError:
                pass
        os.write(write, json.dumps([maps, held]).encode())
        os._exit(0)
    os.close(write)
    report["child"] = json.loads(os.read(read, 100))
    os.waitpid(child, 0)
    report["parent"] = open("/proc/self/maps").read().count({RING!r})
"""
    report = run_trainer(server.target, tmp_path / "epoch.npz", fork)
    assert report["parent"] == 1  # the pass reads its ring
    assert report["child"] == [0, 0]  # the child has neither its mapping nor a descriptor
    assert_saved_same(tmp_path / "epoch.npz", over_the_socket)


@contextlib.contextmanager
def stalled_trainer(target: str, out: pathlib.Path) -> Iterator[subprocess.Popen[str]]:
    """A trainer process that holds its pass after 3 batches; yields it then, and kills
    it (SIGKILL) at the end of the block if it still runs."""
    stall = "if n == 2:\n    print('reading', flush=True)\n    threading.Event().wait(120)"
    script = TRAINER.format(on_batch=_indent(stall))
    trainer = subprocess.Popen(
        [sys.executable, "-c", script, target, str(out)], stdout=subprocess.PIPE, text=True
    )
    try:
        assert trainer.stdout is not None
        assert trainer.stdout.readline().strip() == "reading"
        yield trainer
    finally:
        if trainer.poll() is None:
            trainer.kill()
            trainer.wait(30)
        if trainer.stdout is not None:
            trainer.stdout.close()


def test_a_killed_trainer_leaves_the_server_holding_no_ring(
    server: BatchwireServer, tmp_path: pathlib.Path
) -> None:
    with stalled_trainer(server.target, tmp_path / "never.npz") as trainer:
        assert ring_mappings() >= 1  # the server's side of the trainer's ring
        trainer.send_signal(signal.SIGKILL)
        trainer.wait(30)
    assert eventually(nothing_held, 30)


def test_a_trainer_that_cannot_claim_shared_memory_gets_its_batches_in_their_messages(
    server: BatchwireServer, tmp_path: pathlib.Path, over_the_socket: list[tuple[torch.Tensor, ...]]
) -> None:
    # No descriptor for the Unix socket of the claim: as with no descriptors left.
    refuse = seccomp.python_prelude([seccomp.Rule("socket", errno.EMFILE, arg=socket.AF_UNIX)])
    before = shared_bytes(server, "val")
    report = run_trainer(server.target, tmp_path / "epoch.npz", prelude=refuse)
    assert shared_bytes(server, "val") == before
    stderr = str(report["stderr"])
    assert stderr.count("could not take shared memory") == 1, stderr  # said once
    assert_saved_same(tmp_path / "epoch.npz", over_the_socket)


def test_a_trainer_that_cannot_map_its_ring_goes_on_over_the_socket(
    server: BatchwireServer, tmp_path: pathlib.Path, over_the_socket: list[tuple[torch.Tensor, ...]]
) -> None:
    # Every mapping of a file refused, shared (mmap's flags, argument 3, MAP_SHARED) and
    # copy-on-write (MAP_PRIVATE | MAP_NORESERVE, as a loader on the CPU maps its ring):
    # the ring is claimed, then cannot be read at its first batch.
    refuse = seccomp.python_prelude(
        [
            seccomp.Rule("mmap", errno.ENOMEM, arg=mmap.MAP_SHARED, index=3),
            seccomp.Rule("mmap", errno.ENOMEM, arg=mmap.MAP_PRIVATE | MAP_NORESERVE, index=3),
        ]
    )
    report = run_trainer(server.target, tmp_path / "epoch.npz", prelude=refuse)
    stderr = str(report["stderr"])
    assert "could not map the server's shared memory" in stderr, stderr
    assert "INTERNAL" not in stderr
    assert_saved_same(tmp_path / "epoch.npz", over_the_socket)


@pytest.mark.parametrize(
    "rule, said",
    [
        (seccomp.Rule("memfd_create", errno.EMFILE), "could not make shared memory"),
        (
            seccomp.Rule("socket", errno.EACCES, arg=socket.AF_UNIX),
            "cannot listen for shared memory claims",
        ),
        (seccomp.Rule("fallocate", errno.ENOSPC), "could not reserve"),
    ],
    ids=["no-memfd", "no-unix-socket", "no-memory"],
)
def test_a_server_that_cannot_make_shared_memory_streams_every_epoch_whole(
    data_dir: pathlib.Path,
    tmp_path: pathlib.Path,
    rule: seccomp.Rule,
    said: str,
    over_the_socket: list[tuple[torch.Tensor, ...]],
) -> None:
    install = seccomp.python_prelude([rule]) + "import os, sys\nos.execv(sys.argv[1], sys.argv[1:])"
    log = tmp_path / "server.log"
    with serve_process(data_dir, log, launcher=(sys.executable, "-c", install)) as served:
        for _ in range(2):  # the warning is said once, not once a stream
            assert_same(epoch(served.address), over_the_socket)
        text = log.read_text()
        assert text.count(said) == 1, text  # one clear warning
        assert "INTERNAL" not in text and "rebuil" not in text
        assert eventually(lambda: nothing_held(served.process.pid))  # nothing leaked
