"""The fleet's own certificate authority: a server proves it is the fleet's by a certificate only this CA signed.

The router verifies every worker against the CA (``--ca-cert-paths``), so a process that binds a dead server's port
cannot finish the TLS handshake and is never sent a request; autotune's own clients trust the CA through the shared
context (``autotune.tls.trust``). The CA and each server's key live in the fleet's ``tls/`` folder, readable only by
the user (docs/fleet.md, "Only the fleet's servers").
"""

from __future__ import annotations

import datetime
import ipaddress
from dataclasses import dataclass
from pathlib import Path

from cryptography import x509
from cryptography.exceptions import InvalidSignature
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import NameOID

from autotune import tls
from autotune.deploy.fleetfile import TLS_CA, TLS_DIR, Fleet, FleetServer, private_folder, replace_file

CA_YEARS = 10
SERVER_DAYS = 825  # the longest a TLS client accepts a server certificate for


@dataclass(frozen=True)
class ServerFiles:
    """A server's certificate (SGLang ``--ssl-certfile``) and key (``--ssl-keyfile``)."""

    cert: Path
    key: Path


def folder(fleet: Fleet) -> Path:
    return fleet.resolve(TLS_DIR)


def ca_file(fleet: Fleet) -> Path:
    """The CA's certificate: what the router and autotune's clients verify a server against."""
    return fleet.resolve(TLS_CA)


def _write_key(path: Path, key: ec.EllipticCurvePrivateKey) -> None:
    data = key.private_bytes(
        serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption()
    )
    replace_file(path, data.decode(), private=True)


def _read_key(path: Path) -> ec.EllipticCurvePrivateKey:
    key = serialization.load_pem_private_key(path.read_bytes(), password=None)
    assert isinstance(key, ec.EllipticCurvePrivateKey)
    return key


def _name(text: str) -> x509.Name:
    return x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, text)])


def ensure_ca(fleet: Fleet) -> Path:
    """The fleet's CA certificate, made on first use (its key never leaves the fleet's ``tls/`` folder)."""
    if not (ca_file(fleet).is_file() and (folder(fleet) / "ca.key").is_file()):
        with private_folder(folder(fleet)):
            _make_ca(fleet)
    return ca_file(fleet)


def _make_ca(fleet: Fleet) -> None:
    cert_path, key_path = ca_file(fleet), folder(fleet) / "ca.key"
    if cert_path.is_file() and key_path.is_file():
        return  # another issuer made it while this one waited
    key = ec.generate_private_key(ec.SECP256R1())
    now = datetime.datetime.now(datetime.UTC)
    # A name of its own: OpenSSL finds an issuer by name, and a process that trusts two fleets' CAs of one name
    # (two folders called deploy) checked the second fleet's servers against the first CA and refused them.
    serial = x509.random_serial_number()
    name = _name(f"autotune fleet CA ({fleet.path.parent.name if fleet.path else 'fleet'}) {serial % 16**8:08x}")
    cert = (
        x509.CertificateBuilder()
        .subject_name(name)
        .issuer_name(name)
        .public_key(key.public_key())
        .serial_number(serial)
        .add_extension(x509.SubjectKeyIdentifier.from_public_key(key.public_key()), critical=False)
        .not_valid_before(now - datetime.timedelta(minutes=5))
        .not_valid_after(now + datetime.timedelta(days=365 * CA_YEARS))
        .add_extension(x509.BasicConstraints(ca=True, path_length=0), critical=True)
        .add_extension(
            x509.KeyUsage(
                digital_signature=True,
                key_cert_sign=True,
                crl_sign=True,
                content_commitment=False,
                key_encipherment=False,
                data_encipherment=False,
                key_agreement=False,
                encipher_only=False,
                decipher_only=False,
            ),
            critical=True,
        )
        .sign(key, hashes.SHA256())
    )
    _write_key(key_path, key)
    replace_file(cert_path, cert.public_bytes(serialization.Encoding.PEM).decode())


def names(server: FleetServer) -> list[str]:
    """The names a client reaches the server by: loopback, and its host and bind address when they are others."""
    host = server.host.rsplit("@", 1)[-1].rsplit(":", 1)[0] if server.host else ""
    found = ["127.0.0.1", "localhost"]
    for name in (host, server.bind):
        if name and name not in ("0.0.0.0", "::", "localhost") and name not in found:
            found.append(name)
    return found


