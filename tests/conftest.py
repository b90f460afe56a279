import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
torch.set_num_threads(int(os.environ.get("SPECDEC_TEST_THREADS", "1")))
# compiled graphs over the models' own weights: a tiny model's packed packages take ~3x as long to
# build on an empty compile cache; the packed path has its own tests (``tests/compile/test_compiled.py``)
os.environ.setdefault("SPECDEC_COMPILE_PACKED", "off")
os.environ.setdefault("SPECDEC_COMPILE_PACKED_HEADS", "off")
# only the graphs opened before readiness are built at start-up, any other on first use: most tests run
# a few widths of many models, and on an empty cache each package costs seconds to build (the tests of
# start-up building set ``all``, the default, themselves)
os.environ.setdefault("SPECDEC_COMPILE_AHEAD", "ready")


@pytest.fixture(scope="session")
def tiny_family(tmp_path_factory):
    from tiny import build_family

    return build_family(tmp_path_factory.mktemp("family"))


def _openssl(*args, cwd):
    subprocess.run(["openssl", *args], cwd=cwd, check=True, capture_output=True)


@pytest.fixture(scope="module")
def certs(tmp_path_factory):
    """A throwaway CA, a server certificate for 127.0.0.1 / localhost and a client certificate."""
    if shutil.which("openssl") is None:
        pytest.skip("the openssl command is needed to make test certificates")
    d = tmp_path_factory.mktemp("pki")
    ec = ["-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:prime256v1", "-nodes"]
    _openssl("req", "-x509", *ec, "-keyout", "ca.key", "-out", "ca.pem", "-days", "2", "-subj", "/CN=specdec test CA",
             cwd=d)
    (d / "server.ext").write_text("subjectAltName=IP:127.0.0.1,DNS:localhost\n")
    for who, ext in (("server", ["-extfile", "server.ext"]), ("client", [])):
        _openssl("req", *ec, "-keyout", f"{who}.key", "-out", f"{who}.csr", "-subj", f"/CN={who}", cwd=d)
        _openssl("x509", "-req", "-in", f"{who}.csr", "-CA", "ca.pem", "-CAkey", "ca.key", "-CAcreateserial",
                 "-out", f"{who}.pem", "-days", "2", *ext, cwd=d)
    return {name: str(d / name) for name in ("ca.pem", "server.pem", "server.key", "client.pem", "client.key")}
