"""Makes `lm_eval --model jobrunner` work: lm-eval 0.4 discovers no plugins (no entry points), so
the file jobrunner-lm-eval.pth, which installing jobrunner puts in site-packages, runs `install()`
at interpreter start. That adds one import finder and nothing else; when lm-eval's model registry
(`lm_eval.models`) loads, the name `jobrunner` is registered there as a lazy placeholder, the way
lm-eval registers its own models, so jobrunner itself loads only when a run asks for it."""
from __future__ import annotations

import importlib.util
import sys
from importlib.abc import MetaPathFinder

NAME, TARGET = "jobrunner", "jobrunner.lm_eval_model:JobrunnerLM"


def register() -> None:
    """Adds the placeholder to lm-eval's model registry (a no-op when the name is there already)."""
    from lm_eval.api.registry import model_registry
    if NAME not in model_registry:
        model_registry.register(NAME, target=TARGET)


class _AfterLmEvalModels(MetaPathFinder):
    """Finds nothing itself: it hands lm_eval.models to the other finders and registers once it has run."""

    def find_spec(self, name, path=None, target=None):
        if name != "lm_eval.models":
            return None
        sys.meta_path.remove(self)              # once, and so the lookup below finds the real module
        spec = importlib.util.find_spec(name)
        if spec is not None and spec.loader is not None and hasattr(spec.loader, "exec_module"):
            run = spec.loader.exec_module

            def exec_module(module):
                run(module)
                try:
                    register()
                except Exception as e:          # never break lm-eval itself
                    print(f"jobrunner: could not register the lm-eval model 'jobrunner': {e}", file=sys.stderr)
            spec.loader.exec_module = exec_module
        return spec


def install() -> None:
    if "lm_eval.models" in sys.modules:
        register()
    elif not any(isinstance(f, _AfterLmEvalModels) for f in sys.meta_path):
        sys.meta_path.insert(0, _AfterLmEvalModels())
