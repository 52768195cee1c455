"""The wheel as a user installs it: one top-level package, `jobrunner`, beside the newest transformers and
Hugging Face's own `kernels` package (which transformers requires from 5.25 on, and whose name our
kernels once took in site-packages). Built from this checkout, installed into a fresh virtual
environment whose dependencies are this one's, and run from a folder outside the checkout."""
import json
import os
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent

PARITY = """
import json, sys, torch, transformers
import jobrunner
path, prompt = sys.argv[1], json.loads(sys.argv[2])
hf = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
want = hf.generate(torch.tensor([prompt]), max_new_tokens=8, min_new_tokens=8, do_sample=False, pad_token_id=0)[0, len(prompt):].tolist()
from jobrunner.engine import Engine, EngineConfig, Request, SamplingParams
with Engine(EngineConfig(model=path, device="cpu", dtype="float32", kv_cache_memory=4 << 20)) as engine:
    out = engine.generate([Request("r", prompt_token_ids=prompt, sampling=SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True))])
got = out[0].completions[0].token_ids
print(json.dumps({"want": want, "got": list(got), "transformers": transformers.__version__}))
"""


@pytest.fixture(scope="module")
def wheel(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("wheel")
    subprocess.run([sys.executable, "-m", "pip", "wheel", "-q", "--no-deps", "-w", str(out), str(REPO)],
                   check=True, capture_output=True, timeout=600)
    return next(out.glob("jobrunner-*.whl"))


@pytest.fixture(scope="module")
def env(wheel, tmp_path_factory) -> Path:
    """A fresh virtual environment with the wheel installed; its dependencies are this environment's."""
    root = tmp_path_factory.mktemp("env")
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(root)], check=True, timeout=120)
    site = next((root / "lib").glob("python3*/site-packages"))
    ours = next(p for p in map(Path, sys.path) if p.name == "site-packages" and (p / "torch").is_dir())
    (site / "_deps.pth").write_text(f"{ours}\n")     # appended after the venv's own site-packages
    subprocess.run([sys.executable, "-m", "pip", "--python", str(root / "bin" / "python"), "install", "-q",
                    "--no-deps", str(wheel)], check=True, capture_output=True, timeout=300)
    return root


def _run(env: Path, *args, cwd: Path, timeout: int = 600) -> subprocess.CompletedProcess:
    environ = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "VIRTUAL_ENV")}
    environ["PATH"] = f"{env / 'bin'}{os.pathsep}{environ.get('PATH', '')}"
    return subprocess.run(args, cwd=cwd, env=environ, capture_output=True, text=True, timeout=timeout)


def test_the_wheel_installs_one_top_level_package(wheel):
    tops = {name.split("/")[0] for name in zipfile.ZipFile(wheel).namelist()}
    packages = {t for t in tops if not t.endswith((".dist-info", ".pth", ".py"))}
    assert packages == {"jobrunner"}, tops
    # and the one module lm-eval's .pth runs at interpreter start: apart, so that no Python start imports jobrunner
    assert {t for t in tops if t.endswith(".py")} == {"jobrunner_lm_eval_hook.py"}, tops
    names = zipfile.ZipFile(wheel).namelist()
    assert "jobrunner/kernels/attention/cpu_attention.c" in names       # compiled at first use
    assert "jobrunner/kernels/ops.py" in names and "jobrunner/engine/core/engine.py" in names
    assert "jobrunner/pipeline/calibration_text.txt" in names
    assert not any(n.startswith("benchmarks/") for n in names)


def test_beside_huggingface_kernels_and_the_newest_transformers(env, tmp_path):
    pytest.importorskip("kernels", reason="the test extra installs Hugging Face's kernels")
    probe = ("import json, kernels, transformers, jobrunner.kernels.ops as ours; "
             "print(json.dumps({'hf': kernels.__file__, 'get_kernel': hasattr(kernels, 'get_kernel'), "
             "'ours': ours.__file__, 'decode': hasattr(ours, 'DecodeLibrary')}))")
    r = _run(env, str(env / "bin" / "python"), "-c", probe, cwd=tmp_path)
    assert r.returncode == 0, r.stderr[-3000:]
    found = json.loads(r.stdout)
    assert found["get_kernel"] and found["decode"], found
    assert str(env) in found["ours"], found         # the wheel's copy, not the checkout's
    shown = _run(env, str(env / "bin" / "python"), "-m", "pip", "show", "-f", "jobrunner", cwd=tmp_path)
    files = [line.strip() for line in shown.stdout.split("Files:", 1)[-1].splitlines() if line.strip()]
    folders = {f.split("/")[0] for f in files if "/" in f and not f.startswith(("../", "__pycache__/"))
               and not f.split("/")[0].endswith(".dist-info")}      # the console script; the hook's bytecode
    assert folders == {"jobrunner"}, files


def test_the_example_job_and_greedy_parity_run_from_the_wheel(env, tmp_path, tiny_hf_model_dir, default_gguf_path):
    data = tmp_path / "reviews.jsonl"
    data.write_text((REPO / "examples" / "reviews.jsonl").read_text())
    r = _run(env, str(env / "bin" / "jobrunner"), "submit", str(data), "--max-tokens", "4", "--overwrite", cwd=tmp_path)
    assert r.returncode == 0, r.stderr[-3000:]
    assert list((tmp_path / "reviews.jsonl.results").glob("part-*.parquet"))
    prompt = [1, 5, 9, 14, 2, 7]
    r = _run(env, str(env / "bin" / "python"), "-c", PARITY, str(tiny_hf_model_dir("llama")), json.dumps(prompt),
             cwd=tmp_path)
    assert r.returncode == 0, r.stderr[-3000:]
    result = json.loads(r.stdout.strip().splitlines()[-1])
    assert result["got"] == result["want"], result
