"""Test PKI made with ``cryptography``: certificate authorities and the
certificates they sign, written as PEM files. P-256 keys keep it fast."""

from __future__ import annotations

import dataclasses
import datetime
import ipaddress
import pathlib
from collections.abc import Sequence

from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

__all__ = ["Authority", "Issued", "make_authority"]

_VALIDITY = datetime.timedelta(days=2)


def _name(common_name: str) -> x509.Name:
    return x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, common_name)])


def _write(path: pathlib.Path, data: bytes) -> pathlib.Path:
    path.write_bytes(data)
    return path


def _key_pem(key: ec.EllipticCurvePrivateKey) -> bytes:
    return key.private_bytes(
        serialization.Encoding.PEM,
        serialization.PrivateFormat.PKCS8,
        serialization.NoEncryption(),
    )


@dataclasses.dataclass(frozen=True)
class Issued:
    """A certificate and its key as PEM files."""

    cert: pathlib.Path
    key: pathlib.Path


@dataclasses.dataclass(frozen=True)
class Authority:
    """A self-signed CA; ``cert`` is its PEM certificate (what peers trust)."""

    name: str
    key: ec.EllipticCurvePrivateKey
    certificate: x509.Certificate
    cert: pathlib.Path
    directory: pathlib.Path

    def issue(self, name: str, *, hosts: Sequence[str] = (), client: bool = False) -> Issued:
        """A leaf certificate for ``name``: a server certificate whose SAN holds
        ``hosts`` (DNS names or IP addresses), or a client certificate."""
        key = ec.generate_private_key(ec.SECP256R1())
        now = datetime.datetime.now(datetime.UTC)
        usage = ExtendedKeyUsageOID.CLIENT_AUTH if client else ExtendedKeyUsageOID.SERVER_AUTH
        builder = (
            x509.CertificateBuilder()
            .subject_name(_name(name))
            .issuer_name(self.certificate.subject)
            .public_key(key.public_key())
            .serial_number(x509.random_serial_number())
            .not_valid_before(now - datetime.timedelta(minutes=5))
            .not_valid_after(now + _VALIDITY)
            .add_extension(x509.BasicConstraints(ca=False, path_length=None), critical=True)
            .add_extension(x509.ExtendedKeyUsage([usage]), critical=False)
        )
        if hosts:
            builder = builder.add_extension(
                x509.SubjectAlternativeName([_san(h) for h in hosts]), critical=False
            )
        certificate = builder.sign(self.key, hashes.SHA256())
        stem = self.directory / name
        return Issued(
            cert=_write(
                stem.with_suffix(".pem"), certificate.public_bytes(serialization.Encoding.PEM)
            ),
            key=_write(stem.with_suffix(".key"), _key_pem(key)),
        )


def _san(host: str) -> x509.GeneralName:
    try:
        return x509.IPAddress(ipaddress.ip_address(host))
    except ValueError:
        return x509.DNSName(host)


def make_authority(directory: pathlib.Path, name: str) -> Authority:
    """A new CA whose certificate is written to ``directory/name-ca.pem``."""
    key = ec.generate_private_key(ec.SECP256R1())
    now = datetime.datetime.now(datetime.UTC)
    certificate = (
        x509.CertificateBuilder()
        .subject_name(_name(name))
        .issuer_name(_name(name))
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - datetime.timedelta(minutes=5))
        .not_valid_after(now + _VALIDITY)
        .add_extension(x509.BasicConstraints(ca=True, path_length=0), critical=True)
        .add_extension(
            x509.KeyUsage(
                digital_signature=True,
                content_commitment=False,
                key_encipherment=False,
                data_encipherment=False,
                key_agreement=False,
                key_cert_sign=True,
                crl_sign=True,
                encipher_only=False,
                decipher_only=False,
            ),
            critical=True,
        )
        .sign(key, hashes.SHA256())
    )
    path = _write(
        directory / f"{name}-ca.pem", certificate.public_bytes(serialization.Encoding.PEM)
    )
    return Authority(name=name, key=key, certificate=certificate, cert=path, directory=directory)
