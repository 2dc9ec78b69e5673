"""The documentation: the site builds with ``mkdocs build --strict``, and its examples run.

Every ```` ```python ```` and ```` ```bash ```` block in README.md and docs/*.md is executed, in
page order, by Sybil's Markdown parsers, one test per block. Each page runs in a working
directory of its own that holds what its text assumes:

* ``my-images/``: a folder of images in class subfolders (generated JPEGs), and the
  checkout's ``examples/``;
* for docs/ pages, ``datasets/pets`` ingested from it (and ``boxes``, ``masked`` and
  ``captions``, of generated COCO files) and a real ``batchwire serve`` process serving ``datasets/`` (CPU
  DALI), which the pages call ``localhost:50051``; README's quick
  starts ingest and serve for themselves;
* for the security page, a CA, server and client certificates and a token file.

Ports: the pages use 50051, 50052, ...; each page's ports are mapped to free ones (50051 in
docs/ pages to the running server), so runs never collide with a real server or each other.
Servers an example starts in the background (``batchwire serve ... &``) are stopped when the
module ends.

Not executed, on purpose:

* ```` ```console ```` blocks: transcripts and commands for hosts this test does not have
  (Docker, a Kubernetes cluster, a GPU) or that run for minutes (the benchmarks whose
  measured figures the pages quote next to them). The deploy files they use are checked by
  tests/test_deploy.py and tests/test_compose_up.py.
* Blocks that only include a repository file (``--8<-- "examples/..."``): the file is shown
  as it is, and its own tests run it (tests/test_custom_pipeline.py, the deploy tests).
* Blocks after ``<!-- skip: next "why" -->``: pytest reports them as skipped with the why.
  README's two set-up commands are among them: they build the environment this test runs in,
  and test_setup_commands_match_ci holds the test command to .ci/run.
"""

from __future__ import annotations

import contextlib
import os
import pathlib
import re
import shutil
import signal
import socket
import subprocess
import sys
import unittest
from collections.abc import Callable, Iterator

import numpy as np
import pytest
from certs import make_authority
from conftest import start_server
from PIL import Image, ImageDraw
from processes import serve_process
from sybil import Example, Sybil
from sybil.parsers.markdown import CodeBlockParser, SkipParser

from batchwire.server.data import ingest, write_coco_boxes, write_photo_folders

ROOT = pathlib.Path(__file__).resolve().parent.parent
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").rglob("*.md"))]
PORT = re.compile(r"\b5005\d\b")
INCLUDE = re.compile(r'\A(\s*--8<--\s+"[^"]+"\s*)+\Z')

# Hang guards, not speed checks: a slow or loaded host takes minutes where a quiet one
# takes seconds (the demo generates and ingests 2,000 images).
pytestmark = [pytest.mark.docs, pytest.mark.timeout(600)]


def _where(example: Example) -> str:
    """``PAGE:LINE`` of a block, as its test id names it."""
    return f"{pathlib.Path(example.path).relative_to(ROOT)}:{example.line}"


def _free_port() -> str:
    with socket.socket() as s:
        s.bind(("localhost", 0))
        return str(s.getsockname()[1])


class Page:
    """What one page's examples share: a directory, a port map, background processes."""

    def __init__(
        self, path: pathlib.Path, workdir: pathlib.Path, ports: dict[str, str], cache: pathlib.Path
    ):
        self.path = path
        self.workdir = workdir
        self.ports = ports
        self.groups: list[int] = []
        self.env = {k: v for k, v in os.environ.items() if not k.startswith("BATCHWIRE_")}
        # batchwire demo's dataset, made by README's demo and kept for the pages' (as ~/.cache is)
        self.env["BATCHWIRE_CACHE"] = str(cache)
        self.env["PATH"] = f"{pathlib.Path(sys.executable).parent}{os.pathsep}{self.env['PATH']}"

    def text(self, example: Example) -> str:
        source = str(example.parsed)
        return PORT.sub(lambda m: self.ports.setdefault(m.group(), _free_port()), source)

    def run_python(self, example: Example) -> None:
        # Padding keeps tracebacks pointing at the page's own line numbers.
        code = "\n" * example.line + self.text(example)
        cwd = os.getcwd()
        os.chdir(self.workdir)
        try:
            exec(compile(code, str(self.path), "exec"), example.namespace)
        finally:
            os.chdir(cwd)

    def run_bash(self, example: Example) -> None:
        log = self.workdir / f"bash-{example.line}.log"
        with open(log, "w") as out:
            # A session of its own, so that servers started with `&` can be stopped later;
            # output to a file, so that they do not hold a pipe open.
            process = subprocess.Popen(
                ["bash", "-euo", "pipefail", "-c", self.text(example)],
                cwd=self.workdir,
                env=self.env,
                stdout=out,
                stderr=subprocess.STDOUT,
                stdin=subprocess.DEVNULL,
                start_new_session=True,
            )
        self.groups.append(process.pid)
        try:
            code = process.wait(timeout=400)
        except subprocess.TimeoutExpired:
            code = None
        if code != 0:
            raise AssertionError(
                f"{self.path.name}:{example.line}: bash exited {code}:\n{log.read_text()[-3000:]}"
            )

    def evaluate(self, example: Example) -> None:
        if INCLUDE.match(str(example.parsed)):
            pytest.skip(f"{_where(example)}: shows a repository file; its own tests run it")
        if example.region.lexemes.get("arguments") == "bash":
            self.run_bash(example)
        else:
            self.run_python(example)

    def stop(self) -> None:
        for group in self.groups:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(group, signal.SIGTERM)


