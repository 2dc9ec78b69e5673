"""The server's security: TLS, mutual TLS and bearer tokens, all in the gRPC layer.

``ServerSecurity.from_config`` reads and checks the files a ``ServerConfig`` names
(``ConfigError`` naming the flag and the path when one is missing, unreadable or
malformed); ``server_credentials()`` gives the TLS credentials for
``add_secure_port`` (``None``: plaintext) and ``interceptors()`` the token check.

``TokenInterceptor`` accepts a call only when its metadata carries
``authorization: Bearer <token>`` with one of the configured tokens; anything
else ends with UNAUTHENTICATED before the real handler runs. Methods under an
open prefix (the health service with ``health_open``) pass without a token.
"""

from __future__ import annotations

import dataclasses
import hashlib
import hmac
import logging
import pathlib
import ssl
from collections.abc import Awaitable, Callable, Iterable, Sequence
from typing import Any

import grpc
from grpc_health.v1 import health

from batchwire.common.tokens import parse_tokens
from batchwire.server.config import ConfigError, ServerConfig

__all__ = ["ServerSecurity", "TokenInterceptor", "read_token_file"]

log = logging.getLogger(__name__)

_HEALTH_PREFIX = f"/{health.SERVICE_NAME}/"
_SCHEME = "bearer"  # RFC 7235: auth schemes are case-insensitive


def _flag(name: str) -> str:
    return f"{name} (--{name.replace('_', '-')})"


def _read(name: str, path: pathlib.Path) -> bytes:
    try:
        data = path.read_bytes()
    except OSError as exc:
        raise ConfigError(f"{_flag(name)}: cannot read {path}: {exc.strerror}") from exc
    if not data.strip():
        raise ConfigError(f"{_flag(name)}: {path} is empty")
    return data


def read_token_file(path: pathlib.Path) -> tuple[str, ...]:
    """The tokens in ``path`` (one per line; blank lines and ``#`` comments ignored).

    Raises ``ConfigError`` when the file cannot be read, a line is not a token,
    or there is no token at all.
    """
    try:
        text = path.read_text(encoding="utf-8")
    except OSError as exc:
        raise ConfigError(f"{_flag('token_file')}: cannot read {path}: {exc.strerror}") from exc
    except UnicodeDecodeError as exc:
        raise ConfigError(f"{_flag('token_file')}: {path} is not UTF-8 text") from exc
    try:
        tokens = parse_tokens(text)
    except ValueError as exc:
        raise ConfigError(f"{_flag('token_file')}: {path}: {exc}") from exc
    if not tokens:
        raise ConfigError(
            f"{_flag('token_file')}: {path} holds no token (one per line; # starts a comment)"
        )
    return tuple(tokens)


def _check_key_pair(cert: pathlib.Path, key: pathlib.Path) -> None:
    """Catch malformed PEM, a key that does not match the certificate and an
    encrypted key (gRPC cannot use one) now, instead of at the first handshake."""
    asked_for_password = False

    def password() -> bytes:
        nonlocal asked_for_password
        asked_for_password = True
        return b""

    context = _permissive_context()
    try:
        context.load_cert_chain(cert, key, password=password)
    except ssl.SSLError as exc:
        if asked_for_password:
            reason = "the key is encrypted; gRPC needs an unencrypted PEM key"
        else:
            reason = f"not a PEM certificate and its matching private key ({exc.reason or exc})"
        raise ConfigError(
            f"{_flag('tls_cert')} {cert} with {_flag('tls_key')} {key}: {reason}"
        ) from exc


def _permissive_context() -> ssl.SSLContext:
    # These checks only parse files: OpenSSL's security level must not reject
    # keys that gRPC (BoringSSL, its own policy) would accept.
    context = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    context.set_ciphers("DEFAULT:@SECLEVEL=0")
    return context


def _check_ca(path: pathlib.Path) -> None:
    context = _permissive_context()
    try:
        context.load_verify_locations(cafile=path)
    except ssl.SSLError as exc:
        raise ConfigError(
            f"{_flag('tls_client_ca')}: {path} holds no PEM CA certificate ({exc.reason or exc})"
        ) from exc


