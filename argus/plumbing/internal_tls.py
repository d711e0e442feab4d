"""The internal plane's mutual TLS: a cluster CA, one certificate per component, and who may
call what.

Every internal RPC (heartbeats, router reports, plan watches, router→worker ``Generate``,
worker→ControlNet streams) runs over mutual TLS: both ends show a certificate signed by the
cluster CA, so the handshake itself refuses a caller without one, the traffic is encrypted
(prompts are user data) and only whoever holds the CA key can mint an identity.

A component's identity is a URI SAN ``argus://ROLE/NAME`` (``argus://worker/worker-1``). Every
certificate also carries the DNS SAN :data:`SERVER_NAME`: components reach each other by IP,
so clients check the server's certificate against that one cluster-wide name
(``grpc.ssl_target_name_override``) rather than against the address.

Files: a CA directory holds ``ca.crt`` and ``ca.key``; a component's directory (``argus ROLE
--internal-tls-dir DIR``) holds ``ca.crt``, ``ROLE.crt`` and ``ROLE.key``, never the CA key.
Keys are written mode 0600.

:data:`POLICY` says which roles may call each method; :class:`RoleInterceptor` applies it on
every server built with credentials (PERMISSION_DENIED naming the method and the caller).
"""

from __future__ import annotations

import datetime
import os
import re
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import grpc

ROLES = ("allocator", "router", "worker", "controlnet", "operator")
"""``operator``: tools that only read (``argus up``'s readiness checks, probes, dashboards)."""

SERVER_NAME = "argus.internal"
URI_PREFIX = "argus://"
CA_CERT, CA_KEY = "ca.crt", "ca.key"
VALID_DAYS = 365

_ANY = frozenset(ROLES)
_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,127}")
POLICY: Mapping[str, frozenset[str]] = {
    "/argus.v1.Allocator/Heartbeat": frozenset({"worker"}),
    "/argus.v1.Allocator/ReportRouter": frozenset({"router"}),
    "/argus.v1.Allocator/WatchPlan": frozenset({"router", "operator"}),
    "/argus.v1.Allocator/GetPlan": frozenset({"router", "operator"}),
    "/argus.v1.Worker/Generate": frozenset({"router"}),
    "/argus.v1.Worker/GenerateStream": frozenset({"router"}),
    "/argus.v1.Worker/Configure": frozenset({"allocator"}),
    "/argus.v1.Worker/Stats": frozenset({"allocator", "router", "operator"}),
    "/argus.v1.ControlNet/Run": frozenset({"worker"}),
    "/argus.v1.ControlNet/Stats": frozenset({"worker", "operator"}),
}
"""Method → the roles that may call it. A method not listed is refused, except those of
:data:`OPEN_SERVICES`, which any certificate of the cluster may call."""

OPEN_SERVICES = ("/grpc.health.v1.Health/", "/grpc.reflection.v1alpha.ServerReflection/")


class TLSSetupError(OSError):
    """A missing or unusable certificate, key or directory; the message names the file."""


@dataclass(frozen=True)
class Identity:
    """Who a certificate names: a role of :data:`ROLES` and a name (a worker's id)."""

    role: str
    name: str

    def __post_init__(self) -> None:
        if self.role not in ROLES:
            raise ValueError(f"role: expected one of {', '.join(ROLES)}, got {self.role!r}")
        if not _NAME.fullmatch(self.name):
            raise ValueError(
                f"name: expected letters, digits, '.', '_' or '-' (a pod name), got {self.name!r}"
            )

    @property
    def uri(self) -> str:
        return f"{URI_PREFIX}{self.role}/{self.name}"

    @classmethod
    def parse(cls, text: str) -> Identity:
        """``ROLE/NAME`` or ``argus://ROLE/NAME``; ValueError quoting the text otherwise."""
        body = text.removeprefix(URI_PREFIX)
        role, sep, name = body.partition("/")
        if not sep:
            raise ValueError(f"identity: expected ROLE/NAME, got {text!r}")
        return cls(role, name)

    def __str__(self) -> str:
        return f"{self.role}/{self.name}"


# -- issuing ---------------------------------------------------------------------------------


def _write(path: Path, data: bytes, private: bool) -> None:
    """Write ``data``; a private file is created mode 0600 (never readable by others, even
    for an instant)."""
    flags = os.O_WRONLY | os.O_CREAT | os.O_TRUNC
    fd = os.open(path, flags, 0o600 if private else 0o644)
    with os.fdopen(fd, "wb") as f:
        f.write(data)
    if private:
        os.chmod(path, 0o600)  # an existing file keeps its mode through O_CREAT


