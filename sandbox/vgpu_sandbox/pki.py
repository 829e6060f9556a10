"""Certificates for the sandbox: one CA, serving certificates signed by it, the service-account key.

Everything is made locally with ``cryptography``; nothing is downloaded. Keys are written with
mode 0600 and the folder is private to the user.
"""

from __future__ import annotations

import datetime as dt
import ipaddress
from dataclasses import dataclass
from pathlib import Path

from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec, rsa
from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

_VALIDITY = dt.timedelta(days=365)


@dataclass(frozen=True)
class CertPair:
    cert: Path
    key: Path


def _write_private(path: Path, data: bytes) -> None:
    path.parent.mkdir(parents=True, exist_ok=True, mode=0o700)
    path.touch(mode=0o600, exist_ok=True)
    path.chmod(0o600)
    path.write_bytes(data)


def _key_pem(key: ec.EllipticCurvePrivateKey | rsa.RSAPrivateKey) -> bytes:
    return key.private_bytes(
        serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption()
    )


class CertificateAuthority:
    """A CA whose key stays in ``folder``; it signs the sandbox's serving certificates."""

    def __init__(self, folder: Path, name: str = "vgpu-sandbox-ca") -> None:
        self.folder = folder
        self.cert_path = folder / "ca.crt"
        self.key_path = folder / "ca.key"
        now = dt.datetime.now(dt.UTC)
        self._key = ec.generate_private_key(ec.SECP256R1())
        subject = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, name)])
        self._cert = (
            x509.CertificateBuilder()
            .subject_name(subject)
            .issuer_name(subject)
            .public_key(self._key.public_key())
            .serial_number(x509.random_serial_number())
            .not_valid_before(now - dt.timedelta(minutes=5))
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
            .sign(self._key, hashes.SHA256())
        )
        folder.mkdir(parents=True, exist_ok=True, mode=0o700)
        self.cert_path.write_bytes(self._cert.public_bytes(serialization.Encoding.PEM))
        _write_private(self.key_path, _key_pem(self._key))

    @property
    def pem(self) -> bytes:
        return self._cert.public_bytes(serialization.Encoding.PEM)

    def issue(self, name: str, hosts: list[str], client: bool = False) -> CertPair:
        """A serving certificate for ``hosts`` (IP addresses or DNS names), written as name.crt/.key;
        with ``client``, a client certificate for the identity ``name`` instead."""
        key = ec.generate_private_key(ec.SECP256R1())
        now = dt.datetime.now(dt.UTC)
        sans: list[x509.GeneralName] = []
        for host in hosts:
            try:
                sans.append(x509.IPAddress(ipaddress.ip_address(host)))
            except ValueError:
                sans.append(x509.DNSName(host))
        usage = ExtendedKeyUsageOID.CLIENT_AUTH if client else ExtendedKeyUsageOID.SERVER_AUTH
        builder = (
            x509.CertificateBuilder()
            .subject_name(x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, name)]))
            .issuer_name(self._cert.subject)
            .public_key(key.public_key())
            .serial_number(x509.random_serial_number())
            .not_valid_before(now - dt.timedelta(minutes=5))
            .not_valid_after(now + _VALIDITY)
            .add_extension(x509.BasicConstraints(ca=False, path_length=None), critical=True)
            .add_extension(x509.ExtendedKeyUsage([usage]), critical=False)
        )
        if sans:
            builder = builder.add_extension(x509.SubjectAlternativeName(sans), critical=False)
        cert = builder.sign(self._key, hashes.SHA256())
        pair = CertPair(self.folder / f"{name}.crt", self.folder / f"{name}.key")
        pair.cert.write_bytes(cert.public_bytes(serialization.Encoding.PEM))
        _write_private(pair.key, _key_pem(key))
        return pair


def service_account_key(path: Path) -> Path:
    """The RSA key kube-apiserver signs service-account tokens with (and verifies them by)."""
    key = rsa.generate_private_key(public_exponent=65537, key_size=2048)
    _write_private(path, _key_pem(key))
    return path
