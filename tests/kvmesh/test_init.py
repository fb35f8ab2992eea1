"""`kvmesh init`: the mesh's NATS identities and server configuration (and with --tls a local
CA), made once and kept, holding no secret where nats-server reads."""

from __future__ import annotations

import re
import ssl
import subprocess
import sys
from pathlib import Path

from cryptography import x509

from shared.bus.auth import ROLES, seed
from tests.procs import REPO


def init(state_dir: Path, *args: str) -> subprocess.CompletedProcess:
    env = {"KVMESH_STATE_DIR": str(state_dir), "PATH": "/usr/bin:/bin"}
    run = subprocess.run(
        [sys.executable, "-m", "kvmesh", "init", *args],
        cwd=REPO,
        env=env,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert run.returncode == 0, run.stderr
    return run


def test_init_writes_public_keys_only_and_keeps_the_identities(tmp_path: Path) -> None:
    state = tmp_path / "state"
    init(state)
    config = state / "nats" / "server.conf"
    text = config.read_text()
    keys = re.findall(r'nkey: "(U[A-Z0-9]{55})"', text)
    assert len(keys) == len(ROLES) == len(set(keys))
    secrets = state / "secrets"
    for role in ROLES:
        assert seed(secrets, role) not in text  # the seed stays in the role's secret file
        assert (secrets / f"nats-{role}.key").stat().st_mode & 0o777 == 0o600
    assert config.stat().st_mode & 0o777 == 0o600
    assert "max_payload: 8MB" in text  # kvmesh/nats.conf's settings are kept
    init(state)  # again: the same identities, nothing new to hand out
    assert re.findall(r'nkey: "(U[A-Z0-9]{55})"', config.read_text()) == keys


def test_init_tls_makes_a_ca_and_a_certificate_per_role_that_verify(tmp_path: Path) -> None:
    state = tmp_path / "state"
    init(state, "--tls")
    tls = state / "tls"
    ca = x509.load_pem_x509_certificate((tls / "ca.crt").read_bytes())
    for role in (*ROLES, "nats"):
        cert = x509.load_pem_x509_certificate((tls / f"{role}.crt").read_bytes())
        cert.verify_directly_issued_by(ca)
        names = cert.extensions.get_extension_for_class(x509.SubjectAlternativeName).value
        assert "localhost" in names.get_values_for_type(x509.DNSName)
        assert (tls / f"{role}.key").stat().st_mode & 0o777 == 0o600
        context = ssl.create_default_context(cafile=str(tls / "ca.crt"))
        context.load_cert_chain(str(tls / f"{role}.crt"), str(tls / f"{role}.key"))
    text = (state / "nats" / "server.conf").read_text()
    assert "verify: true" in text and str(tls / "nats.crt") in text
    before = (tls / "router.crt").read_bytes()
    init(state, "--tls")  # valid certificates are kept
    assert (tls / "router.crt").read_bytes() == before
