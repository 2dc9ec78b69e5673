"""TLS for the bulk connections, from the same PEM material as the gRPC channel's: the
server's certificate and key (and the CA of its clients, for mutual TLS), the client's CA
(and its own certificate, for mutual TLS).

Python's ``ssl`` loads a certificate and its key from a file only: they are written, for
the moment it takes, into a new directory only this process's user can enter, and
removed."""

from __future__ import annotations

import os
import pathlib
import ssl
import tempfile

__all__ = ["tls_context"]


def tls_context(
    *, server: bool, cert: bytes | None = None, key: bytes | None = None, ca: bytes | None = None
) -> ssl.SSLContext:
    """A server's context (``server``: presenting ``cert``, asking clients for a
    certificate signed by ``ca`` where given) or a client's (trusting ``ca``, else the
    system's CAs, checking the server's name, presenting ``cert`` where given)."""
    context = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER if server else ssl.PROTOCOL_TLS_CLIENT)
    if ca is not None:
        context.load_verify_locations(cadata=ca.decode("ascii"))
        context.verify_mode = ssl.CERT_REQUIRED
    elif not server:
        context.load_default_certs()
    if cert is not None and key is not None:
        with tempfile.TemporaryDirectory(prefix="batchwire-tls-") as directory:
            chain = pathlib.Path(directory) / "chain.pem"
            descriptor = os.open(chain, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
            with os.fdopen(descriptor, "wb") as out:
                out.write(key + b"\n" + cert)
            context.load_cert_chain(chain)
    return context
