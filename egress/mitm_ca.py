"""The interception CA: EC P-256, created once, stored the way mitmproxy reads it.

Only hosts with a credential binding (or method/path rules) are ever
intercepted; sandboxes trust this CA's certificate, never its key.
"""
from __future__ import annotations

import datetime
import os
from pathlib import Path

from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import NameOID

BASENAME = "mitmproxy"  # mitmproxy's CertStore looks for <confdir>/mitmproxy-ca.pem


def ca_paths(confdir: str | Path) -> tuple[Path, Path]:
    d = Path(confdir)
    return d / f"{BASENAME}-ca.pem", d / f"{BASENAME}-ca-cert.pem"


def ensure_ca(confdir: str | Path, *, permitted_domains: list[str] | None = None,
              common_name: str = "cubegate interception CA") -> Path:
    """Create the CA if missing; return the path of its public certificate."""
    key_and_cert, cert_only = ca_paths(confdir)
    if key_and_cert.exists() and cert_only.exists():
        return cert_only
    Path(confdir).mkdir(parents=True, exist_ok=True, mode=0o700)
    key = ec.generate_private_key(ec.SECP256R1())
    name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, common_name),
                      x509.NameAttribute(NameOID.ORGANIZATION_NAME, "cubegate")])
    now = datetime.datetime.now(datetime.timezone.utc)
    builder = (
        x509.CertificateBuilder()
        .subject_name(name).issuer_name(name).public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - datetime.timedelta(days=1))
        .not_valid_after(now + datetime.timedelta(days=3650))
        .add_extension(x509.BasicConstraints(ca=True, path_length=0), critical=True)
        .add_extension(x509.KeyUsage(digital_signature=True, key_cert_sign=True, crl_sign=True,
                                     content_commitment=False, key_encipherment=False, data_encipherment=False,
                                     key_agreement=False, encipher_only=False, decipher_only=False), critical=True)
        .add_extension(x509.SubjectKeyIdentifier.from_public_key(key.public_key()), critical=False)
    )
    if permitted_domains:
        # Limits the damage if the key ever leaks: it can only vouch for these names.
        builder = builder.add_extension(
            x509.NameConstraints(permitted_subtrees=[x509.DNSName(d) for d in permitted_domains],
                                 excluded_subtrees=None), critical=True)
    cert = builder.sign(key, hashes.SHA256())
    pem_key = key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
                                serialization.NoEncryption())
    pem_cert = cert.public_bytes(serialization.Encoding.PEM)
    fd = os.open(key_and_cert, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "wb") as f:
        f.write(pem_key + pem_cert)
    cert_only.write_bytes(pem_cert)
    return cert_only
