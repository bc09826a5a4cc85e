"""TLS on the router's control listener: on by default beyond loopback, with a CA of its own.

When the stream runs TLS (llmgw.fleet.identity.control_tls_wanted) and no `[control] tls_cert` is
given, the router makes — once, at its first start — a private CA and a server certificate signed
by it, in `[control] tls_dir` (0700; keys 0600). Agents pin that CA (`llmgw ctl join-info` prints
it) and verify the name every generated certificate carries, :data:`SERVER_NAME`: the CA signs
nothing else, so that name is as good as an address, and it holds whatever address agents dial
(a wildcard listener, NAT, a DNS name). The server certificate is renewed from the CA at a start
within 30 days of its expiry; the CA lasts ten years.

Keys are made with the `openssl` command (Python's ssl module cannot make them). Where it is
missing, set `[control] tls_cert`/`tls_key` to a certificate of your own.
"""

from __future__ import annotations

import fcntl
import hashlib
import logging
import os
import secrets
import shutil
import socket
import ssl
import stat
import subprocess
from dataclasses import dataclass
from pathlib import Path

from llmgw.config import ControlConfig
from llmgw.fleet.identity import control_tls_wanted
from llmgw.fleet.report_url import is_loopback_host

log = logging.getLogger("llmgw.control")

__all__ = ["SERVER_NAME", "ControlTls", "TlsSetupError", "ca_fingerprint", "default_tls_dir", "setup_control_tls"]

SERVER_NAME = "llmgw-control"
CA_DAYS = 3650
SERVER_DAYS = 825
RENEW_WITHIN_S = 30 * 86400


class TlsSetupError(Exception):
    """The control listener's TLS cannot be set up (the message says why and what to do)."""


@dataclass(frozen=True)
class ControlTls:
    context: ssl.SSLContext
    ca_pem: str | None  # the CA agents pin (generated); None: the operator's own certificate
    server_name: str | None  # the name agents verify (generated); None: the address they dial
    cert_path: str
    generated: bool


def ca_fingerprint(pem: str) -> str:
    """SHA-256 of the certificate's DER, as `openssl x509 -fingerprint -sha256` prints it."""
    digest = hashlib.sha256(ssl.PEM_cert_to_DER_cert(pem)).hexdigest().upper()
    return ":".join(digest[i:i + 2] for i in range(0, len(digest), 2))


def default_tls_dir(store: str) -> str:
    """A `tls` directory beside the store (under $XDG_STATE_HOME/llmgw for an in-memory store)."""
    if store == ":memory:":
        base = Path(os.environ.get("XDG_STATE_HOME") or Path.home() / ".local" / "state") / "llmgw"
        return str(base / "tls")
    return str(Path(store).resolve().parent / "tls")


def setup_control_tls(c: ControlConfig, listen_host: str) -> ControlTls | None:
    """The listener's TLS, or None for plain TCP (loopback, or `tls = false`)."""
    if not control_tls_wanted(listen_host, c.tls, bool(c.tls_cert)):
        if not is_loopback_host(listen_host):
            log.warning("control stream on %s without TLS (control.tls = false): join tokens, node credentials "
                        "and engine specs cross the network in the clear", listen_host)
        return None
    if c.tls_cert:
        ctx = _server_context(c.tls_cert, c.tls_key or "", "control.tls_cert/tls_key")
        return ControlTls(ctx, None, None, c.tls_cert, generated=False)
    d = Path(c.tls_dir or default_tls_dir(c.store))
    ca_pem = _ensure_material(d, listen_host)
    ctx = _server_context(str(d / "server.pem"), str(d / "server.key"), f"control.tls_dir ({d})")
    return ControlTls(ctx, ca_pem, SERVER_NAME, str(d / "server.pem"), generated=True)


def _server_context(cert: str, key: str, what: str) -> ssl.SSLContext:
    ctx = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
    ctx.minimum_version = ssl.TLSVersion.TLSv1_2
    try:
        ctx.load_cert_chain(cert, key)
    except (OSError, ssl.SSLError) as e:
        raise TlsSetupError(f"{what}: {e}") from None
    return ctx


# --------------------------------------------------------------------------- the generated CA

_OPENSSL_CNF = """\
[req]
distinguished_name = dn
[dn]
[v3_ca]
basicConstraints = critical, CA:TRUE, pathlen:0
keyUsage = critical, keyCertSign, cRLSign
subjectKeyIdentifier = hash
authorityKeyIdentifier = keyid:always
[v3_server]
basicConstraints = critical, CA:FALSE
keyUsage = critical, digitalSignature
extendedKeyUsage = serverAuth
subjectKeyIdentifier = hash
authorityKeyIdentifier = keyid, issuer
subjectAltName = {sans}
"""
_EC = ["-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:prime256v1", "-nodes"]


