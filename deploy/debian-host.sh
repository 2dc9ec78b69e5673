#!/bin/sh
# A Debian 12 (bookworm) host made ready to build and run the image from Debian's packages
# alone (no image registry, no Docker repository). Run as root:
#
#   deploy/debian-host.sh install-docker            # Engine + Compose v2 + debootstrap
#   deploy/debian-host.sh base-image TAG [TARBALL]  # a local Debian image to build FROM
#
# install-docker: docker.io (Engine 20.10) and debootstrap from the host's suite, and
# Compose v2 from trixie's docker-compose package (bookworm has only Compose v1; its one
# dependency, libc6 >= 2.34, is met by bookworm). trixie is read, for this one download,
# from the mirror the host's apt sources name; their sources, lists and pinning are left as
# they are. What is installed already is kept.
#
# base-image: `debootstrap --variant=minbase` of bookworm with python3, python3-venv and
# ca-certificates, from that same mirror, imported as TAG (e.g. batchwire-base:bookworm).
# With TARBALL, the root filesystem is kept there and imported from it next time.
set -eu

usage() {
    echo "usage: $0 install-docker | base-image TAG [TARBALL]" >&2
    exit 2
}

# The first Debian mirror the host's apt sources name (deb822 URIs: or one-line deb).
debian_mirror() {
    mirror=$(cat /etc/apt/sources.list.d/*.sources 2>/dev/null \
        | awk '$1 == "URIs:" && $2 ~ /\/debian\/?$/ { print $2; exit }')
    [ -n "$mirror" ] || mirror=$(cat /etc/apt/sources.list /etc/apt/sources.list.d/*.list \
        2>/dev/null | awk '$1 == "deb" && $0 ~ /\/debian\/? / {
            for (i = 2; i <= NF; i++) if ($i ~ /^[a-z]+:\/\//) { print $i; exit } }')
    if [ -z "$mirror" ]; then
        echo "$0: no Debian mirror in /etc/apt/sources.list*" >&2
        exit 1
    fi
    echo "$mirror"
}

install_docker() {
    export DEBIAN_FRONTEND=noninteractive
    missing=
    command -v dockerd >/dev/null || missing="$missing docker.io"
    command -v debootstrap >/dev/null || missing="$missing debootstrap"
    if [ -n "$missing" ]; then
        echo "installing$missing"
        apt-get update -q
        # shellcheck disable=SC2086  # a list of package names
        apt-get install -y -q --no-install-recommends $missing
    fi
    if docker compose version >/dev/null 2>&1; then
        docker compose version
        return
    fi
    mirror=$(debian_mirror)
    work=$(mktemp -d)
    trap 'rm -rf "$work"' EXIT
    mkdir -p "$work/lists/partial"
    echo "deb [signed-by=/usr/share/keyrings/debian-archive-keyring.gpg] $mirror trixie main" \
        >"$work/sources.list"
    trixie="-o Dir::Etc::SourceList=$work/sources.list -o Dir::Etc::SourceParts=/nonexistent
        -o Dir::State::Lists=$work/lists -o APT::Sandbox::User=root"
    echo "Compose v2: docker-compose from trixie ($mirror)"
    # shellcheck disable=SC2086  # $trixie is a list of options
    apt-get $trixie update -q
    # shellcheck disable=SC2086
    (cd "$work" && apt-get $trixie download docker-compose)
    dpkg -i "$work"/docker-compose_*.deb
    docker compose version
}

base_image() {
    tag=$1
    tarball=${2:-}
    if [ -z "$tarball" ] || [ ! -s "$tarball" ]; then
        mirror=$(debian_mirror)
        rootfs=$(mktemp -d)
        trap 'rm -rf "$rootfs"' EXIT
        echo "debootstrap bookworm from $mirror (a few minutes)"
        debootstrap --variant=minbase --include=python3,python3-venv,ca-certificates \
            bookworm "$rootfs" "$mirror" >"$rootfs.log" 2>&1 \
            || { tail -20 "$rootfs.log" >&2; exit 1; }
        rm -f "$rootfs.log"
        rm -rf "$rootfs"/var/cache/apt/archives/*.deb "$rootfs"/var/lib/apt/lists/*
        if [ -n "$tarball" ]; then
            tar -C "$rootfs" -cf "$tarball.part" . && mv "$tarball.part" "$tarball"
        else
            tarball=$rootfs.tar
            tar -C "$rootfs" -cf "$tarball" .
            trap 'rm -rf "$rootfs" "$rootfs.tar"' EXIT
        fi
    fi
    docker import "$tarball" "$tag"
}

if [ "$(id -u)" -ne 0 ]; then
    echo "$0: run as root (apt-get, dpkg, debootstrap)" >&2
    exit 1
fi
case ${1:-} in
    install-docker) [ $# -eq 1 ] || usage; install_docker ;;
    base-image) [ $# -eq 2 ] || [ $# -eq 3 ] || usage; base_image "$2" "${3:-}" ;;
    *) usage ;;
esac
