"""How the command-line tools report a user's mistake: one paragraph, exit status 2."""

from __future__ import annotations

import sys
import textwrap
from typing import Callable

EXIT_USAGE = 2  # bad input: a missing file, a malformed model, an unsupported op, a shape mismatch
EXIT_INTERRUPTED = 130  # Ctrl-C, as a shell reports a process killed by SIGINT (128 + 2)


def user_errors() -> tuple[type[BaseException], ...]:
    """The exceptions that mean 'the input is wrong', not 'tilegraph is broken'."""
    from xdsl.utils.exceptions import DiagnosticException, ParseError, VerifyException

    from tilegraph.ir.errors import TilegraphError

    return (TilegraphError, ParseError, VerifyException, DiagnosticException, OSError)


def run_reporting_errors(tool: str, body: Callable[[], object]) -> int:
    from tilegraph.ir.escape import terminal_text

    try:
        result = body()
    except KeyboardInterrupt:
        # Outputs are written last, whole, so an interrupted command leaves no partial file.
        print(f"{tool}: interrupted", file=sys.stderr)
        return EXIT_INTERRUPTED
    except user_errors() as e:
        message = str(e).strip() or type(e).__name__
        if isinstance(e, OSError) and e.filename:
            message = f"{e.strerror}: {e.filename}"
        message = terminal_text(message)  # it quotes the model's strings: no escape sequence runs
        first, _, rest = message.partition("\n")
        print(f"{tool}: error: {first}", file=sys.stderr)
        if rest:
            print(textwrap.indent(rest, "  "), file=sys.stderr)
        return EXIT_USAGE
    return result if isinstance(result, int) else 0
