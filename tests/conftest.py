from __future__ import annotations

import pytest

import reporting


def pytest_collection_modifyitems(items) -> None:
    # schemathesis gives every operation's test the function's node id; pytest-xdist runs a test
    # per node id, so it would fuzz one operation of the eleven. Each gets an id of its own.
    seen: dict[str, int] = {}
    for item in items:
        seen[item.nodeid] = seen.get(item.nodeid, 0) + 1
    for item in items:
        if seen[item.nodeid] > 1:
            if hasattr(item.parent, "id"):  # pytest >= 9: a NodeId
                item._id = item.parent.id.child(item.name)
            else:
                item._nodeid = f"{item.parent.nodeid}::{item.name}"


def pytest_sessionfinish(session) -> None:
    # an xdist worker hands its figures to the controller, which prints them (below)
    workeroutput = getattr(session.config, "workeroutput", None)
    if workeroutput is not None:
        workeroutput["figures"] = list(reporting.LINES)


@pytest.hookimpl(optionalhook=True)
def pytest_testnodedown(node, error) -> None:
    reporting.LINES.extend(getattr(node, "workeroutput", {}).get("figures", []))


def pytest_terminal_summary(terminalreporter) -> None:
    if reporting.LINES:
        terminalreporter.section("figures")
        for line in reporting.LINES:
            terminalreporter.write_line(line)