OPEN: dict[str, Page] = {}  # document path -> its page, while the module runs


def _evaluate(example: Example) -> None:
    OPEN[example.path].evaluate(example)


SYBIL = Sybil(
    parsers=[
        CodeBlockParser("python", evaluator=_evaluate),
        CodeBlockParser("bash", evaluator=_evaluate),
        SkipParser(),
    ],
)
EXAMPLES = [(document, example) for document in map(SYBIL.parse, PAGES) for example in document]


@pytest.fixture(scope="module")
def images(tmp_path_factory: pytest.TempPathFactory) -> pathlib.Path:
    """``my-images/<class>/*.jpg``: 4 classes of 32 photos, a shape on a noisy background."""
    root = tmp_path_factory.mktemp("images") / "my-images"
    rng = np.random.default_rng(3)
    for label, name in enumerate(("circle", "square", "triangle", "cross")):
        (root / name).mkdir(parents=True)
        for i in range(32):
            pixels = rng.integers(0, 256, (96, 128, 3), dtype=np.uint8)
            image = Image.fromarray(pixels)
            ImageDraw.Draw(image).regular_polygon((64, 48, 30), 3 + label * 2, fill="white")
            image.save(root / name / f"{i:03d}.jpg", quality=90)
    return root


@pytest.fixture(scope="module")
def served(
    tmp_path_factory: pytest.TempPathFactory, images: pathlib.Path
) -> Iterator[tuple[pathlib.Path, str]]:
    """``datasets/pets``, ``datasets/boxes``, ``datasets/masked`` and ``datasets/captions``
    (COCO instances, with masks, and captions of ``write_coco_boxes``' pictures, as
    docs/datasets.md ingests them) and a
    `batchwire serve` process serving them: docs' localhost:50051."""
    root = tmp_path_factory.mktemp("served")
    coco = write_coco_boxes(root / "coco-demo", count=16)
    datasets, pictures = str(root / "datasets"), ["--images", str(coco.parent / "images")]
    commands = [
        ["ingest", str(images), datasets, "--name", "pets"],
        ["ingest", str(coco), datasets, "--name", "boxes", *pictures],
        ["ingest", str(coco), datasets, "--name", "masked", *pictures, "--masks"],
        ["ingest", str(coco.parent / "captions.json"), datasets, "--name", "captions", *pictures],
    ]
    for command in commands:
        subprocess.run(
            [sys.executable, "-m", "batchwire.cli", *command],
            check=True,
            capture_output=True,
            timeout=400,
        )
    with serve_process(root / "datasets", root / "serve.log") as process:
        yield root / "datasets", process.address


@pytest.fixture(scope="module")
def pages(
    tmp_path_factory: pytest.TempPathFactory, images: pathlib.Path, request: pytest.FixtureRequest
) -> Iterator[Callable[[str], Page]]:
    """Opens each page's working directory when its first example runs."""
    cache = tmp_path_factory.mktemp("cache")

    def open_page(name: str) -> Page:
        if name in OPEN:
            return OPEN[name]
        path = pathlib.Path(name)
        workdir = tmp_path_factory.mktemp(path.stem)
        shutil.copytree(images, workdir / "my-images")
        (workdir / "examples").symlink_to(ROOT / "examples")  # as in a checkout
        ports: dict[str, str] = {}
        if path != ROOT / "README.md":  # docs/: the running server and its dataset
            datasets, address = request.getfixturevalue("served")
            ports["50051"] = address.rsplit(":", 1)[1]
            (workdir / "datasets").symlink_to(datasets)
        if path.stem == "security":
            _credentials(workdir)
        OPEN[name] = Page(path, workdir, ports, cache)
        return OPEN[name]

    yield open_page
    for page in OPEN.values():
        page.stop()
    OPEN.clear()
    # What the pages' examples made (a batch a loader lent them, which keeps its server's
    # shared memory mapped here) goes with the module, not with the session.
    for document, _ in EXAMPLES:
        document.namespace.clear()


