"""Every `Note [Name]` the project's files refer to is defined somewhere (a comment line that is
only `// Note [Name]` or `# Note [Name]`), and a reference that names the file the note is in
("Note [Name] in `path`") names the right one. Prints each bad reference and exits 1 if any."""
import os
import re
import sys

SUFFIXES = (".cpp", ".h", ".cu", ".cuh", ".py", ".md", ".sh", ".txt", ".cmake")
root = sys.argv[1]
defined, referenced = {}, {}
for folder, dirs, files in os.walk(root):
    dirs[:] = [d for d in dirs if d not in ("build", ".git") and not d.startswith("build-")]
    for name in files:
        if not name.endswith(SUFFIXES) and name != "launch":
            continue
        path = os.path.join(folder, name)
        try:
            text = open(path, encoding="utf-8").read()
        except (UnicodeDecodeError, OSError):
            continue
        rel = os.path.relpath(path, root)
        if rel == os.path.join("tests", "check_notes.py"):
            continue  # its own examples
        for m in re.finditer(r"^\s*(?://|#)\s*Note \[([^\]]+)\]\s*$", text, re.M):
            defined.setdefault(m.group(1), []).append(rel)
        for m in re.finditer(r"Note\s+\[([^\]]+)\](\s+(?:in|of)\s+`?((?:[\w./-]+/)?[\w.-]+\.(?:cpp|h|cu|py|md))`?)?", text):
            # A name broken over comment lines reads as one.
            note = re.sub(r"\s+", " ", re.sub(r"\s*\n\s*(?://|#)?\s*", " ", m.group(1))).strip()
            referenced.setdefault(note, []).append((rel, text.count("\n", 0, m.start()) + 1, m.group(3)))
bad = 0
for note, places in sorted(referenced.items()):
    for rel, line, said in places:
        if note not in defined:
            print(f"{rel}:{line}: Note [{note}] is referenced but defined nowhere")
            bad += 1
        elif said and not any(d.endswith(said) for d in defined[note]):
            print(f"{rel}:{line}: Note [{note}] is said to be in {said}, but it is in {', '.join(defined[note])}")
            bad += 1
print(f"{len(referenced)} notes referenced, {len(defined)} defined, {bad} bad references")
sys.exit(1 if bad else 0)
