"""The certificates and keys a control plane needs, made fresh for each test session (EC P-256).

What kubeadm makes, in small: a cluster CA that signs the API server's serving certificate and every
client certificate (the admin's, in `system:masters`; the controller manager's, the scheduler's and
kube-proxy's, as the users the bootstrap RBAC policy binds), a front-proxy CA and client for aggregated
APIs (the requestheader settings prometheus-adapter relies on), and the service-account signing key pair.
"""

from __future__ import annotations

import datetime
import ipaddress
from dataclasses import dataclass
from pathlib import Path

from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

SERVICE_IP = "10.0.0.1"
"""The `kubernetes` Service's address: the first of `--service-cluster-ip-range`."""
SERVER_NAMES = (
    "localhost",
    "kubernetes",
    "kubernetes.default",
    "kubernetes.default.svc",
    "kubernetes.default.svc.cluster.local",
)


@dataclass(frozen=True)
class Pair:
    cert: Path
    key: Path


@dataclass(frozen=True)
class Pki:
    ca: Pair
    serving: Pair
    admin: Pair
    controller_manager: Pair
    scheduler: Pair
    kube_proxy: Pair
    front_proxy_ca: Pair
    front_proxy_client: Pair
    service_account_key: Path
    service_account_pub: Path

    def issue_serving(self, stem: str, names: tuple[str, ...], addresses: tuple[str, ...] = ()) -> Pair:
        """A serving certificate signed by the cluster CA (an aggregated API server's: the APIService's
        caBundle is then the CA, and the aggregator checks the name `<service>.<namespace>.svc`)."""
        folder = self.ca.cert.parent
        ca_cert = x509.load_pem_x509_certificate(self.ca.cert.read_bytes())
        ca_key = serialization.load_pem_private_key(self.ca.key.read_bytes(), password=None)
        assert isinstance(ca_key, ec.EllipticCurvePrivateKey)
        subject = _name(names[0])
        usage = ExtendedKeyUsageOID.SERVER_AUTH
        return _issue(
            folder, stem, subject, (ca_cert, ca_key), usage=usage, names=names, addresses=addresses
        )[0]


def _key() -> ec.EllipticCurvePrivateKey:
    return ec.generate_private_key(ec.SECP256R1())


def _write_key(key: ec.EllipticCurvePrivateKey, path: Path) -> None:
    path.write_bytes(
        key.private_bytes(
            serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption()
        )
    )
    path.chmod(0o600)


def _name(common: str, organisation: str | None = None) -> x509.Name:
    parts = [x509.NameAttribute(NameOID.COMMON_NAME, common)]
    if organisation:
        parts.append(x509.NameAttribute(NameOID.ORGANIZATION_NAME, organisation))
    return x509.Name(parts)


def _issue(
    folder: Path,
    stem: str,
    subject: x509.Name,
    issuer: tuple[x509.Certificate, ec.EllipticCurvePrivateKey] | None,
    *,
    usage: x509.ObjectIdentifier | None = None,
    names: tuple[str, ...] = (),
    addresses: tuple[str, ...] = (),
) -> tuple[Pair, x509.Certificate, ec.EllipticCurvePrivateKey]:
    key = _key()
    now = datetime.datetime.now(datetime.UTC)
    builder = (
        x509.CertificateBuilder()
        .subject_name(subject)
        .issuer_name(issuer[0].subject if issuer else subject)
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - datetime.timedelta(minutes=5))
        .not_valid_after(now + datetime.timedelta(days=2))
        .add_extension(x509.BasicConstraints(ca=issuer is None, path_length=None), critical=True)
    )
    if issuer is None:
        builder = builder.add_extension(
            x509.KeyUsage(True, False, False, False, False, True, True, False, False), critical=True
        )
    else:
        builder = builder.add_extension(
            x509.KeyUsage(True, False, False, False, False, False, False, False, False), critical=True
        )
    if usage is not None:
        builder = builder.add_extension(x509.ExtendedKeyUsage([usage]), critical=False)
    if names or addresses:
        alternatives: list[x509.GeneralName] = [x509.DNSName(name) for name in names]
        alternatives += [x509.IPAddress(ipaddress.ip_address(address)) for address in addresses]
        builder = builder.add_extension(x509.SubjectAlternativeName(alternatives), critical=False)
    cert = builder.sign(issuer[1] if issuer else key, hashes.SHA256())
    pair = Pair(folder / f"{stem}.crt", folder / f"{stem}.key")
    pair.cert.write_bytes(cert.public_bytes(serialization.Encoding.PEM))
    _write_key(key, pair.key)
    return pair, cert, key


def _client(
    folder: Path,
    stem: str,
    issuer: tuple[x509.Certificate, ec.EllipticCurvePrivateKey],
    user: str,
    group: str | None = None,
) -> Pair:
    return _issue(folder, stem, _name(user, group), issuer, usage=ExtendedKeyUsageOID.CLIENT_AUTH)[0]


def make_pki(folder: Path) -> Pki:
    folder.mkdir(parents=True, exist_ok=True)
    ca, ca_cert, ca_key = _issue(folder, "ca", _name("carpool-test-ca"), None)
    signer = (ca_cert, ca_key)
    serving = _issue(
        folder,
        "apiserver",
        _name("kube-apiserver"),
        signer,
        usage=ExtendedKeyUsageOID.SERVER_AUTH,
        names=SERVER_NAMES,
        addresses=("127.0.0.1", SERVICE_IP),
    )[0]
    front_ca, front_cert, front_key = _issue(folder, "front-proxy-ca", _name("front-proxy-ca"), None)
    account_key = _key()
    private, public = folder / "sa.key", folder / "sa.pub"
    _write_key(account_key, private)
    public.write_bytes(
        account_key.public_key().public_bytes(
            serialization.Encoding.PEM, serialization.PublicFormat.SubjectPublicKeyInfo
        )
    )
    return Pki(
        ca=ca,
        serving=serving,
        admin=_client(folder, "admin", signer, "carpool-test-admin", "system:masters"),
        controller_manager=_client(folder, "controller-manager", signer, "system:kube-controller-manager"),
        scheduler=_client(folder, "scheduler", signer, "system:kube-scheduler"),
        # The user the API server's default ClusterRoleBinding `system:node-proxier` names.
        kube_proxy=_client(folder, "kube-proxy", signer, "system:kube-proxy"),
        front_proxy_ca=front_ca,
        front_proxy_client=_client(
            folder, "front-proxy-client", (front_cert, front_key), "front-proxy-client"
        ),
        service_account_key=private,
        service_account_pub=public,
    )
