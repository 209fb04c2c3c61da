from __future__ import annotations

import pytest

import reporting


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