def _credentials(workdir: pathlib.Path) -> None:
    """What the security page's commands name: CA, server and trainer certificates, tokens."""
    (workdir / "pki").mkdir()
    servers = make_authority(workdir / "pki", "servers")
    issued = servers.issue("server", hosts=["localhost"])
    shutil.copy(servers.cert, workdir / "ca.pem")
    shutil.copy(issued.cert, workdir / "server.pem")
    shutil.copy(issued.key, workdir / "server.key")
    clients = make_authority(workdir / "pki", "clients")
    trainer = clients.issue("trainer", client=True)
    shutil.copy(clients.cert, workdir / "clients-ca.pem")
    shutil.copy(trainer.cert, workdir / "trainer.pem")
    shutil.copy(trainer.key, workdir / "trainer.key")
    (workdir / "tokens").write_text("# one token a line\ns3cret-token-for-docs\n")


@pytest.mark.slow
@pytest.mark.parametrize(
    "example",
    [example for _, example in EXAMPLES],
    ids=[_where(e) for _, e in EXAMPLES],
)
def test_example(example: Example, pages: Callable[[str], Page]) -> None:
    pages(example.path)
    try:
        example.evaluate()
    except unittest.SkipTest as skipped:
        # pytest reports a skip at the line that raised it, here; the page's own line is
        # what a reader of `pytest -rs` needs.
        pytest.skip(f"{_where(example)}: {skipped}")


@pytest.mark.slow
@pytest.mark.parametrize("classes", [3, 7])
def test_readmes_training_snippet_trains_one_output_per_class(
    tmp_path: pathlib.Path, monkeypatch: pytest.MonkeyPatch, classes: int
) -> None:
    """Quick start 2's training loop, run on datasets of other class counts than the pages'
    own: its head has one output per class, so cross_entropy never sees a label past it."""
    blocks = re.findall(r"```python\n(.*?)```", (ROOT / "README.md").read_text(), re.S)
    (snippet,) = [block for block in blocks if "cross_entropy" in block]
    write_photo_folders(tmp_path / "images", count=16 * classes, classes=classes, size=(64, 48))
    ingest(tmp_path / "images", tmp_path / "datasets", name="pets")
    server = start_server(tmp_path / "datasets")
    try:
        monkeypatch.chdir(tmp_path)
        code = compile(snippet.replace("localhost:50051", server.target), "README.md", "exec")
        exec(code, {"__name__": "__readme__"})
    finally:
        server.stop(grace=1.0)
    import torch

    head = torch.load(tmp_path / "ckpt.pt")["model"]["3.weight"]
    assert tuple(head.shape) == (classes, 8)


def test_what_readme_makes_in_a_checkout_is_ignored_by_git() -> None:
    """Quick start 2 run in the checkout leaves nothing for `git status` to list."""
    if not (ROOT / ".git").exists() or shutil.which("git") is None:
        pytest.skip("not a git checkout")
    made = ["my-images/cat/001.jpg", "datasets/pets/manifest.json", "ckpt.pt"]
    done = subprocess.run(
        ["git", "check-ignore", "--no-index", *made], cwd=ROOT, capture_output=True, text=True
    )
    assert done.stdout.split() == made, done.stderr


def test_setup_commands_match_ci() -> None:
    """README's test command installs what .ci/run installs, then runs pytest."""
    readme = (ROOT / "README.md").read_text()
    ci = (ROOT / ".ci" / "run").read_text()
    install = re.search(r"^pip install (.+)$", ci, re.MULTILINE)
    assert install, "no pip install line in .ci/run"
    command = (
        f"python3 -m venv .venv && . .venv/bin/activate && pip install {install.group(1)} && pytest"
    )
    assert command in readme


@pytest.mark.slow
def test_site_builds(tmp_path: pathlib.Path) -> None:
    """`mkdocs build --strict`: every page in the nav, every link and reference resolves."""
    result = subprocess.run(
        [sys.executable, "-m", "mkdocs", "build", "--strict", "--site-dir", str(tmp_path / "site")],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=400,
    )
    assert result.returncode == 0, result.stderr[-4000:]
    assert (tmp_path / "site" / "reference" / "client" / "index.html").is_file()
