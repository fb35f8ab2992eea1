"""A local CA and one certificate per role, for `kvmesh up --tls` and `kvmesh init --tls`.

Everything lives in <state_dir>/tls: ``ca.crt`` (what clients trust), ``ca.key`` and each
role's ``<role>.crt`` / ``<role>.key`` (keys mode 0600). Each certificate names localhost,
127.0.0.1, ::1, this host's name and the hosts given (``kvmesh init --tls --host``: a mesh over
several hosts, each service reached at its host's address), serves as server and client
certificate (mutual TLS between services), and is remade when missing, expiring within a
week, not signed by the CA on disk, or not naming a host asked for. A cluster brings its own
certificates instead (KVMESH_TLS_* settings).
"""

from __future__ import annotations

import datetime as dt
import ipaddress
import os
import socket
from dataclasses import dataclass
from pathlib import Path

from cryptography import x509
from cryptography.exceptions import InvalidSignature
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

from shared.bus.auth import ROLES

CA_DAYS = 3650
CERT_DAYS = 365
RENEW_BEFORE = dt.timedelta(days=7)
# Every service's certificate, and nats-server's.
CERT_ROLES = (*ROLES, "nats")


@dataclass(frozen=True)
class CertFiles:
    cert: Path
    key: Path


@dataclass(frozen=True)
class MeshTls:
    ca: Path
    certs: dict[str, CertFiles]  # by role

    def env(self, role: str) -> dict[str, str]:
        """The settings that give ``role`` the mesh's TLS."""
        files = self.certs[role]
        return {
            "KVMESH_TLS_CA_FILE": str(self.ca),
            "KVMESH_TLS_CERT_FILE": str(files.cert),
            "KVMESH_TLS_KEY_FILE": str(files.key),
        }


def _write_key(path: Path, key: ec.EllipticCurvePrivateKey) -> None:
    data = key.private_bytes(
        serialization.Encoding.PEM,
        serialization.PrivateFormat.PKCS8,
        serialization.NoEncryption(),
    )
    tmp = path.with_suffix(".tmp")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "wb") as f:
        f.write(data)
    tmp.replace(path)


def _name(common_name: str) -> x509.Name:
    return x509.Name(
        [
            x509.NameAttribute(NameOID.ORGANIZATION_NAME, "kvmesh"),
            x509.NameAttribute(NameOID.COMMON_NAME, common_name),
        ]
    )


def _usable(path: Path, issuer: x509.Certificate | None, now: dt.datetime) -> bool:
    """The certificate at ``path`` is there, valid for a week more, and (``issuer``) signed
    by that CA."""
    if not path.is_file():
        return False
    try:
        cert = x509.load_pem_x509_certificate(path.read_bytes())
    except ValueError:
        return False
    if cert.not_valid_after_utc - now < RENEW_BEFORE:
        return False
    if issuer is None:
        return True
    try:
        cert.verify_directly_issued_by(issuer)
    except (ValueError, TypeError, InvalidSignature):
        return False
    return True


def _ca(dir: Path, now: dt.datetime) -> tuple[x509.Certificate, ec.EllipticCurvePrivateKey]:
    cert_path, key_path = dir / "ca.crt", dir / "ca.key"
    if _usable(cert_path, None, now) and key_path.is_file():
        key = serialization.load_pem_private_key(key_path.read_bytes(), None)
        assert isinstance(key, ec.EllipticCurvePrivateKey)
        return x509.load_pem_x509_certificate(cert_path.read_bytes()), key
    key = ec.generate_private_key(ec.SECP256R1())
    name = _name("kvmesh local CA")
    cert = (
        x509.CertificateBuilder()
        .subject_name(name)
        .issuer_name(name)
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - dt.timedelta(minutes=5))
        .not_valid_after(now + dt.timedelta(days=CA_DAYS))
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
        .add_extension(x509.SubjectKeyIdentifier.from_public_key(key.public_key()), False)
        .sign(key, hashes.SHA256())
    )
    _write_key(key_path, key)
    cert_path.write_bytes(cert.public_bytes(serialization.Encoding.PEM))
    return cert, key


def _general_name(host: str) -> x509.GeneralName:
    try:
        return x509.IPAddress(ipaddress.ip_address(host))
    except ValueError:
        return x509.DNSName(host)


def _names(cert: Path) -> set[x509.GeneralName]:
    loaded = x509.load_pem_x509_certificate(cert.read_bytes())
    return set(loaded.extensions.get_extension_for_class(x509.SubjectAlternativeName).value)


def _leaf(
    files: CertFiles,
    role: str,
    ca: tuple[x509.Certificate, ec.EllipticCurvePrivateKey],
    now: dt.datetime,
    hosts: tuple[str, ...] = (),
) -> None:
    ca_cert, ca_key = ca
    names: list[x509.GeneralName] = [
        x509.DNSName("localhost"),
        x509.IPAddress(ipaddress.ip_address("127.0.0.1")),
        x509.IPAddress(ipaddress.ip_address("::1")),
    ]
    host = socket.gethostname()
    if host and host != "localhost":
        names.append(x509.DNSName(host))
    names += [n for n in map(_general_name, hosts) if n not in names]
    if (
        _usable(files.cert, ca_cert, now)
        and files.key.is_file()
        and set(names) <= _names(files.cert)  # (a host asked for since: made again)
    ):
        return
    key = ec.generate_private_key(ec.SECP256R1())
    cert = (
        x509.CertificateBuilder()
        .subject_name(_name(f"kvmesh {role}"))
        .issuer_name(ca_cert.subject)
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - dt.timedelta(minutes=5))
        .not_valid_after(now + dt.timedelta(days=CERT_DAYS))
        .add_extension(x509.BasicConstraints(ca=False, path_length=None), critical=True)
        .add_extension(x509.SubjectAlternativeName(names), critical=False)
        .add_extension(
            x509.ExtendedKeyUsage(
                [ExtendedKeyUsageOID.SERVER_AUTH, ExtendedKeyUsageOID.CLIENT_AUTH]
            ),
            critical=False,
        )
        .add_extension(
            x509.AuthorityKeyIdentifier.from_issuer_public_key(ca_key.public_key()), False
        )
        .sign(ca_key, hashes.SHA256())
    )
    _write_key(files.key, key)
    files.cert.write_bytes(cert.public_bytes(serialization.Encoding.PEM))


def ensure_mesh_tls(dir: Path, hosts: tuple[str, ...] = ()) -> MeshTls:
    """The CA and every role's certificate under ``dir``, made or renewed where needed, each
    naming ``hosts`` too (addresses or names)."""
    dir.mkdir(parents=True, exist_ok=True, mode=0o700)
    now = dt.datetime.now(dt.UTC)
    ca = _ca(dir, now)
    certs = {role: CertFiles(dir / f"{role}.crt", dir / f"{role}.key") for role in CERT_ROLES}
    for role, files in certs.items():
        _leaf(files, role, ca, now, hosts)
    return MeshTls(dir / "ca.crt", certs)
