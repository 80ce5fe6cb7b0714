"""Certificates for TLS tests, made with the `openssl` command: a CA, and certificates for
127.0.0.1 and localhost that it signs."""

import subprocess
from pathlib import Path


def openssl(*args: str, cwd: Path) -> None:
    subprocess.run(["openssl", *args], cwd=cwd, check=True, capture_output=True)


def make_ca(folder: Path, name: str) -> None:
    """name.pem and name.key: a self-signed CA."""
    openssl(
        "req", "-x509", "-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:prime256v1", "-nodes",
        "-keyout", f"{name}.key", "-out", f"{name}.pem", "-days", "2", "-subj", f"/CN={name}",
        "-addext", "basicConstraints=critical,CA:TRUE",
        "-addext", "keyUsage=critical,keyCertSign,cRLSign",
        cwd=folder,
    )  # fmt: skip


def make_cert(folder: Path, name: str, ca: str) -> None:
    """name.pem and name.key: a certificate for 127.0.0.1 and localhost, signed by `ca`."""
    openssl(
        "req", "-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:prime256v1", "-nodes",
        "-keyout", f"{name}.key", "-out", f"{name}.csr", "-subj", f"/CN={name}",
        cwd=folder,
    )  # fmt: skip
    (folder / f"{name}.ext").write_text("subjectAltName=IP:127.0.0.1,DNS:localhost\n")
    openssl(
        "x509", "-req", "-in", f"{name}.csr", "-CA", f"{ca}.pem", "-CAkey", f"{ca}.key",
        "-CAcreateserial", "-out", f"{name}.pem", "-days", "2", "-extfile", f"{name}.ext",
        cwd=folder,
    )  # fmt: skip


def make_pki(folder: Path) -> Path:
    """ca signs server and client certificates; other-ca signs nothing."""
    make_ca(folder, "ca")
    make_ca(folder, "other-ca")
    make_cert(folder, "server", "ca")
    make_cert(folder, "client", "ca")
    return folder
