"""libemsa's own command (src/tools/cli.cc: `emsa plan`, `emsa profile`, ...) run in-process
through the C ABI's emsa_cli_run, with its text and exit codes."""

from __future__ import annotations

import ctypes

from .library import check, lib, take_string

__all__ = ["run_cli"]


def run_cli(argv: list[str]) -> tuple[int, str, str]:
    """(exit code, stdout text, stderr text) of libemsa's `emsa ARGV...`."""
    args = (ctypes.c_char_p * max(len(argv), 1))(*(a.encode() for a in argv))
    code = ctypes.c_int()
    out, err = ctypes.c_void_p(), ctypes.c_void_p()
    check(lib.emsa_cli_run(len(argv), args, ctypes.byref(code), ctypes.byref(out),
                           ctypes.byref(err)))
    return code.value, take_string(out), take_string(err)
