#!/usr/bin/env python3
"""The command-line tool (apps/shardopt) is built on the public API only, as the README says: each
of its files includes its own headers, the shared model shapes (models/) and installed headers
(<shardopt/...>, LibTorch's, the standard library's), never the library's sources (csrc/) or the
tests' view of the insides (<shardopt/testing/...>), and names nothing in shardopt::detail.

    python3 tests/check_tool_headers.py REPO
"""
import pathlib
import re
import sys

root = pathlib.Path(sys.argv[1] if len(sys.argv) > 1 else ".")
tool = root / "apps" / "shardopt"
bad = []
files = sorted(p for p in tool.iterdir() if p.suffix in (".cpp", ".h"))
for path in files:
    for number, line in enumerate(path.read_text().splitlines(), 1):
        quoted = re.match(r'\s*#\s*include\s+"([^"]+)"', line)
        angled = re.match(r"\s*#\s*include\s+<([^>]+)>", line)
        if quoted and not ((tool / quoted.group(1)).exists() or quoted.group(1).startswith("models/")):
            bad.append(f"{path.relative_to(root)}:{number}: includes \"{quoted.group(1)}\", not the tool's own or models/")
        if angled and angled.group(1).startswith("shardopt/testing/"):
            bad.append(f"{path.relative_to(root)}:{number}: includes <{angled.group(1)}>, the tests' view of the insides")
        if re.search(r"\bdetail::", line.split("//")[0]):
            bad.append(f"{path.relative_to(root)}:{number}: names shardopt::detail")
for b in bad:
    print(b)
print(f"{len(files)} files of apps/shardopt checked, {len(bad)} reach past the public API")
sys.exit(1 if bad or not files else 0)
