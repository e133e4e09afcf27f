"""`ddpjob data cifar10`: download from a loopback HTTP server or take --from FILE, verify the md5,
extract all-or-nothing; corrupt, truncated, tampered and hostile archives give one line and
leave the data root as it was."""

from __future__ import annotations

import gzip
import hashlib
import http.server
import io
import tarfile
import threading
from collections.abc import Iterator
from pathlib import Path

import pytest

from ddpjob.cli import main
from ddpjob.launch import dataprep
from ddpjob.train.fixtures import write_cifar10_archive


@pytest.fixture(scope="module")
def archive(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_cifar10_archive(tmp_path_factory.mktemp("arc") / "cifar-10-python.tar.gz",
                                 n_train=50, n_test=20, learnable=False)


def md5(path: Path) -> str:
    return hashlib.md5(path.read_bytes()).hexdigest()


class _Server:
    """Serves {path: bytes} on 127.0.0.1 from a thread; `cut` sends fewer bytes than announced."""

    def __init__(self, files: dict[str, bytes], cut: int | None = None) -> None:
        files_, cut_ = files, cut

        class Handler(http.server.BaseHTTPRequestHandler):
            def do_GET(self) -> None:  # noqa: N802 (http.server's name)
                body = files_.get(self.path)
                if body is None:
                    self.send_error(404)
                    return
                self.send_response(200)
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body[:cut_] if cut_ is not None else body)

            def log_message(self, *args: object) -> None:
                pass

        self.httpd = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.thread = threading.Thread(target=self.httpd.serve_forever, daemon=True)
        self.thread.start()
        self.url = f"http://127.0.0.1:{self.httpd.server_address[1]}"

    def close(self) -> None:
        self.httpd.shutdown()
        self.httpd.server_close()
        self.thread.join(10)


@pytest.fixture
def serve(monkeypatch: pytest.MonkeyPatch) -> Iterator:
    for var in ("http_proxy", "HTTP_PROXY", "https_proxy", "HTTPS_PROXY", "all_proxy", "ALL_PROXY"):
        monkeypatch.delenv(var, raising=False)  # loopback must not go through a proxy
    servers: list[_Server] = []

    def start(files: dict[str, bytes], cut: int | None = None) -> str:
        servers.append(_Server(files, cut))
        return servers[-1].url

    yield start
    for s in servers:
        s.close()


def ddpjob(capsys: pytest.CaptureFixture[str], *argv: str) -> tuple[int, str, str]:
    code = main(list(argv))
    out, err = capsys.readouterr()
    return code, out, err


def assert_one_error_line(code: int, err: str, *needles: str) -> None:
    assert code == 1
    lines = err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("ddpjob: error: ") and "Hint: " in lines[0], err
    for n in needles:
        assert n in lines[0], lines[0]


def assert_untouched(root: Path, before: set[str] | None = None) -> None:
    """No temp folders or partial downloads, and nothing but what was there before."""
    if before is None:  # it did not exist: a failed command does not leave it behind
        assert not root.exists(), sorted(p.name for p in root.iterdir())
        return
    assert {p.name for p in root.iterdir()} == before


def test_download_from_loopback_server_verifies_and_extracts(archive: Path, serve, capsys,
                                                             tmp_path: Path) -> None:
    url = serve({"/cifar-10-python.tar.gz": archive.read_bytes()}) + "/cifar-10-python.tar.gz"
    root = tmp_path / "data"
    code, out, err = ddpjob(capsys, "data", "cifar10", "--root", str(root), "--url", url,
                            "--md5", md5(archive))
    assert code == 0, err
    assert "ready" in out and "md5 verified" in out
    assert "downloading cifar-10-python.tar.gz" in out  # plain progress lines (not a terminal)
    assert {p.name for p in root.iterdir()} == {"cifar-10-batches-py"}  # the .part file is gone
    assert dataprep.cifar10_problem(root) is None

    from ddpjob.train.data import load_cifar10
    assert len(load_cifar10(root, train=True)) == 50 and len(load_cifar10(root, train=False)) == 20

    # Already there: says so, does not download again (the server is no longer needed).
    code, out, err = ddpjob(capsys, "data", "cifar10", "--root", str(root), "--url", url + "-gone")
    assert code == 0 and "already present" in out, err


def test_from_file_with_official_md5_refuses_the_fixture(archive: Path, capsys, tmp_path: Path) -> None:
    """Without --md5 the official checksum is expected: a different archive is refused."""
    root = tmp_path / "data"
    code, _, err = ddpjob(capsys, "data", "cifar10", "--root", str(root), "--from", str(archive))
    assert_one_error_line(code, err, dataprep.CIFAR10_MD5, "--md5")
    assert_untouched(root)


def test_from_file_good_archive(archive: Path, capsys, tmp_path: Path) -> None:
    root = tmp_path / "data"
    code, out, err = ddpjob(capsys, "data", "cifar10", "--root", str(root), "--from", str(archive),
                            "--md5", md5(archive))
    assert code == 0, err
    assert dataprep.cifar10_problem(root) is None
    assert archive.is_file()  # the user's archive is left where it was


