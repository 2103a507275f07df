"""A pytest plugin for the overlay test's own pytest run (``-p tests.course_overlay.collection_report``).

It writes to the JSON file named by ``$COURSE_OVERLAY_REPORT``: every test collected (before any selection), every
collection error, each test's outcome, and whether the suite's plugin was loaded. Only the tests whose node ids start
with one of ``$COURSE_OVERLAY_KEEP`` (separated by spaces) run; the others are deselected.
"""

from __future__ import annotations

import json
import os

import pytest

_REPORT: dict = {"collected": [], "errors": [], "outcomes": {}, "suite_plugin_loaded": False}


def pytest_configure(config) -> None:
    _REPORT["suite_plugin_loaded"] = config.pluginmanager.has_plugin("tests._pytest_plugin")


def pytest_collectreport(report) -> None:
    if report.failed:
        _REPORT["errors"].append(f"{report.nodeid}: {report.longreprtext[-2000:]}")


@pytest.hookimpl(tryfirst=True)
def pytest_collection_modifyitems(config, items) -> None:
    _REPORT["collected"] = [item.nodeid for item in items]
    keep = tuple(os.environ["COURSE_OVERLAY_KEEP"].split())
    config.hook.pytest_deselected(items=[item for item in items if not item.nodeid.startswith(keep)])
    items[:] = [item for item in items if item.nodeid.startswith(keep)]


def pytest_runtest_logreport(report) -> None:
    """A test failed if any phase failed, else skipped if one skipped, else passed."""
    outcomes = _REPORT["outcomes"]
    if report.failed:
        outcomes[report.nodeid] = "failed"
    elif report.skipped and outcomes.get(report.nodeid) != "failed":
        outcomes[report.nodeid] = "skipped"
    elif report.when == "call":
        outcomes.setdefault(report.nodeid, "passed")


def pytest_sessionfinish(session) -> None:
    with open(os.environ["COURSE_OVERLAY_REPORT"], "w") as f:
        json.dump(_REPORT, f)
