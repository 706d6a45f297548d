"""`emsa` (the package's command) and `python -m emsa`.

plan and profile run libemsa's own command, the C++ `emsa` (src/tools/cli.cc), through the C
ABI's emsa_cli_run: the same options, the same text and the same exit codes (0 ok, 2 usage or
bad input, 3 the plan does not fit, 1 other errors) as the binary. demo and report are Python.
"""

from __future__ import annotations

import sys

from ._native.cli import run_cli
from ._native.library import EmsaLibraryError


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    if argv and argv[0] == "demo":  # their own parsers: torch and matplotlib load only here
        from .demo import main as demo_main

        return demo_main(argv[1:])
    if argv and argv[0] == "report":
        from .report import main as report_main

        return report_main(argv[1:])
    try:
        code, out, err = run_cli(argv)
    except EmsaLibraryError as e:
        print(f"emsa: {e}", file=sys.stderr)
        return 1
    sys.stdout.write(out)
    sys.stderr.write(err)
    return code


if __name__ == "__main__":
    sys.exit(main())