def _private_dir(d: Path) -> None:
    d.mkdir(mode=0o700, parents=True, exist_ok=True)
    st = d.stat()
    if st.st_uid != os.getuid():
        raise TlsSetupError(f"control.tls_dir {d} belongs to uid {st.st_uid}, not to us: refusing to keep keys there")
    if stat.S_IMODE(st.st_mode) & 0o077:
        log.warning("control.tls_dir %s had mode %04o; tightened to 0700", d, stat.S_IMODE(st.st_mode))
        d.chmod(0o700)


def _openssl(args: list[str], cwd: Path) -> None:
    exe = shutil.which("openssl")
    if exe is None:
        raise TlsSetupError("the control stream needs TLS but the `openssl` command is not installed to make its "
                            "CA: install openssl, or set control.tls_cert and tls_key, or (on a trusted network "
                            "only) control.tls = false")
    try:
        done = subprocess.run([exe, *args], cwd=cwd, capture_output=True, timeout=60, check=False)
    except (OSError, subprocess.TimeoutExpired) as e:
        raise TlsSetupError(f"openssl {args[0]}: {e}") from None
    if done.returncode != 0:
        err = done.stderr.decode(errors="replace").strip().splitlines()
        raise TlsSetupError(f"openssl {args[0]} failed: {err[-1] if err else done.returncode}")


def _sans(listen_host: str) -> str:
    names = [f"DNS:{SERVER_NAME}", "DNS:localhost", "IP:127.0.0.1", "IP:::1"]
    host = socket.gethostname()
    if host and all(ch.isalnum() or ch in "-." for ch in host) and host != "localhost":
        names.append(f"DNS:{host}")
    h = listen_host.strip("[]")
    if h and h not in ("0.0.0.0", "::", "localhost", "127.0.0.1", "::1"):
        names.append(f"IP:{h}" if all(ch in "0123456789abcdefABCDEF.:" for ch in h) else f"DNS:{h}")
    return ", ".join(dict.fromkeys(names))


def _expires_soon(cert: Path, cwd: Path) -> bool:
    try:
        _openssl(["x509", "-checkend", str(RENEW_WITHIN_S), "-noout", "-in", str(cert)], cwd)
    except TlsSetupError:
        return True
    return False


def _ensure_material(d: Path, listen_host: str) -> str:
    """Make the CA and the server certificate where missing (renew one about to expire); the CA's PEM."""
    _private_dir(d)
    with open(d / ".lock", "a+") as lock:  # two routers sharing a tls_dir must not both generate
        fcntl.flock(lock, fcntl.LOCK_EX)
        ca, ca_key, cert, key = d / "ca.pem", d / "ca.key", d / "server.pem", d / "server.key"
        cnf = d / "openssl.cnf"
        cnf.write_text(_OPENSSL_CNF.format(sans=_sans(listen_host)))
        try:
            if not (ca.exists() and ca_key.exists()):
                log.info("control TLS: making a CA in %s (agents pin it: `llmgw ctl join-info`)", d)
                cn = f"/CN=llmgw control CA {secrets.token_hex(4)}"
                _openssl(["req", "-x509", "-new", *_EC, "-keyout", "ca.key.tmp", "-out", "ca.pem.tmp",
                          "-days", str(CA_DAYS), "-subj", cn, "-config", "openssl.cnf", "-extensions", "v3_ca"], d)
                (d / "ca.key.tmp").chmod(0o600)
                os.replace(d / "ca.key.tmp", ca_key)
                os.replace(d / "ca.pem.tmp", ca)
                for f in (cert, key):
                    f.unlink(missing_ok=True)  # signed by another CA, if any
            if not (cert.exists() and key.exists()) or _expires_soon(cert, d):
                log.info("control TLS: issuing the router's certificate (%s) in %s", SERVER_NAME, d)
                _openssl(["req", "-new", *_EC, "-keyout", "server.key.tmp", "-out", "server.csr",
                          "-subj", f"/CN={SERVER_NAME}", "-config", "openssl.cnf"], d)
                _openssl(["x509", "-req", "-in", "server.csr", "-CA", "ca.pem", "-CAkey", "ca.key",
                          "-set_serial", f"0x{secrets.token_hex(16)}", "-days", str(SERVER_DAYS),
                          "-extfile", "openssl.cnf", "-extensions", "v3_server", "-out", "server.pem.tmp"], d)
                (d / "server.key.tmp").chmod(0o600)
                os.replace(d / "server.key.tmp", key)
                os.replace(d / "server.pem.tmp", cert)
            for f in (ca_key, key):
                if stat.S_IMODE(f.stat().st_mode) != 0o600:
                    f.chmod(0o600)
            return ca.read_text()
        except OSError as e:
            raise TlsSetupError(f"control.tls_dir {d}: {e.strerror or e}") from None
        finally:
            for leftover in ("openssl.cnf", "server.csr", "ca.key.tmp", "ca.pem.tmp", "server.key.tmp", "server.pem.tmp"):
                (d / leftover).unlink(missing_ok=True)
