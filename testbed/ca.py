"""A throw-away certificate authority for the lab's upstream servers.

``TestCA.create(dir)`` makes an EC P-256 root; ``issue(names, ips)`` makes a
server/client leaf signed by it. Private keys are written 0600. The root is
``bundle_path`` (give it to curl ``--cacert`` or an SSLContext).
"""

from __future__ import annotations

import datetime
import ipaddress
import os
import re
from collections.abc import Sequence
from pathlib import Path

from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

__all__ = ["TestCA"]

_VALIDITY = datetime.timedelta(days=30)
_BACKDATE = datetime.timedelta(hours=1)


def _write(path: Path, data: bytes, mode: int) -> None:
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, mode)
    with os.fdopen(fd, "wb") as f:
        f.write(data)
    os.chmod(path, mode)


def _key_pem(key: ec.EllipticCurvePrivateKey) -> bytes:
    return key.private_bytes(serialization.Encoding.PEM,
                             serialization.PrivateFormat.PKCS8,
                             serialization.NoEncryption())


class TestCA:
    """Root CA on disk: ``dir/ca.pem`` (certificate) and ``dir/ca.key`` (0600)."""

    __test__ = False  # not a pytest test class

    def __init__(self, directory: Path, cert: x509.Certificate, key: ec.EllipticCurvePrivateKey) -> None:
        self.dir = Path(directory)
        self.cert = cert
        self.key = key

    @property
    def bundle_path(self) -> Path:
        return self.dir / "ca.pem"

    @property
    def key_path(self) -> Path:
        return self.dir / "ca.key"

    @classmethod
    def create(cls, directory: str | os.PathLike, common_name: str = "cubegate test root CA") -> "TestCA":
        directory = Path(directory)
        directory.mkdir(parents=True, exist_ok=True)
        key = ec.generate_private_key(ec.SECP256R1())
        name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, common_name),
                          x509.NameAttribute(NameOID.ORGANIZATION_NAME, "cubegate testbed")])
        now = datetime.datetime.now(datetime.timezone.utc)
        ski = x509.SubjectKeyIdentifier.from_public_key(key.public_key())
        cert = (
            x509.CertificateBuilder()
            .subject_name(name).issuer_name(name)
            .public_key(key.public_key())
            .serial_number(x509.random_serial_number())
            .not_valid_before(now - _BACKDATE).not_valid_after(now + _VALIDITY)
            .add_extension(x509.BasicConstraints(ca=True, path_length=0), critical=True)
            .add_extension(x509.KeyUsage(digital_signature=True, key_cert_sign=True, crl_sign=True,
                                         content_commitment=False, key_encipherment=False,
                                         data_encipherment=False, key_agreement=False,
                                         encipher_only=False, decipher_only=False), critical=True)
            .add_extension(ski, critical=False)
            .sign(key, hashes.SHA256())
        )
        ca = cls(directory, cert, key)
        _write(ca.key_path, _key_pem(key), 0o600)
        _write(ca.bundle_path, cert.public_bytes(serialization.Encoding.PEM), 0o644)
        return ca

    @classmethod
    def load(cls, directory: str | os.PathLike) -> "TestCA":
        directory = Path(directory)
        cert = x509.load_pem_x509_certificate((directory / "ca.pem").read_bytes())
        key = serialization.load_pem_private_key((directory / "ca.key").read_bytes(), password=None)
        assert isinstance(key, ec.EllipticCurvePrivateKey)
        return cls(directory, cert, key)

    def issue(self, names: Sequence[str], ips: Sequence[str] = (), *, stem: str | None = None) -> tuple[Path, Path]:
        """Leaf certificate for ``names`` (DNS SANs, wildcards allowed) and ``ips``.

        Returns ``(cert_path, key_path)``; the files are named after ``stem``
        or the first name.
        """
        if not names and not ips:
            raise ValueError("a certificate needs at least one name or IP")
        key = ec.generate_private_key(ec.SECP256R1())
        first = names[0] if names else str(ips[0])
        sans: list[x509.GeneralName] = [x509.DNSName(n) for n in names]
        sans += [x509.IPAddress(ipaddress.ip_address(ip)) for ip in ips]
        now = datetime.datetime.now(datetime.timezone.utc)
        cert = (
            x509.CertificateBuilder()
            .subject_name(x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, first[:64])]))
            .issuer_name(self.cert.subject)
            .public_key(key.public_key())
            .serial_number(x509.random_serial_number())
            .not_valid_before(now - _BACKDATE).not_valid_after(now + _VALIDITY)
            .add_extension(x509.BasicConstraints(ca=False, path_length=None), critical=True)
            .add_extension(x509.KeyUsage(digital_signature=True, key_cert_sign=False, crl_sign=False,
                                         content_commitment=False, key_encipherment=False,
                                         data_encipherment=False, key_agreement=False,
                                         encipher_only=False, decipher_only=False), critical=True)
            .add_extension(x509.ExtendedKeyUsage([ExtendedKeyUsageOID.SERVER_AUTH,
                                                  ExtendedKeyUsageOID.CLIENT_AUTH]), critical=False)
            .add_extension(x509.SubjectAlternativeName(sans), critical=False)
            .add_extension(x509.SubjectKeyIdentifier.from_public_key(key.public_key()), critical=False)
            .add_extension(x509.AuthorityKeyIdentifier.from_issuer_public_key(self.key.public_key()),
                           critical=False)
            .sign(self.key, hashes.SHA256())
        )
        safe = re.sub(r"[^A-Za-z0-9._-]", "_", stem or first)
        cert_path = self.dir / f"{safe}.pem"
        key_path = self.dir / f"{safe}.key"
        _write(key_path, _key_pem(key), 0o600)
        _write(cert_path, cert.public_bytes(serialization.Encoding.PEM), 0o644)
        return cert_path, key_path
