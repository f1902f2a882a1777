"""Runs a command and passes only when it exits 0 and its output matches a pattern (CTest's
PASS_REGULAR_EXPRESSION alone ignores the exit code).

    expect_output.py PATTERN COMMAND [ARGS...]
"""
import re
import subprocess
import sys


def main() -> int:
    if len(sys.argv) < 3:
        print("usage: expect_output.py PATTERN COMMAND [ARGS...]", file=sys.stderr)
        return 2
    pattern, command = sys.argv[1], sys.argv[2:]
    p = subprocess.run(command, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    sys.stdout.write(p.stdout)
    if p.returncode != 0:
        print(f"expect_output: the command exited with code {p.returncode}", file=sys.stderr)
        return 1
    if not re.search(pattern, p.stdout, re.S):
        print(f"expect_output: the output does not match {pattern!r}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
