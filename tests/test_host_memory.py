"""engine/run/host_memory.py: while a CPU engine is open its freed activations stay mapped, so a step does not
fault them in again; the last engine to close gives the heap back."""
import os
import subprocess
import sys
import textwrap

import pytest

glibc = pytest.mark.skipif(not sys.platform.startswith("linux") or os.confstr("CS_GNU_LIBC_VERSION") is None,
                           reason="glibc's mallopt")
# In a fresh interpreter, a step's pattern ten times: four 24 MiB activations (a 2048-token chunk's MLP
# output) live at once, then freed; prints the page faults of the last nine steps (the first maps them)
_FAULTS = textwrap.dedent("""
    import resource, sys, torch
    from jobrunner.engine.run import host_memory
    kept = host_memory.hold() if sys.argv[1] != "default" else False
    if sys.argv[1] == "released":
        host_memory.hold()                  # two engines open, both closed
        host_memory.release(), host_memory.release()
    def step():
        live = [torch.empty(6 << 20).fill_(1.0) for _ in range(4)]
    step()
    before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
    for _ in range(9):
        step()
    print(kept, resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before)
""")


def _faults(mode: str, env: dict | None = None) -> tuple[bool, int]:
    out = subprocess.run([sys.executable, "-c", _FAULTS, mode], capture_output=True, text=True, check=True,
                         env={**os.environ, **(env or {})}).stdout.split()
    return out[0] == "True", int(out[1])


@glibc
def test_freed_activations_are_reused_without_faulting_again():
    kept, faults = _faults("keep")
    assert kept
    _, faults_default = _faults("default")
    pages = 9 * 4 * (24 << 20) // 4096
    assert faults_default > pages // 20       # glibc's default: some returned to the OS and faulted in again
    # kept in the heap: the same pages each step (seen: 0, or one tensor's 6,144 once, against 30,699)
    assert faults < faults_default // 3


@glibc
def test_the_last_engine_to_close_gives_the_heap_back():
    _, faults = _faults("released")
    _, faults_default = _faults("default")
    assert faults > faults_default // 2      # trimmed and unmapped again, as before any engine


def test_a_users_malloc_tunables_are_left_as_they_are():
    kept, _ = _faults("keep", {"MALLOC_TRIM_THRESHOLD_": "131072"})
    assert not kept
