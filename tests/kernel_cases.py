"""Device and dtype cases shared by the Triton kernel tests: CPU runs in the interpreter (float16,
float32: bfloat16 is broken there); CUDA cases are skipped without a GPU."""
import pytest
import torch

HAS_CUDA = torch.cuda.is_available()
cuda_only = (pytest.mark.gpu, pytest.mark.skipif(not HAS_CUDA, reason="needs CUDA"))


def device_dtype_cases(cuda_fp32: bool = True) -> list:
    cases = [
        pytest.param("cpu", torch.float16, id="cpu-fp16"),
        pytest.param("cpu", torch.float32, id="cpu-fp32"),
        pytest.param("cuda", torch.bfloat16, id="cuda-bf16", marks=cuda_only),
        pytest.param("cuda", torch.float16, id="cuda-fp16", marks=cuda_only),
    ]
    if cuda_fp32:
        cases.append(pytest.param("cuda", torch.float32, id="cuda-fp32", marks=cuda_only))
    return cases
