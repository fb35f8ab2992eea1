"""The mesh's TLS, from CommonSettings' files: listeners that serve the service's certificate,
and connections that verify the peer against the mesh's CA and show their own certificate.

Public listeners (HTTP, the router's gRPC API) ask clients for no certificate; the KV
handoff between services asks for one the mesh's CA signed (mutual TLS). With no TLS files
set, everything here is plain TCP, as before.
"""

from __future__ import annotations

import ssl
from pathlib import Path

import grpc

from shared.settings import CommonSettings, SettingsError


def client_context(
    ca_file: Path | None, cert_file: Path | None = None, key_file: Path | None = None
) -> ssl.SSLContext:
    """A client's context: the server verified against ``ca_file`` (the system's CAs when
    None); this side's certificate shown when given (mutual TLS)."""
    context = ssl.create_default_context(cafile=str(ca_file) if ca_file else None)
    if cert_file is not None:
        context.load_cert_chain(str(cert_file), str(key_file) if key_file else None)
    return context


def server_context(common: CommonSettings) -> ssl.SSLContext | None:
    """An HTTP listener's context (clients show no certificate), or None without TLS."""
    if common.tls_cert_file is None:
        return None
    context = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
    context.minimum_version = ssl.TLSVersion.TLSv1_2
    context.load_cert_chain(str(common.tls_cert_file), str(common.tls_key_file))
    return context


def mesh_server_context(common: CommonSettings) -> ssl.SSLContext | None:
    """A listener only the mesh reaches: its clients show a certificate the mesh's CA signed
    (mutual TLS); None without TLS."""
    context = server_context(common)
    if context is not None:
        assert common.tls_ca_file is not None
        context.verify_mode = ssl.CERT_REQUIRED
        context.load_verify_locations(cafile=str(common.tls_ca_file))
    return context


def mesh_client_context(common: CommonSettings) -> ssl.SSLContext | None:
    """A connection to another service (``mesh_server_context``'s), or None without TLS."""
    if common.tls_ca_file is None:
        return None
    return client_context(common.tls_ca_file, common.tls_cert_file, common.tls_key_file)


def grpc_server(**kwargs: object) -> grpc.aio.Server:
    """A gRPC server that owns its port: gRPC shares a port with any other socket that allows
    it (SO_REUSEPORT, on by default), so a second kvmesh process told the same port would
    take half of the first's connections instead of failing."""
    options = [("grpc.so_reuseport", 0), *kwargs.pop("options", [])]  # type: ignore[misc]
    return grpc.aio.server(options=options, **kwargs)  # type: ignore[arg-type]


def add_port(
    server: grpc.aio.Server, address: str, common: CommonSettings, mutual: bool, setting: str
) -> int:
    """Listen on ``address``: with the service's certificate when TLS is on (``mutual``: a
    client must show one the mesh's CA signed), else plain. Returns the port; SettingsError
    naming ``setting`` when the address cannot be listened on (in use, not this host's)."""
    try:
        if common.tls_cert_file is None:
            return server.add_insecure_port(address)
        assert common.tls_key_file is not None and common.tls_ca_file is not None
        credentials = grpc.ssl_server_credentials(
            [(common.tls_key_file.read_bytes(), common.tls_cert_file.read_bytes())],
            root_certificates=common.tls_ca_file.read_bytes() if mutual else None,
            require_client_auth=mutual,
        )
        return server.add_secure_port(address, credentials)
    except RuntimeError:  # grpc's "Failed to bind"
        raise SettingsError(
            f"{setting}: cannot listen for gRPC on {address} (the port is in use, or the "
            "address is not this host's)"
        ) from None


def channel(address: str, common: CommonSettings) -> grpc.aio.Channel:
    """A channel to another service: TLS verified against the mesh's CA, showing this
    service's certificate, when TLS is on; else plain."""
    if common.tls_ca_file is None:
        return grpc.aio.insecure_channel(address)
    credentials = grpc.ssl_channel_credentials(
        root_certificates=common.tls_ca_file.read_bytes(),
        private_key=common.tls_key_file.read_bytes() if common.tls_key_file else None,
        certificate_chain=common.tls_cert_file.read_bytes() if common.tls_cert_file else None,
    )
    return grpc.aio.secure_channel(address, credentials)
