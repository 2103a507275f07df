"""Tests that need the Triton kernels compiled, run from a session whose kernels are interpreted.

``@pytest.mark.compiled_kernels`` marks them (ahead-of-time compiles for sm_90, the refusal of CPU tensors outside
the interpreter). When the kernels of this process are interpreted, the first such test to run starts ONE pytest
subprocess with ``TRITON_INTERPRET=0`` over all of them; each marked test then reports the outcome its twin had
there (its failure text included). With compiled kernels (a GPU, or ``TRITON_INTERPRET=0`` by hand) they simply run
here. The subprocess runs with ``--runxfail`` so that ``xfail`` markers are judged once, here.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile

import pytest

MARKER = "compiled_kernels"
_REPORT_ENV = "CS336_COMPILED_LANE_REPORT"


def kernels_interpreted() -> bool:
    """Whether ``@triton.jit`` in this process builds interpreter functions."""
    import triton

    return triton.knobs.runtime.interpret


def route_compiled_tests(config, items) -> None:
    """Under the interpreter, make every marked test report its outcome from the one compiled subprocess."""
    if not kernels_interpreted():
        return
    lane = _Lane(config)
    for item in items:
        if item.get_closest_marker(MARKER) is not None:
            item.runtest = lambda item=item: lane.replay(item)


class _Lane:
    def __init__(self, config):
        self.rootdir = str(config.rootpath)
        self.outcomes: dict[str, dict] | None = None

    def replay(self, item) -> None:
        nodeid = item.nodeid
        if self.outcomes is None:  # the session's final selection (after -m, -k and deselection)
            self.nodeids = [i.nodeid for i in item.session.items if i.get_closest_marker(MARKER) is not None]
            self.outcomes = self._run()
        outcome = self.outcomes.get(nodeid)
        if outcome is None:
            pytest.fail(f"the compiled-kernels subprocess did not run {nodeid}:\n{self.log[-6000:]}", pytrace=False)
        if outcome["outcome"] == "skipped":
            pytest.skip(outcome["text"])
        if outcome["outcome"] == "failed":
            pytest.fail(f"(with TRITON_INTERPRET=0, in the compiled-kernels subprocess)\n{outcome['text']}",
                        pytrace=False)

    def _run(self) -> dict[str, dict]:
        with tempfile.TemporaryDirectory() as directory:
            report = os.path.join(directory, "outcomes.json")
            env = {**os.environ, "TRITON_INTERPRET": "0", _REPORT_ENV: report}
            command = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-p", "tests._compiled_lane",
                       "--runxfail", *self.nodeids]
            done = subprocess.run(command, cwd=self.rootdir, env=env, capture_output=True, text=True, timeout=900)
            self.log = done.stdout + done.stderr
            if not os.path.exists(report):
                return {}
            with open(report) as f:
                return json.load(f)


# The plugin side, loaded into the subprocess by ``-p tests._compiled_lane``.


def pytest_runtest_logreport(report) -> None:
    path = os.environ.get(_REPORT_ENV)
    if path is None or (report.when != "call" and report.passed):
        return
    outcomes = {}
    if os.path.exists(path):
        with open(path) as f:
            outcomes = json.load(f)
    if report.nodeid in outcomes and outcomes[report.nodeid]["outcome"] != "passed":
        return  # a failed or skipped setup decides
    if report.skipped:
        text = report.longrepr[2] if isinstance(report.longrepr, tuple) else str(report.longrepr)
        text = text.removeprefix("Skipped: ")
    else:
        text = report.longreprtext
    outcomes[report.nodeid] = {"outcome": report.outcome, "text": text}
    with open(path, "w") as f:
        json.dump(outcomes, f)