def generate_ca(directory: Path | str, *, now: datetime.datetime | None = None) -> Path:
    """Create a cluster CA (EC P-256) in ``directory`` (``ca.crt``, ``ca.key``); returns it."""
    from cryptography import x509
    from cryptography.hazmat.primitives import hashes
    from cryptography.hazmat.primitives.asymmetric import ec
    from cryptography.x509.oid import NameOID

    out = Path(directory)
    out.mkdir(parents=True, exist_ok=True)
    start = now or datetime.datetime.now(datetime.UTC)
    key = ec.generate_private_key(ec.SECP256R1())
    name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "argus cluster CA")])
    cert = (
        x509.CertificateBuilder()
        .subject_name(name)
        .issuer_name(name)
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(start - datetime.timedelta(minutes=5))
        .not_valid_after(start + datetime.timedelta(days=10 * VALID_DAYS))
        .add_extension(x509.BasicConstraints(ca=True, path_length=0), critical=True)
        .add_extension(_key_usage(ca=True), critical=True)
        .sign(key, hashes.SHA256())
    )
    _write(out / CA_KEY, _key_pem(key), private=True)
    _write(out / CA_CERT, _cert_pem(cert), private=False)
    return out


def issue(
    ca_dir: Path | str,
    identity: Identity,
    out_dir: Path | str,
    *,
    now: datetime.datetime | None = None,
) -> Path:
    """Sign a certificate for ``identity`` with the CA in ``ca_dir`` and write the component's
    directory ``out_dir``: ``ca.crt``, ``ROLE.crt``, ``ROLE.key`` (not the CA key)."""
    from cryptography import x509
    from cryptography.hazmat.primitives import hashes, serialization
    from cryptography.hazmat.primitives.asymmetric import ec
    from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

    ca_path = Path(ca_dir)
    ca_pem = _read(ca_path / CA_CERT)
    ca_cert = x509.load_pem_x509_certificate(ca_pem)
    ca_key = serialization.load_pem_private_key(_read(ca_path / CA_KEY), password=None)
    if not isinstance(ca_key, ec.EllipticCurvePrivateKey):
        raise TLSSetupError(f"{ca_path / CA_KEY}: expected an EC private key")
    start = now or datetime.datetime.now(datetime.UTC)
    key = ec.generate_private_key(ec.SECP256R1())
    usages = [ExtendedKeyUsageOID.SERVER_AUTH, ExtendedKeyUsageOID.CLIENT_AUTH]
    cert = (
        x509.CertificateBuilder()
        .subject_name(x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, str(identity))]))
        .issuer_name(ca_cert.subject)
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(start - datetime.timedelta(minutes=5))
        .not_valid_after(start + datetime.timedelta(days=VALID_DAYS))
        .add_extension(x509.BasicConstraints(ca=False, path_length=None), critical=True)
        .add_extension(_key_usage(ca=False), critical=True)
        .add_extension(x509.ExtendedKeyUsage(usages), critical=False)
        .add_extension(
            x509.SubjectAlternativeName(
                [x509.DNSName(SERVER_NAME), x509.UniformResourceIdentifier(identity.uri)]
            ),
            critical=False,
        )
        .sign(ca_key, hashes.SHA256())
    )
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    _write(out / CA_CERT, ca_pem, private=False)
    _write(out / f"{identity.role}.key", _key_pem(key), private=True)
    _write(out / f"{identity.role}.crt", _cert_pem(cert), private=False)
    return out


def _key_usage(*, ca: bool) -> Any:
    from cryptography import x509

    return x509.KeyUsage(
        digital_signature=not ca,
        content_commitment=False,
        key_encipherment=False,
        data_encipherment=False,
        key_agreement=False,
        key_cert_sign=ca,
        crl_sign=ca,
        encipher_only=False,
        decipher_only=False,
    )


def _key_pem(key: Any) -> bytes:
    from cryptography.hazmat.primitives import serialization

    return bytes(
        key.private_bytes(
            serialization.Encoding.PEM,
            serialization.PrivateFormat.PKCS8,
            serialization.NoEncryption(),
        )
    )


def _cert_pem(cert: Any) -> bytes:
    from cryptography.hazmat.primitives import serialization

    return bytes(cert.public_bytes(serialization.Encoding.PEM))


def _read(path: Path) -> bytes:
    try:
        data = path.read_bytes()
    except OSError as err:
        raise TLSSetupError(f"{path}: cannot read ({err.strerror or err})") from None
    if b"-----BEGIN" not in data:
        raise TLSSetupError(f"{path}: not a PEM file")
    return data


# -- using -----------------------------------------------------------------------------------


@dataclass(frozen=True)
class InternalTLS:
    """One component's credentials on the internal plane: the CA it trusts, its own
    certificate and key, and the identity the certificate names."""

    ca: bytes
    cert: bytes
    key: bytes
    identity: Identity

    @classmethod
    def load(cls, directory: Path | str, role: str) -> InternalTLS:
        """Read ``ca.crt``, ``ROLE.crt`` and ``ROLE.key`` from ``directory``; TLSSetupError
        names a missing or bad file, or a certificate issued for another role."""
        root = Path(directory)
        if not root.is_dir():
            raise TLSSetupError(f"{root}: no such directory (--internal-tls-dir)")
        cert = _read(root / f"{role}.crt")
        identity = identity_of_pem(cert)
        if identity is None or identity.role != role:
            found = "no argus identity" if identity is None else f"identity {identity}"
            raise TLSSetupError(f"{root / f'{role}.crt'}: {found}, expected role {role}")
        return cls(_read(root / CA_CERT), cert, _read(root / f"{role}.key"), identity)

    def server_credentials(self) -> grpc.ServerCredentials:
        """Server side: show our certificate, require and verify the client's."""
        return grpc.ssl_server_credentials(
            [(self.key, self.cert)], root_certificates=self.ca, require_client_auth=True
        )

    def channel_credentials(self) -> grpc.ChannelCredentials:
        return grpc.ssl_channel_credentials(
            root_certificates=self.ca, private_key=self.key, certificate_chain=self.cert
        )


