"""The README's quickstart is examples/quickstart.cpp, verbatim (the build compiles that file), and
it trains: run it on 2 ranks and check that the loss falls.

    readme_quickstart.py README.md examples/quickstart.cpp LAUNCH QUICKSTART_EXE
"""
import re
import subprocess
import sys
import tempfile


def main():
    readme, source, launch, exe = sys.argv[1:5]
    with open(readme) as f:
        text = f.read()
    m = re.search(r"## Quickstart.*?```cpp\n(.*?)```", text, re.S)
    if not m:
        print("README.md has no ```cpp block under '## Quickstart'")
        return 1
    with open(source) as f:
        if m.group(1) != f.read():
            print(f"the README's quickstart differs from {source}")
            return 1
    with tempfile.TemporaryDirectory() as d:
        p = subprocess.run([sys.executable, launch, "-n", "2", "--timeout", "120", exe], cwd=d,
                           stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    print(p.stdout)
    losses = [float(x) for x in re.findall(r"loss (\d+\.\d+)", p.stdout)]
    if p.returncode != 0 or len(losses) != 4 or not losses[-1] < losses[0]:
        print(f"quickstart failed (exit {p.returncode}) or its loss did not fall: {losses}")
        return 1
    print("quickstart ok")
    return 0


if __name__ == "__main__":
    sys.exit(main())
