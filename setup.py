"""Build hook: generate the batchwire.v1 protobuf and gRPC modules from proto/.

``proto/batchwire/v1/*.proto`` mirror the package: protoc writes the generated
``*_pb2*.py`` and ``*.pyi`` files into ``src/batchwire/v1/`` (git ignores them),
so regular and editable installs both import them as ``batchwire.v1``. A built
package also carries the ``.proto`` sources beside them.
"""

from __future__ import annotations

import pathlib

from setuptools import setup
from setuptools.command.build_py import build_py

ROOT = pathlib.Path(__file__).resolve().parent
PROTO_ROOT = ROOT / "proto"
SOURCE_ROOT = ROOT / "src"


def proto_sources() -> list[pathlib.Path]:
    return sorted((PROTO_ROOT / "batchwire" / "v1").glob("*.proto"))


def generate_protos() -> None:
    import grpc_tools
    from grpc_tools import protoc

    include = pathlib.Path(grpc_tools.__file__).parent / "_proto"
    for source in proto_sources():
        args = [
            "grpc_tools.protoc",
            f"-I{PROTO_ROOT}",
            f"-I{include}",
            f"--python_out={SOURCE_ROOT}",
            f"--pyi_out={SOURCE_ROOT}",
            f"--grpc_python_out={SOURCE_ROOT}",
            str(source.relative_to(PROTO_ROOT)),
        ]
        if protoc.main(args) != 0:
            raise RuntimeError(f"protoc failed on {source}")


class BuildPyWithProtos(build_py):
    def run(self) -> None:
        generate_protos()
        super().run()
        # The .proto sources go beside the generated modules in a built package (a checkout
        # has them in proto/), when batchwire.v1 is built at all: the Dockerfile's stand-in
        # package has no batchwire.v1.
        if not self.editable_mode and "batchwire.v1" in (self.packages or []):
            target = pathlib.Path(self.build_lib, "batchwire", "v1")
            for source in proto_sources():
                self.copy_file(str(source), str(target / source.name))


setup(cmdclass={"build_py": BuildPyWithProtos})
