"""The client credential flags shared by commands that talk to a server."""

from __future__ import annotations

import argparse
import pathlib
from typing import Any

__all__ = ["add_arguments", "loader_options", "security"]


def add_arguments(parser: argparse.ArgumentParser, *, tls_name: bool = False) -> None:
    """``--tls-ca``, ``--tls-cert``, ``--tls-key``, ``--token-file`` (and ``--tls-name``)."""
    group = parser.add_argument_group("security (for a server run with TLS or tokens)")
    group.add_argument(
        "--tls-ca", type=pathlib.Path, metavar="FILE", help="PEM CA that signed the server's cert"
    )
    group.add_argument(
        "--tls-cert", type=pathlib.Path, metavar="FILE", help="PEM client certificate (mutual TLS)"
    )
    group.add_argument("--tls-key", type=pathlib.Path, metavar="FILE", help="PEM key of --tls-cert")
    if tls_name:
        group.add_argument(
            "--tls-name",
            metavar="NAME",
            help="host name the server certificate must carry, when --address is an IP",
        )
    group.add_argument(
        "--token-file",
        type=pathlib.Path,
        metavar="FILE",
        help="send its first token as a bearer token (else BATCHWIRE_TOKEN, if set)",
    )


def loader_options(args: argparse.Namespace) -> dict[str, Any]:
    """The flags as ``RemoteLoader`` keywords (``token``, ``tls_ca``, ``tls_cert``, ``tls_key``)."""
    token = None
    if args.token_file is not None:
        from batchwire.client import ChannelSecurity

        token = ChannelSecurity.from_options(token_file=args.token_file).token
    return {
        "token": token,
        "tls_ca": args.tls_ca,
        "tls_cert": args.tls_cert,
        "tls_key": args.tls_key,
    }


def security(args: argparse.Namespace) -> Any:
    """The flags as the client's ``ChannelSecurity`` (files read now; BatchwireError if one
    cannot be)."""
    from batchwire.client import ChannelSecurity

    return ChannelSecurity.from_options(
        token_file=args.token_file, tls_ca=args.tls_ca, tls_cert=args.tls_cert, tls_key=args.tls_key
    )