def identity_of_pem(pem: bytes) -> Identity | None:
    """The ``argus://ROLE/NAME`` URI SAN of a PEM certificate, or None without one."""
    from cryptography import x509

    cert = x509.load_pem_x509_certificate(pem)
    try:
        san = cert.extensions.get_extension_for_class(x509.SubjectAlternativeName)
    except x509.ExtensionNotFound:
        return None
    for uri in san.value.get_values_for_type(x509.UniformResourceIdentifier):
        if uri.startswith(URI_PREFIX):
            try:
                return Identity.parse(uri)
            except ValueError:
                return None
    return None


def channel(
    address: str,
    tls: InternalTLS | None,
    options: Sequence[tuple[str, Any]] = (),
) -> grpc.Channel:
    """A channel to an internal service: mutual TLS with ``tls``, plaintext with None
    (``--insecure-internal``)."""
    if tls is None:
        return grpc.insecure_channel(address, options=list(options))
    return grpc.secure_channel(
        address,
        tls.channel_credentials(),
        options=[*options, ("grpc.ssl_target_name_override", SERVER_NAME)],
    )


def caller(context: grpc.ServicerContext) -> Identity | None:
    """The identity of the peer's verified certificate; None on a plaintext server (or a
    certificate without one)."""
    auth = context.auth_context()
    for uri in auth.get("x509_subject_alternative_name", []):
        text = uri.decode() if isinstance(uri, bytes) else str(uri)
        if text.startswith(URI_PREFIX):
            try:
                return Identity.parse(text)
            except ValueError:
                return None
    return None


class RoleInterceptor(grpc.ServerInterceptor):
    """Applies :data:`POLICY`: a call from a role the method does not allow, or from a
    certificate without an argus identity, ends with PERMISSION_DENIED before the servicer
    runs."""

    def __init__(
        self,
        policy: Mapping[str, Iterable[str]] = POLICY,
        open_services: Sequence[str] = OPEN_SERVICES,
    ) -> None:
        self._policy = {method: frozenset(roles) for method, roles in policy.items()}
        self._open = tuple(open_services)

    def intercept_service(
        self,
        continuation: Callable[[grpc.HandlerCallDetails], Any],
        details: grpc.HandlerCallDetails,
    ) -> Any:
        handler = continuation(details)
        if handler is None:
            return None
        method = details.method
        allowed = _ANY if method.startswith(self._open) else self._policy.get(method, frozenset())
        return _guarded(handler, lambda context: self._check(method, allowed, context))

    @staticmethod
    def _check(method: str, allowed: frozenset[str], context: grpc.ServicerContext) -> None:
        who = caller(context)
        if who is None or who.role not in allowed:
            name = "a certificate without an argus identity" if who is None else str(who)
            roles = ", ".join(sorted(allowed)) or "no role"
            context.abort(
                grpc.StatusCode.PERMISSION_DENIED,
                f"{method}: {name} may not call it (allowed: {roles})",
            )


def _guarded(handler: Any, check: Callable[[grpc.ServicerContext], None]) -> Any:
    """``handler`` with ``check(context)`` run before its behaviour (any of the four kinds)."""
    if handler.unary_unary is not None:
        inner_uu = handler.unary_unary

        def unary_unary(request: Any, context: grpc.ServicerContext) -> Any:
            check(context)
            return inner_uu(request, context)

        return handler._replace(unary_unary=unary_unary)
    if handler.unary_stream is not None:
        inner_us = handler.unary_stream

        def unary_stream(request: Any, context: grpc.ServicerContext) -> Any:
            check(context)
            yield from inner_us(request, context)

        return handler._replace(unary_stream=unary_stream)
    if handler.stream_unary is not None:
        inner_su = handler.stream_unary

        def stream_unary(requests: Any, context: grpc.ServicerContext) -> Any:
            check(context)
            return inner_su(requests, context)

        return handler._replace(stream_unary=stream_unary)
    inner_ss = handler.stream_stream

    def stream_stream(requests: Any, context: grpc.ServicerContext) -> Any:
        check(context)
        yield from inner_ss(requests, context)

    return handler._replace(stream_stream=stream_stream)


def server_security(tls: InternalTLS | None) -> tuple[grpc.ServerCredentials | None, list[Any]]:
    """What an internal server binds with and the interceptors it adds: mutual TLS and the
    role check with ``tls``; plaintext and nothing with None."""
    if tls is None:
        return None, []
    return tls.server_credentials(), [RoleInterceptor()]
