from __future__ import annotations

import reporting


def pytest_terminal_summary(terminalreporter) -> None:
    if reporting.LINES:
        terminalreporter.section("figures")
        for line in reporting.LINES:
            terminalreporter.write_line(line)
