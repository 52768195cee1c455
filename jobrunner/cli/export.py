"""`jobrunner models export NAME DIR`: a model jobrunner knows, written as a Hugging Face directory
(engine/load/hf_export.py) for the tools that take one: transformers, PEFT, llmcompressor, lm-eval's `hf`."""
from __future__ import annotations

import sys
from pathlib import Path

import click

_DTYPES = ("float32", "bfloat16", "float16")      # engine.EXPORT_DTYPES; spelled here so --help loads no torch


@click.command("export")
@click.argument("name")
@click.argument("directory", metavar="DIR", type=click.Path(path_type=Path))
@click.option("--dtype", type=click.Choice(_DTYPES), default="float32", show_default=True,
              help="The weights' dtype in model.safetensors. float32 gives transformers our greedy tokens; "
                   "bfloat16 and float16 halve the files and are close, not exact.")
def export(name: str, directory: Path, dtype: str) -> None:
    """Write model NAME as a Hugging Face directory DIR that transformers, PEFT, llmcompressor and
    lm-eval's `hf` backend load.

    NAME is a known model (the default smollm2-135m-instruct is pulled if not cached) or a path or
    URL of a .gguf file. DIR gets config.json, model.safetensors (weights dequantized from the GGUF,
    llama.cpp's q/k permutation undone), tokenizer.json, tokenizer_config.json with the chat template,
    and generation_config.json. DIR must be new or empty; it appears only when complete.

    \b
      jobrunner models export smollm2-135m-instruct ./smollm2-hf
      python -c "import transformers; transformers.AutoModelForCausalLM.from_pretrained('./smollm2-hf')"

    \b
    Exit codes: 0 written (DIR is printed); 2 an unknown model, a model that is not a GGUF file
    (an HF directory already is one), or a DIR that exists and is not an empty directory;
    4 DIR cannot be written (no permission, disk full).
    """
    from jobrunner.engine import ModelError, export_hf_dir
    from jobrunner.models.known import resolve_model
    try:
        written = export_hf_dir(resolve_model(name), directory, dtype=dtype)
    except ModelError as e:
        _fail(2, str(e))
    except OSError as e:
        _fail(4, f"cannot write {directory}: {e}")
    size = written["bytes"] / 2**20
    click.echo(f"{written['architecture']}, {written['tensors']} tensors, {size:.0f} MiB {dtype}: "
               f"{', '.join(written['files'])}", err=True)
    click.echo(written["dir"])


def _fail(code: int, message: str) -> None:
    click.echo(f"error: {message}", err=True)
    sys.exit(code)
