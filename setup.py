"""Everything is in pyproject.toml but one file setuptools can't declare there: jobrunner-lm-eval.pth,
which goes to site-packages itself (beside the packages) so that `lm_eval --model jobrunner` finds
our backend (jobrunner_lm_eval_hook.py says why)."""
import shutil
from pathlib import Path

from setuptools import setup
from setuptools.command.build_py import build_py

PTH = "jobrunner-lm-eval.pth"


class BuildWithPth(build_py):
    def run(self):
        super().run()
        shutil.copy(Path(__file__).parent / PTH, Path(self.build_lib) / PTH)

    def get_outputs(self, include_bytecode=1):
        return [*super().get_outputs(include_bytecode), str(Path(self.build_lib) / PTH)]


setup(cmdclass={"build_py": BuildWithPth})