@dataclasses.dataclass(frozen=True, kw_only=True, repr=False)
class ServerSecurity:
    """TLS material (PEM bytes) and accepted tokens. No TLS material: plaintext;
    no tokens: every call is accepted. ``repr`` shows only ``describe()``, never
    a key or a token."""

    tls_cert: bytes | None = None
    tls_key: bytes | None = None
    tls_client_ca: bytes | None = None
    tokens: tuple[str, ...] = ()
    health_open: bool = False

    def __repr__(self) -> str:
        return f"ServerSecurity({self.describe()})"

    @classmethod
    def from_config(cls, config: ServerConfig) -> ServerSecurity:
        """Read and check every file ``config`` names; raises ``ConfigError``."""
        cert = key = client_ca = None
        if config.tls_cert is not None and config.tls_key is not None:
            cert = _read("tls_cert", config.tls_cert)
            key = _read("tls_key", config.tls_key)
            _check_key_pair(config.tls_cert, config.tls_key)
        if config.tls_client_ca is not None:
            client_ca = _read("tls_client_ca", config.tls_client_ca)
            _check_ca(config.tls_client_ca)
        tokens = read_token_file(config.token_file) if config.token_file is not None else ()
        security = cls(
            tls_cert=cert,
            tls_key=key,
            tls_client_ca=client_ca,
            tokens=tokens,
            health_open=config.health_open,
        )
        # Fails on PEM that the ssl module accepts but gRPC's BoringSSL does not.
        security.server_credentials()
        return security

    @property
    def tls(self) -> bool:
        return self.tls_cert is not None

    @property
    def mutual_tls(self) -> bool:
        return self.tls_client_ca is not None

    def describe(self) -> str:
        """A one-line summary for the log, e.g. "mutual TLS, 2 tokens, health open"."""
        parts = ["mutual TLS" if self.mutual_tls else "TLS" if self.tls else "plaintext"]
        if self.tokens:
            parts.append(f"{len(self.tokens)} token{'s' if len(self.tokens) > 1 else ''}")
            if self.health_open:
                parts.append("health open")
        else:
            parts.append("no tokens")
        return ", ".join(parts)

    def server_credentials(self) -> grpc.ServerCredentials | None:
        """Credentials for ``add_secure_port``; ``None`` without TLS. With a client
        CA, clients must present a certificate signed by it."""
        if self.tls_cert is None or self.tls_key is None:
            return None
        try:
            return grpc.ssl_server_credentials(
                [(self.tls_key, self.tls_cert)],
                root_certificates=self.tls_client_ca,
                require_client_auth=self.tls_client_ca is not None,
            )
        except (RuntimeError, ValueError, TypeError) as exc:
            raise ConfigError(f"gRPC rejects the TLS certificate or key: {exc}") from exc

    def interceptors(self) -> tuple[grpc.aio.ServerInterceptor, ...]:
        """The token check, when tokens are configured."""
        if not self.tokens:
            return ()
        open_prefixes = (_HEALTH_PREFIX,) if self.health_open else ()
        return (TokenInterceptor(self.tokens, open_prefixes=open_prefixes),)


def _digest(token: str | bytes) -> bytes:
    # Comparing fixed-length digests keeps a token's length out of the timing too.
    return hashlib.sha256(token.encode() if isinstance(token, str) else token).digest()


class TokenInterceptor(grpc.aio.ServerInterceptor):
    """Ends every call without a valid ``authorization: Bearer <token>`` with
    UNAUTHENTICATED, except methods starting with one of ``open_prefixes``
    (full method names, e.g. ``"/grpc.health.v1.Health/"``)."""

    def __init__(self, tokens: Iterable[str], *, open_prefixes: Sequence[str] = ()) -> None:
        self._digests = tuple(_digest(t) for t in tokens)
        if not self._digests:
            raise ValueError("TokenInterceptor needs at least one token")
        self._open_prefixes = tuple(open_prefixes)

    def refusal(self, metadata: Iterable[tuple[str, str | bytes]] | None) -> str | None:
        """Why a call with ``metadata`` is refused, or ``None`` when its token is valid."""
        values = [v for k, v in metadata or () if k == "authorization"]
        if not values:
            return (
                "missing bearer token: send metadata 'authorization: Bearer <token>' "
                "(RemoteLoader(token=...) or BATCHWIRE_TOKEN)"
            )
        value = values[0]
        text = value.decode("latin-1") if isinstance(value, bytes) else value
        scheme, _, token = text.strip().partition(" ")
        if scheme.lower() != _SCHEME or not token.strip():
            return "malformed authorization metadata: send 'authorization: Bearer <token>'"
        presented = _digest(token.strip().encode("latin-1", "replace"))
        # Compare against every token without stopping early: the time taken
        # says nothing about which token, or how much of one, matched.
        matched = False
        for digest in self._digests:
            matched |= hmac.compare_digest(presented, digest)
        if not matched:
            return (
                "invalid bearer token: send 'authorization: Bearer <token>' with a token "
                "from the server's token file"
            )
        return None

    async def intercept_service(
        self,
        continuation: Callable[[grpc.HandlerCallDetails], Awaitable[grpc.RpcMethodHandler]],
        handler_call_details: grpc.HandlerCallDetails,
    ) -> grpc.RpcMethodHandler:
        method: str = handler_call_details.method
        if method.startswith(self._open_prefixes):
            return await continuation(handler_call_details)
        reason = self.refusal(handler_call_details.invocation_metadata)
        if reason is None:
            return await continuation(handler_call_details)
        handler = await continuation(handler_call_details)
        return _refusing_handler(handler, method, reason)


def _refusing_handler(
    handler: grpc.RpcMethodHandler | None, method: str, reason: str
) -> grpc.RpcMethodHandler:
    """A handler of the same shape as ``handler`` that ends the call with
    UNAUTHENTICATED. Requests are left undeserialized: nothing from an
    unauthenticated peer is parsed. An unknown method is refused the same way,
    so callers without a token cannot probe which methods exist."""

    async def refuse(request: Any, context: grpc.aio.ServicerContext) -> None:
        log.warning("refused %s from %s: %s", method, context.peer(), reason.split(":")[0])
        await context.abort(grpc.StatusCode.UNAUTHENTICATED, reason)

    request_streaming = handler is not None and handler.request_streaming
    response_streaming = handler is not None and handler.response_streaming
    if request_streaming and response_streaming:
        return grpc.stream_stream_rpc_method_handler(refuse)
    if request_streaming:
        return grpc.stream_unary_rpc_method_handler(refuse)
    if response_streaming:
        return grpc.unary_stream_rpc_method_handler(refuse)
    return grpc.unary_unary_rpc_method_handler(refuse)
