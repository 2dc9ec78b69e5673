"""Client credentials: TLS (optionally with a client certificate) and a bearer token."""

from __future__ import annotations

import dataclasses
import logging
import os
import pathlib

import grpc

from batchwire.client._exceptions import InvalidArgumentError

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
        raise InvalidArgumentError(
            grpc.StatusCode.INVALID_ARGUMENT, f"{name}: cannot read {path}: {exc.strerror}"
        ) from exc


@dataclasses.dataclass(frozen=True, kw_only=True)
class ChannelSecurity:
    """What a channel presents to a server. Without TLS material the channel is plaintext."""

    token: str | None = None
    tls_ca: bytes | None = None
    tls_cert: bytes | None = None
    tls_key: bytes | None = None

    @classmethod
    def from_options(
        cls,
        *,
        token: str | None = None,
        tls_ca: PemSource | None = None,
        tls_cert: PemSource | None = None,
        tls_key: PemSource | None = None,
    ) -> ChannelSecurity:
        """Read PEM files now, so a missing file is an error before any call."""
        if (tls_cert is None) != (tls_key is None):
            raise InvalidArgumentError(
                grpc.StatusCode.INVALID_ARGUMENT,
                "tls_cert and tls_key go together: give both for mutual TLS, or neither",
            )
        token = token if token is not None else os.environ.get("BATCHWIRE_TOKEN") or None
        if token is not None and (not token or any(c.isspace() for c in token)):
            raise InvalidArgumentError(
                grpc.StatusCode.INVALID_ARGUMENT, "token must be a non-empty string without spaces"
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
