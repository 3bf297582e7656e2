import ssl
import stat
import subprocess
import threading
import socket

from cryptography import x509

from testbed.ca import TestCA


def test_ca_files_and_permissions(tmp_path):
    ca = TestCA.create(tmp_path / "ca")
    cert, key = ca.issue(["api.allowed.test", "*.github.test"], ["198.18.0.10"])
    for path in (ca.key_path, key):
        assert stat.S_IMODE(path.stat().st_mode) == 0o600
    leaf = x509.load_pem_x509_certificate(cert.read_bytes())
    san = leaf.extensions.get_extension_for_class(x509.SubjectAlternativeName).value
    assert san.get_values_for_type(x509.DNSName) == ["api.allowed.test", "*.github.test"]
    assert [str(i) for i in san.get_values_for_type(x509.IPAddress)] == ["198.18.0.10"]
    assert leaf.issuer == ca.cert.subject
    assert TestCA.load(ca.dir).cert == ca.cert


def _handshake(server_ctx, client_ctx, server_hostname):
    a, b = socket.socketpair()
    errors = []

    def serve():
        try:
            with server_ctx.wrap_socket(a, server_side=True) as s:
                s.recv(1)
        except (ssl.SSLError, OSError) as e:
            errors.append(e)

    t = threading.Thread(target=serve)
    t.start()
    try:
        with client_ctx.wrap_socket(b, server_hostname=server_hostname) as c:
            c.sendall(b"x")
    finally:
        t.join(5)
    return errors


def test_leaf_verifies_strictly_against_the_bundle(tmp_path):
    ca = TestCA.create(tmp_path)
    cert, key = ca.issue(["api.allowed.test"])
    server = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    server.load_cert_chain(cert, key)
    client = ssl.create_default_context(cafile=str(ca.bundle_path))
    client.verify_flags |= ssl.VERIFY_X509_STRICT
    assert _handshake(server, client, "api.allowed.test") == []


def test_wrong_name_and_foreign_ca_fail(tmp_path):
    ca = TestCA.create(tmp_path / "a")
    other = TestCA.create(tmp_path / "b")
    cert, key = ca.issue(["api.allowed.test"])
    server = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    server.load_cert_chain(cert, key)
    for bundle, name in ((ca.bundle_path, "denied.test"), (other.bundle_path, "api.allowed.test")):
        client = ssl.create_default_context(cafile=str(bundle))
        try:
            _handshake(server, client, name)
        except ssl.SSLCertVerificationError:
            continue
        raise AssertionError(f"handshake with {bundle} / {name} should fail")


def test_openssl_agrees(tmp_path):
    ca = TestCA.create(tmp_path)
    cert, _ = ca.issue(["x.github.test"])
    r = subprocess.run(["openssl", "verify", "-x509_strict", "-CAfile", str(ca.bundle_path), str(cert)],
                       capture_output=True, text=True)
    assert r.returncode == 0, r.stderr