def test_truncated_download_refused_without_leftovers(archive: Path, serve, capsys,
                                                      tmp_path: Path) -> None:
    body = archive.read_bytes()
    url = serve({"/a.tar.gz": body}, cut=len(body) // 2) + "/a.tar.gz"
    root = tmp_path / "data"
    code, _, err = ddpjob(capsys, "data", "cifar10", "--root", str(root), "--url", url,
                          "--md5", md5(archive))
    assert_one_error_line(code, err)
    assert "bytes" in err or "md5" in err
    assert_untouched(root)


def test_http_404_is_one_line(serve, capsys, tmp_path: Path) -> None:
    url = serve({}) + "/missing.tar.gz"
    code, _, err = ddpjob(capsys, "data", "cifar10", "--root", str(tmp_path / "d"), "--url", url)
    assert_one_error_line(code, err, "HTTP 404", "--from FILE")
    assert_untouched(tmp_path / "d")


@pytest.mark.parametrize("damage", ["truncated", "flipped"])
def test_damaged_archive_refused_by_checksum_and_by_extraction(archive: Path, capsys, tmp_path: Path,
                                                               damage: str) -> None:
    body = bytearray(archive.read_bytes())
    if damage == "truncated":
        body = body[: len(body) * 2 // 3]
    else:
        body[len(body) // 2] ^= 0x01  # one bit of one byte
    bad = tmp_path / "bad.tar.gz"
    bad.write_bytes(bytes(body))
    root = tmp_path / "data"

    # 1. the checksum catches it
    code, _, err = ddpjob(capsys, "data", "cifar10", "--root", str(root), "--from", str(bad),
                          "--md5", md5(archive))
    assert_one_error_line(code, err, "md5")
    assert_untouched(root)
    # 2. without a checksum, extraction/validation still refuses it and leaves no temp folder
    code, _, err = ddpjob(capsys, "data", "cifar10", "--root", str(root), "--from", str(bad),
                          "--no-verify")
    assert_one_error_line(code, err, str(bad))
    assert_untouched(root)


def test_damaged_archive_leaves_an_existing_copy_untouched(archive: Path, capsys, tmp_path: Path) -> None:
    """A broken existing copy (one file missing) is only replaced by a validated one."""
    root = tmp_path / "data"
    assert ddpjob(capsys, "data", "cifar10", "--root", str(root), "--from", str(archive),
                  "--md5", md5(archive))[0] == 0
    (root / "cifar-10-batches-py" / "data_batch_3").unlink()
    before = sorted(p.name for p in (root / "cifar-10-batches-py").iterdir())
    bad = tmp_path / "bad.tar.gz"
    bad.write_bytes(archive.read_bytes()[:4000])
    code, _, err = ddpjob(capsys, "data", "cifar10", "--root", str(root), "--from", str(bad),
                          "--no-verify")
    assert_one_error_line(code, err)
    assert sorted(p.name for p in (root / "cifar-10-batches-py").iterdir()) == before
    assert_untouched(root, {"cifar-10-batches-py"})
    # ... and a good archive repairs it.
    assert ddpjob(capsys, "data", "cifar10", "--root", str(root), "--from", str(archive),
                  "--md5", md5(archive))[0] == 0
    assert dataprep.cifar10_problem(root) is None
    assert_untouched(root, {"cifar-10-batches-py"})


def _hostile(tmp_path: Path, name: str, kind: str) -> Path:
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w") as tar:
        info = tarfile.TarInfo(name)
        if kind == "file":
            data = b"pwned\n"
            info.size = len(data)
            tar.addfile(info, io.BytesIO(data))
        else:
            info.type = tarfile.SYMTYPE
            info.linkname = "/etc/passwd"
            tar.addfile(info)
    path = tmp_path / "hostile.tar.gz"
    path.write_bytes(gzip.compress(buf.getvalue()))
    return path


@pytest.mark.parametrize("name,kind,why", [
    ("cifar-10-batches-py/../../escaped.txt", "file", "'..'"),
    ("/tmp/ddpjob-absolute-escape.txt", "file", "absolute"),
    ("cifar-10-batches-py/data_batch_1", "symlink", "link"),
])
def test_path_traversal_and_links_refused(tmp_path: Path, capsys, name: str, kind: str, why: str) -> None:
    hostile = _hostile(tmp_path, name, kind)
    root = tmp_path / "a" / "data"
    code, _, err = ddpjob(capsys, "data", "cifar10", "--root", str(root), "--from", str(hostile),
                          "--no-verify")
    assert_one_error_line(code, err, "refusing", why)
    assert_untouched(root)
    assert not (tmp_path / "escaped.txt").exists() and not (tmp_path / "a" / "escaped.txt").exists()
    assert not Path("/tmp/ddpjob-absolute-escape.txt").exists()


def test_bad_flags_are_usage_errors(capsys, tmp_path: Path) -> None:
    code, _, err = ddpjob(capsys, "data", "cifar10", "--root", str(tmp_path), "--md5", "xyz")
    assert code == 2 and "32 hex digits" in err
    code, _, err = ddpjob(capsys, "data", "cifar10", "--root", str(tmp_path), "--from", "a",
                          "--url", "http://127.0.0.1:9/x")
    assert code == 2 and "one source" in err


def test_quick_check_spots_truncated_file(archive: Path, tmp_path: Path) -> None:
    """doctor's cheap check: a cut file is caught without reading it all (and without torch)."""
    root = tmp_path / "data"
    dataprep.prepare_cifar10(root, from_file=archive, md5=None)
    f = root / "cifar-10-batches-py" / "test_batch"
    f.write_bytes(f.read_bytes()[:-100])
    problem = dataprep.cifar10_problem(root, full=False)
    assert problem is not None and "test_batch" in problem and "truncated" in problem
    (root / "cifar-10-batches-py" / "batches.meta").unlink()
    assert "batches.meta" in (dataprep.cifar10_problem(root, full=False) or "")
