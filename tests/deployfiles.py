"""Reading ``deploy/`` as Docker, Compose and Kubernetes would, for tests that hold it to the code.

No Docker engine runs in CI, so the files are parsed here: the Dockerfile's final
stage, compose files merged like ``docker compose -f a.yaml -f b.yaml`` (mappings
merge, ``!reset`` removes, anything else is replaced) with ``${VAR:-default}``
interpolated from the defaults, and the Kubernetes manifests.
"""

from __future__ import annotations

import dataclasses
import json
import pathlib
import re
import shlex
from collections.abc import Mapping
from typing import Any

import yaml

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
        logical: list[str] = []
        pending = ""
        for line in path.read_text().splitlines():
            if not pending and (not line.strip() or line.lstrip().startswith("#")):
                continue
            if line.lstrip().startswith("#"):
                continue  # a comment inside a continued instruction
            if line.rstrip().endswith("\\"):
                pending += line.rstrip()[:-1] + " "
                continue
            logical.append(pending + line)
            pending = ""
        pairs = [
            (word.upper(), rest.strip()) for word, _, rest in (s.partition(" ") for s in logical)
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


class Reset:
    """Compose's ``!reset``: remove the value a previous file set."""


class _ComposeLoader(yaml.SafeLoader):
    pass


_ComposeLoader.add_constructor("!reset", lambda loader, node: Reset())
_ComposeLoader.add_constructor(
    "!override",
    lambda loader, node: (
        loader.construct_mapping(node, deep=True)
        if isinstance(node, yaml.MappingNode)
        else loader.construct_sequence(node, deep=True)
    ),
)


def load_yaml(path: pathlib.Path) -> Any:
    return yaml.load(path.read_text(), Loader=_ComposeLoader)  # a SafeLoader subclass


def merge(base: Any, override: Any) -> Any:
    """Compose's merge of ``-f`` files, as far as deploy/ uses it."""
    if isinstance(base, Mapping) and isinstance(override, Mapping):
        merged = dict(base)
        for key, value in override.items():
            if isinstance(value, Reset):
                merged.pop(key, None)
            else:
                merged[key] = merge(base.get(key), value)
        return merged
    return override


_VARIABLE = re.compile(r"\$\{(\w+)(?::?-([^}]*))?\}")


def interpolate(value: Any, environ: Mapping[str, str] | None = None) -> Any:
    """Replace ``${VAR}`` and ``${VAR:-default}`` (from ``environ``, else the default)."""
    environ = environ or {}
    if isinstance(value, str):
        return _VARIABLE.sub(lambda m: environ.get(m.group(1), m.group(2) or ""), value)
    if isinstance(value, list):
        return [interpolate(v, environ) for v in value]
    if isinstance(value, dict):
        return {k: interpolate(v, environ) for k, v in value.items()}
    return value


def compose(*names: str, environ: Mapping[str, str] | None = None) -> dict[str, Any]:
    """``docker compose -f deploy/NAME ...`` as one merged, interpolated document."""
    merged: dict[str, Any] = {}
    for name in names:
        merged = merge(merged, load_yaml(DEPLOY / name))
    return interpolate(merged, environ)


def service_environment(service: Mapping[str, Any]) -> dict[str, str]:
    environment = service.get("environment") or {}
    if isinstance(environment, list):
        environment = dict(item.split("=", 1) for item in environment)
    return {k: str(v) for k, v in environment.items()}


def duration_seconds(text: str) -> float:
    """Compose durations: ``40s``, ``1m30s``."""
    units = {"h": 3600, "m": 60, "s": 1, "ms": 0.001}
    parts = re.findall(r"(\d+(?:\.\d+)?)(ms|h|m|s)", text)
    assert parts and "".join(n + u for n, u in parts) == text, f"not a duration: {text!r}"
    return sum(float(n) * units[u] for n, u in parts)


# -- Kubernetes ------------------------------------------------------------------------


def k8s_documents() -> list[dict[str, Any]]:
    """Every object in deploy/k8s/ (kustomization.yaml excluded)."""
    documents = []
    for path in sorted(K8S.glob("*.yaml")):
        if path.name == "kustomization.yaml":
            continue
        documents.extend(d for d in yaml.safe_load_all(path.read_text()) if d)
    return documents


def k8s_object(kind: str) -> dict[str, Any]:
    (found,) = [d for d in k8s_documents() if d["kind"] == kind]
    return found
