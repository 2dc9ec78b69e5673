#!/bin/sh
# Fill a wheelhouse for an offline image build (deploy/Dockerfile's WHEELHOUSE): every wheel
# the image installs, for CPython PY_VERSION on x86_64 Linux (glibc 2.28 or newer), with
# torch's CPU or CUDA build and the build requirements of pyproject.toml's [build-system].
#
#   deploy/wheelhouse.sh PY_VERSION cpu|cu126 OUT_DIR       # e.g. 3.11 cpu wheelhouse
#
# Runs on any host with PyPI and Python 3.11 or newer (tomllib); OUT_DIR must lie inside
# the build context (the checkout). The server needs only the CPU build of torch. torch
# (the newest, or TORCH_VERSION) comes from TORCH_INDEX (default
# https://download.pytorch.org/whl/BUILD), the rest from pip's configured index (PyPI).
# Requirement markers (python_version) are those of the Python that runs pip: run this with
# the image's Python version (PYTHON=python3.12) where a dependency differs by version.
# Wheels already in OUT_DIR are kept.
set -eu

if [ $# -ne 3 ] || { [ "$2" != cpu ] && [ "${2#cu}" = "$2" ]; }; then
    echo "usage: $0 PY_VERSION cpu|cuXYZ OUT_DIR   (e.g. 3.11 cpu wheelhouse)" >&2
    exit 2
fi
py_version=$1
torch_build=$2
out=$3
python=${PYTHON:-python3}
torch_index=${TORCH_INDEX:-https://download.pytorch.org/whl/$torch_build}
root=$(cd "$(dirname "$0")/.." && pwd)

mkdir -p "$out"
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
requirements=$work/requirements.txt
# What the image's pip installs: the build requirements, and the [server] extra with the
# dependencies it extends (pyproject.toml is the one list).
"$python" - "$root/pyproject.toml" >"$requirements" <<'PY'
import sys
import tomllib

with open(sys.argv[1], "rb") as f:
    pyproject = tomllib.load(f)
project = pyproject["project"]
for requirement in (
    *pyproject["build-system"]["requires"],
    *project["dependencies"],
    *project["optional-dependencies"]["server"],
):
    print(requirement)
PY

# Wheels for glibc 2.28 or newer; pip does not widen a manylinux_2_NN platform by itself.
platforms=$(for minor in $(seq 28 -1 17); do
    printf -- '--platform manylinux_2_%s_x86_64 ' "$minor"
done)
download() {
    # shellcheck disable=SC2086  # $platforms is a list of words
    "$python" -m pip download --only-binary=:all: --python-version "$py_version" \
        --implementation cp $platforms --platform manylinux2014_x86_64 "$@"
}

# torch first, alone, so that its build can be checked: an index of pip's configuration
# may offer a newer torch of another build (TORCH_VERSION=2.13.0 pins the version).
cp_tag=cp$(echo "$py_version" | tr -d .)
download --no-deps --index-url "$torch_index" --dest "$work" \
    "torch${TORCH_VERSION:+==$TORCH_VERSION}"
torch_wheel=$(basename "$(ls "$work"/torch-*.whl)")
case $torch_wheel in
    torch-*+"$torch_build"-"$cp_tag"-*) mv "$work/$torch_wheel" "$out/" ;;
    *) echo "$0: got $torch_wheel, not torch's $torch_build build for $cp_tag" >&2; exit 1 ;;
esac
# Everything else, torch's own dependencies included, from the index, against that torch
# (pinned, so that no other build of it joins the wheelhouse).
torch_version=$(echo "$torch_wheel" | cut -d- -f2)
download --find-links "$out" --dest "$out" "torch==$torch_version" -r "$requirements"
