"""Where snapd's own messages go: the standard `logging` module, under "snapd".

Library code never prints. Each module takes `logging.getLogger(__name__)`; the
modules of both packages (`snapd.*`, `snapd_client.*`) log under these two top
loggers, and each gets one handler here, so that the operator's one-line decisions
("resuming from step 300 ...", the daemon's "committed ..." lines) reach stderr
without the application configuring anything, as they always did.

An application takes over by configuring the loggers itself: `logging.getLogger(
"snapd_client").setLevel(logging.WARNING)` silences the resume lines; removing the
handler (`logging.getLogger("snapd").handlers.clear()`) and setting `propagate = True`
routes everything through the application's own handlers.

The handler looks `sys.stderr` up at each record (not once at import), so a process
that redirects stderr later (pytest's capture, a daemon detaching) is followed.
"""

from __future__ import annotations

import logging
import sys

TOP_LOGGERS = ("snapd", "snapd_client")


class StderrHandler(logging.Handler):
    """One write per record, to whatever `sys.stderr` is at that moment.

    One write per line: threads log at once, and several writes per line would
    interleave.
    """

    def emit(self, record: logging.LogRecord) -> None:
        try:
            stream = sys.stderr
            if stream is None:  # pythonw, or stderr closed: nowhere to say it
                return
            stream.write(self.format(record) + "\n")
            stream.flush()
        except Exception:  # a broken stderr must never break a snapshot
            self.handleError(record)


def install(name: str, fmt: str = "snapd: %(message)s") -> logging.Logger:
    """Give the top logger `name` its stderr handler, once; INFO and up."""
    logger = logging.getLogger(name)
    if not any(isinstance(h, StderrHandler) for h in logger.handlers):
        handler = StderrHandler()
        handler.setFormatter(logging.Formatter(fmt))
        logger.addHandler(handler)
        logger.setLevel(logging.INFO)
        # The handler above prints; passing records up as well would print them twice
        # under an application that configured the root logger.
        logger.propagate = False
    return logger


def set_format(name: str, fmt: str, datefmt: str | None = None) -> None:
    """Change how the top logger `name` writes its lines (the daemon stamps time, pid)."""
    for handler in install(name).handlers:
        if isinstance(handler, StderrHandler):
            handler.setFormatter(logging.Formatter(fmt, datefmt))


for _name in TOP_LOGGERS:
    install(_name)
