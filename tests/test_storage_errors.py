"""Object-store failures end in one line and the input's or the output's exit code, never a
traceback: missing credentials, a missing bucket, access denied, against a local S3-compatible
server (moto, as tests/test_cache_s3.py runs it). Skipped without s3fs and moto[server]."""
import json
import os
import socket
import urllib.request

import pytest
from click.testing import CliRunner

pytest.importorskip("s3fs")
pytest.importorskip("moto.server")
pytest.importorskip("flask")

from jobrunner.pipeline import build  # noqa: E402
from jobrunner.cli.main import main  # noqa: E402

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TINY = ["-m", f"dummy:{ROOT}/benchmarks/configs/tiny-llama.json", "--kv-cache-memory", "4MB", "--no-chat"]


@pytest.fixture(scope="module")
def server():
    """The endpoint of a fresh moto server with bucket `jobs` holding d.jsonl."""
    import s3fs
    from moto.server import ThreadedMotoServer
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    moto = ThreadedMotoServer(ip_address="127.0.0.1", port=port, verbose=False)
    moto.start()
    endpoint = f"http://127.0.0.1:{port}"
    # moto's backends are process-wide: another module's server may have left buckets behind
    urllib.request.urlopen(urllib.request.Request(f"{endpoint}/moto-api/reset", method="POST")).close()
    fs = s3fs.S3FileSystem(endpoint_url=endpoint, key="testing", secret="testing")
    fs.mkdir("jobs")
    fs.pipe_file("jobs/d.jsonl", json.dumps({"id": "a", "prompt": "hi"}).encode() + b"\n")
    yield endpoint
    moto.stop()


@pytest.fixture
def s3_env(server, monkeypatch, tmp_path):
    """s3:// URLs reach the server; credentials as each case sets them (none found by default)."""
    import fsspec.config
    import s3fs
    for k in list(os.environ):
        if k.startswith("AWS_"):
            monkeypatch.delenv(k)
    monkeypatch.setenv("AWS_SHARED_CREDENTIALS_FILE", str(tmp_path / "none"))
    monkeypatch.setenv("AWS_CONFIG_FILE", str(tmp_path / "none"))
    monkeypatch.setenv("AWS_EC2_METADATA_DISABLED", "true")
    monkeypatch.setenv("AWS_DEFAULT_REGION", "us-east-1")
    monkeypatch.setitem(fsspec.config.conf, "s3", {"endpoint_url": server})
    s3fs.S3FileSystem.clear_instance_cache()

    def load_engine(cfg):
        raise AssertionError("the model was loaded before the failing check")
    monkeypatch.setattr(build, "load_engine", load_engine)
    yield monkeypatch
    s3fs.S3FileSystem.clear_instance_cache()


def _credentials(mp):
    mp.setenv("AWS_ACCESS_KEY_ID", "testing")
    mp.setenv("AWS_SECRET_ACCESS_KEY", "testing")


def _deny(mp):
    """Every request authenticated: the key `testing` is no IAM user, so access is denied."""
    import moto.settings
    _credentials(mp)
    mp.setattr(moto.settings, "INITIAL_NO_AUTH_ACTION_COUNT", 0)


# (id, commands, argv ({local}: a local dataset), how the case sets up credentials, exit code, text)
CASES = [
    ("no-credentials-input", ("submit", "validate"), ["s3://jobs/d.jsonl"], None, 2, "AWS credentials"),
    ("no-credentials-output", ("submit",), ["{local}", "-o", "s3://jobs/out"], None, 4, "AWS credentials"),
    ("missing-bucket-input", ("submit", "validate"), ["s3://no-such-bucket/d.jsonl"], _credentials, 2,
     "no-such-bucket"),
    ("access-denied-input", ("submit", "validate"), ["s3://jobs/d.jsonl"], _deny, 2, "s3://jobs/d.jsonl"),
    ("access-denied-output", ("submit",), ["{local}", "-o", "s3://jobs/out"], _deny, 4, "s3://jobs/out"),
]


@pytest.mark.parametrize("command,argv,setup,code,text", [
    pytest.param(cmd, argv, setup, code, text, id=f"{cmd}-{name}")
    for name, cmds, argv, setup, code, text in CASES for cmd in cmds])
def test_object_store_failures_exit_with_one_line(s3_env, tmp_path, command, argv, setup, code, text):
    local = tmp_path / "d.jsonl"
    local.write_text('{"id": "a", "prompt": "hi"}\n')
    if setup is not None:
        setup(s3_env)
    r = CliRunner().invoke(main, [command, *(a.format(local=local) for a in argv), *TINY])
    assert r.exception is None or isinstance(r.exception, SystemExit), r.exc_info
    assert r.exit_code == code, r.output
    assert text in r.output and "Traceback" not in r.output, r.output
    errors = [line for line in r.output.splitlines() if line.startswith("error:")]
    assert len(errors) == 1 and len(errors[0]) < 400, r.output
