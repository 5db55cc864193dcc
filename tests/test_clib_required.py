"""``TRACEFP4_REQUIRE_CLIB=1`` (CI, ``.ci/run``): a C library that does not build fails the build
command of ``make setup`` and every test that needs the library, where a user's machine gets the
fallback with a warning and skips them.

The library is broken for a child process only: its ``$CC`` is a script that fails as a compiler
with an error does, its cache folder an empty one, so the real source and the cached library are
untouched and the child cannot load a library built before.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
COMPILER_ERROR = "kernels.c:1:2: error: #error broken on purpose by tests/test_clib_required.py"


@pytest.fixture
def broken(tmp_path):
    """An environment in which the library cannot be built (without CI's requirement: each test adds it)."""
    cc = tmp_path / "cc"
    cc.write_text(f"#!/bin/sh\necho '{COMPILER_ERROR}' >&2\nexit 1\n")
    cc.chmod(0o755)
    cache = tmp_path / "cache"
    env = {k: v for k, v in os.environ.items() if k not in ("TRACEFP4_REQUIRE_CLIB", "TRACEFP4_CPU_KERNEL")}
    return {**env, "CC": str(cc), "TRACEFP4_CACHE_DIR": str(cache)}, cache


def _counts(stdout: str) -> dict[str, int]:
    """pytest's last line ("3 passed, 2 skipped, 1 warning in 1.2s") as {"passed": 3, "skipped": 2}:
    the outcomes, not the warnings (the fallback's own one is expected)."""
    summary = stdout.strip().splitlines()[-1]
    counts = {word: int(n) for n, word in re.findall(r"(\d+) (\w+)", summary.split(" in ")[0])}
    return {word: n for word, n in counts.items() if word not in ("warning", "warnings")}


@pytest.mark.subprocess
def test_the_build_command_warns_for_a_user_and_fails_under_ci(broken):
    env, cache = broken
    cmd = [sys.executable, "-m", "tracefp4.formats.clib", "build"]
    user = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=300)
    assert user.returncode == 0, user.stderr[-2000:]
    assert "warning: packed FP4 CPU kernel not built" in user.stdout and COMPILER_ERROR in user.stdout
    ci = subprocess.run(cmd, env={**env, "TRACEFP4_REQUIRE_CLIB": "1"}, capture_output=True, text=True, timeout=300)
    assert ci.returncode == 1, ci.stdout + ci.stderr
    assert "required (TRACEFP4_REQUIRE_CLIB=1)" in ci.stderr and COMPILER_ERROR in ci.stderr
    assert not cache.exists() or not any(cache.iterdir())  # nothing half-built left to be loaded
    typo = subprocess.run(cmd, env={**env, "TRACEFP4_REQUIRE_CLIB": "true"}, capture_output=True, text=True,
                          timeout=300)
    assert typo.returncode == 2 and "TRACEFP4_REQUIRE_CLIB='true': expected 1" in typo.stderr


@pytest.mark.slow  # two pytest children, ~20 s on 2 cores
@pytest.mark.subprocess
def test_tests_that_need_the_library_skip_for_a_user_and_fail_under_ci(broken):
    """test_clib_ops (every test marked needs_clib) and the build test of test_fp4_gemm: all skipped
    without the requirement, all failed (at set-up, naming the compiler's error) with it."""
    env, _ = broken
    cmd = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "tests/test_clib_ops.py",
           "tests/test_fp4_gemm.py::test_build_is_cached_and_published_whole"]
    user = subprocess.run(cmd, env=env, cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert user.returncode == 0, user.stdout[-4000:]
    skipped = _counts(user.stdout)
    assert set(skipped) == {"skipped"} and skipped["skipped"] > 1, user.stdout[-2000:]
    ci = subprocess.run(cmd, env={**env, "TRACEFP4_REQUIRE_CLIB": "1"}, cwd=ROOT, capture_output=True, text=True,
                        timeout=600)
    assert ci.returncode == 1, ci.stdout[-4000:]
    assert _counts(ci.stdout) == {"errors": skipped["skipped"]}, ci.stdout[-2000:]
    assert "test_build_is_cached_and_published_whole needs the C kernel library, required here" in ci.stdout
    assert COMPILER_ERROR in ci.stdout
