"""Everything is in pyproject.toml but the package mapping (below) and one file setuptools can't declare there: jobrunner-lm-eval.pth,
which goes to site-packages itself (beside the packages) so that `lm_eval --model jobrunner` finds
our backend (jobrunner_lm_eval_hook.py says why): in a wheel by build_py, and in an editable install
(`pip install -e`, as .ci/run does) written into the editable wheel beside setuptools' own .pth."""
import shutil
from pathlib import Path

from setuptools import find_packages, setup
from setuptools.command.build_py import build_py
from setuptools.command.editable_wheel import editable_wheel

PTH = "jobrunner-lm-eval.pth"
SOURCE = Path(__file__).parent / PTH


class BuildWithPth(build_py):
    def run(self):
        super().run()
        shutil.copy(SOURCE, Path(self.build_lib) / PTH)

    def get_outputs(self, include_bytecode=1):
        return [*super().get_outputs(include_bytecode), str(Path(self.build_lib) / PTH)]


class _WithPth:
    """An editable-install strategy that also writes our .pth into the wheel."""

    def __init__(self, strategy):
        self.strategy = strategy

    def __call__(self, wheel, files, mapping):
        self.strategy(wheel, files, mapping)
        wheel.writestr(PTH, SOURCE.read_text())

    def __enter__(self):
        self.strategy.__enter__()
        return self

    def __exit__(self, *exc):
        return self.strategy.__exit__(*exc)


class EditableWithPth(editable_wheel):
    def _select_strategy(self, *args, **kwargs):
        return _WithPth(super()._select_strategy(*args, **kwargs))


# One installed name, `jobrunner`: the repository keeps its top-level folders and each installs under it.
# benchmarks/ runs from the checkout and is not installed.
FOLDERS = {"jobrunner": "jobrunner", "jobrunner.engine": "engine", "jobrunner.kernels": "kernels", "jobrunner.jobs": "jobs"}


def packages() -> list[str]:
    return [name for top, folder in FOLDERS.items()
            for name in (top, *(f"{top}.{sub}" for sub in find_packages(folder)))]


setup(packages=packages(), package_dir=FOLDERS,
      cmdclass={"build_py": BuildWithPth, "editable_wheel": EditableWithPth})
