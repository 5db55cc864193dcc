import os

import pytest
import torch

# Two cores: pin torch's intra-op threads so test timings do not depend on what else runs.
torch.set_num_threads(int(os.environ.get("TRACEFP4_TEST_THREADS", "2")))


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
