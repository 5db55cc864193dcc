import os

import pytest
import torch

# Two cores: pin torch's intra-op threads so test timings do not depend on what else runs.
torch.set_num_threads(int(os.environ.get("TRACEFP4_TEST_THREADS", "2")))


def pytest_configure(config):
    if os.environ.get("TRACEFP4_REQUIRE_CLIB"):  # only then: tracefp4 is not imported before the test modules
        from tracefp4.formats.clib import loader

        try:  # a misspelt value is refused before any test runs, not read as "not required"
            loader.required()
        except ValueError as e:
            raise pytest.UsageError(str(e)) from None
    config.addinivalue_line(
        "markers", "needs_clib: needs the C kernel library (tracefp4.formats.clib); skipped where it cannot be "
        "built, failed instead under TRACEFP4_REQUIRE_CLIB=1 (CI)")


@pytest.hookimpl(tryfirst=True)  # before the skipif marks: a test's other skip must not hide a missing library
def pytest_runtest_setup(item):
    """The one place a missing C library is decided for the tests marked ``needs_clib``: a skip with the
    build's error on a user's machine (the library falls back, as tracefp4 itself does), a failure under
    ``TRACEFP4_REQUIRE_CLIB=1``, where a library that does not build must not leave CI green."""
    if item.get_closest_marker("needs_clib") is None:
        return
    from tracefp4.formats.clib import loader

    reason = loader.unavailable_reason()  # None once built and loaded; asks without the fallback's warning
    if reason is None:
        return
    if loader.required():
        pytest.fail(f"{item.nodeid} needs the C kernel library, required here ({loader.REQUIRE_VARIABLE}=1) "
                    f"but unavailable: {reason} (source: {loader.SOURCE})", pytrace=False)
    pytest.skip(f"CPU kernel unavailable: {reason}")


@pytest.fixture(scope="module", autouse=True)
def _fresh_interpreter_children(request):
    """As the first module with a fresh-interpreter test begins (tests/fresh_interpreter.py: Triton was
    imported before the module could turn its interpreter on, so the module reruns its Triton tests
    in a child process), the children of every such test that is selected start together: each runs
    one interpreter thread, so two run beside each other and beside this process's own tests instead
    of one after the other. Each test then waits for its child and checks it as before."""
    if not getattr(request.module, "_FRESH_PROCESS", False):
        yield
        return
    from fresh_interpreter import start_fresh_interpreter, stop_started

    for item in request.session.items:
        module = getattr(item, "module", None)
        if item.name.endswith("_in_a_fresh_interpreter_process") and getattr(module, "_FRESH_PROCESS", False):
            start_fresh_interpreter(module.__file__, module._CHILD_FLAG, getattr(module, "_NO_TRITON", ()))
    request.config.add_cleanup(stop_started)  # at the session's end: one no test waited for (stopped early)
    yield
