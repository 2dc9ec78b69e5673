"""Client credentials: TLS (optionally with a client certificate) and a bearer token.

A token file (``batchwire.common.tokens``: one token per line, ``#`` comments)
gives its first token; the server accepts any token of its own file.
"""

from __future__ import annotations

import dataclasses
import logging
import os
import pathlib

import grpc

from batchwire.client._transport._exceptions import InvalidArgumentError
from batchwire.common.tokens import parse_tokens, valid_token

__all__ = ["ChannelSecurity", "PemSource"]

log = logging.getLogger(__name__)

# A PEM file's path, or its contents as bytes.
PemSource = str | os.PathLike[str] | bytes


def _read_pem(name: str, source: PemSource | None) -> bytes | None:
    if source is None or isinstance(source, bytes):
        return source
    path = pathlib.Path(source)
    try:
        return path.read_bytes()
    except OSError as exc:
        raise InvalidArgumentError(f"{name}: cannot read {path}: {exc.strerror}") from exc


def _first_token(path: pathlib.Path) -> str:
    try:
        tokens = parse_tokens(path.read_text(encoding="utf-8"))
    except OSError as exc:
        raise InvalidArgumentError(f"token_file: cannot read {path}: {exc.strerror}") from exc
    except (ValueError, UnicodeDecodeError) as exc:
        raise InvalidArgumentError(f"token_file {path}: {exc}") from exc
    if not tokens:
        raise InvalidArgumentError(f"token_file {path} holds no token")
    return tokens[0]


@dataclasses.dataclass(frozen=True, kw_only=True)
class ChannelSecurity:
    """What a channel presents to a server. Without TLS material the channel is plaintext."""

    # Secrets stay out of repr(), so logging or printing the object leaks nothing.
    token: str | None = dataclasses.field(default=None, repr=False)
    tls_ca: bytes | None = None
    tls_cert: bytes | None = None
    tls_key: bytes | None = dataclasses.field(default=None, repr=False)

    @classmethod
    def from_options(
        cls,
        *,
        token: str | None = None,
        token_file: str | os.PathLike[str] | None = None,
        tls_ca: PemSource | None = None,
        tls_cert: PemSource | None = None,
        tls_key: PemSource | None = None,
    ) -> ChannelSecurity:
        """Read PEM and token files now, so a missing file is an error before any call.

        The token is ``token``, else the first token of ``token_file``, else the
        ``BATCHWIRE_TOKEN`` environment variable, else none. Raises
        ``InvalidArgumentError`` for unreadable files and malformed tokens.
        """
        if (tls_cert is None) != (tls_key is None):
            raise InvalidArgumentError(
                "tls_cert and tls_key go together: give both for mutual TLS, or neither"
            )
        if token is None and token_file is not None:
            token = _first_token(pathlib.Path(token_file))
        token = token if token is not None else os.environ.get("BATCHWIRE_TOKEN") or None
        if token is not None and not valid_token(token):
            raise InvalidArgumentError(
                "token must be a non-empty string of printable ASCII without spaces"
            )
        return cls(
            token=token,
            tls_ca=_read_pem("tls_ca", tls_ca),
            tls_cert=_read_pem("tls_cert", tls_cert),
            tls_key=_read_pem("tls_key", tls_key),
        )

    @property
    def tls(self) -> bool:
        return self.tls_ca is not None or self.tls_cert is not None

    def metadata(self) -> tuple[tuple[str, str], ...]:
        """Call metadata: the bearer token, when there is one."""
        return (("authorization", f"Bearer {self.token}"),) if self.token else ()

    def channel_credentials(self) -> grpc.ChannelCredentials | None:
        if not self.tls:
            if self.token:
                log.warning("sending a bearer token without TLS: anyone on the path can read it")
            return None
        return grpc.ssl_channel_credentials(
            root_certificates=self.tls_ca,
            private_key=self.tls_key,
            certificate_chain=self.tls_cert,
        )