def _san(names_: list[str]) -> x509.SubjectAlternativeName:
    entries: list[x509.GeneralName] = []
    for name in names_:
        try:
            entries.append(x509.IPAddress(ipaddress.ip_address(name)))
        except ValueError:
            entries.append(x509.DNSName(name))
    return x509.SubjectAlternativeName(entries)


def _signed_by(cert: x509.Certificate, ca_cert: x509.Certificate) -> bool:
    """Issued by this very CA (its key's signature), not by an earlier one of the same name."""
    try:
        cert.verify_directly_issued_by(ca_cert)
    except (ValueError, TypeError, InvalidSignature):
        return False
    return True


def server_files(fleet: Fleet, server: FleetServer) -> ServerFiles:
    """The server's certificate and key, issued by the fleet's CA when missing, for other names, or by an older CA."""
    ca_path = ensure_ca(fleet)
    with private_folder(folder(fleet)):
        return _server_files(fleet, server, ca_path)


def _server_files(fleet: Fleet, server: FleetServer, ca_path: Path) -> ServerFiles:
    ca_cert = x509.load_pem_x509_certificate(ca_path.read_bytes())
    files = ServerFiles(cert=folder(fleet) / f"{server.name}.pem", key=folder(fleet) / f"{server.name}.key")
    wanted = _san(names(server))
    if files.cert.is_file() and files.key.is_file():
        cert = x509.load_pem_x509_certificate(files.cert.read_bytes())
        san = cert.extensions.get_extension_for_class(x509.SubjectAlternativeName).value
        fresh = cert.not_valid_after_utc - datetime.datetime.now(datetime.UTC) > datetime.timedelta(days=30)
        if _signed_by(cert, ca_cert) and set(san) == set(wanted) and fresh:
            return files
    ca_key = _read_key(folder(fleet) / "ca.key")
    key = ec.generate_private_key(ec.SECP256R1())
    now = datetime.datetime.now(datetime.UTC)
    cert = (
        x509.CertificateBuilder()
        .subject_name(_name(server.name))
        .issuer_name(ca_cert.subject)
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - datetime.timedelta(minutes=5))
        .not_valid_after(now + datetime.timedelta(days=SERVER_DAYS))
        .add_extension(wanted, critical=False)
        .add_extension(x509.AuthorityKeyIdentifier.from_issuer_public_key(ca_key.public_key()), critical=False)
        .add_extension(x509.BasicConstraints(ca=False, path_length=None), critical=True)
        .add_extension(x509.ExtendedKeyUsage([x509.oid.ExtendedKeyUsageOID.SERVER_AUTH]), critical=False)
        .sign(ca_key, hashes.SHA256())
    )
    _write_key(files.key, key)
    replace_file(files.cert, cert.public_bytes(serialization.Encoding.PEM).decode())
    return files


def trust(fleet: Fleet) -> None:
    """autotune's clients in this process verify the fleet's servers against its CA (a fleet without TLS: nothing)."""
    if fleet.tls:
        tls.trust(ensure_ca(fleet))


def ssl_argv(fleet: Fleet, server: FleetServer, *, relative: bool = False) -> list[str]:
    """SGLang's ``--ssl-certfile``/``--ssl-keyfile`` for a server that proves itself with the fleet's CA (issued
    here when missing), and ``--ssl-ca-certs``: SGLang 0.5.23 verifies its own warm-up and health requests against
    it, and without it turns verification off (``srt/arg_groups/serving_hook.py`` L948-968, ``ssl_verify_of``, used
    by ``srt/entrypoints/http_server.py`` L2366-2374). None for a server without TLS. ``relative``: paths from the
    fleet's folder, as ``launch_fleet.sh`` runs there."""
    if not server.tls:
        return []
    files = server_files(fleet, server)
    trust(fleet)
    paths = [files.cert, files.key, ca_file(fleet)]
    if relative:
        paths = [p.relative_to(fleet.base_dir) for p in paths]
    return ["--ssl-certfile", str(paths[0]), "--ssl-keyfile", str(paths[1]), "--ssl-ca-certs", str(paths[2])]
