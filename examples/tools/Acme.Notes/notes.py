#!/usr/bin/env python3
"""A multi-tool example: subcommands by argv, the argument object on stdin.

notes.py add [--tag T]...   stdin {"text": ..., "tags": [...]}
notes.py list [--limit N]
notes.py index              stdin {"path": "/abs/path"}; reports progress on TOOLSETD_PROGRESS_FD
"""

import json
import os
import sys
import time


def notebook() -> str:
    return os.path.join(os.environ["CRYSTAL_PROJECT_DATA"], "notes.jsonl")


def progress(message: str, fraction: float) -> None:
    fd = os.environ.get("TOOLSETD_PROGRESS_FD")
    if fd:
        os.write(int(fd), (json.dumps({"message": message, "fraction": fraction}) + "\n").encode())


def main(argv: list[str]) -> int:
    args = json.loads(sys.stdin.read() or "{}")
    command = argv[0] if argv else ""
    if command == "add":
        entry = {"time": time.time(), "text": args["text"], "tags": args.get("tags", [])}
        with open(notebook(), "a", encoding="utf-8") as f:
            f.write(json.dumps(entry) + "\n")
        print(f"Added note ({len(args['text'])} characters).")
        return 0
    if command == "list":
        limit = int(argv[argv.index("--limit") + 1]) if "--limit" in argv else 20
        try:
            with open(notebook(), encoding="utf-8") as f:
                notes = [json.loads(line) for line in f]
        except FileNotFoundError:
            notes = []
        for note in reversed(notes[-limit:]):
            tags = f" [{', '.join(note['tags'])}]" if note["tags"] else ""
            print(f"- {note['text']}{tags}")
        if not notes:
            print("No notes yet.")
        return 0
    if command == "index":
        root = args["path"]
        files = [os.path.join(d, n) for d, _, names in os.walk(root) for n in names]
        words = 0
        for i, path in enumerate(files, 1):
            try:
                with open(path, encoding="utf-8") as f:
                    words += len(f.read().split())
            except (UnicodeDecodeError, OSError):
                print(f"skipped {path}", file=sys.stderr)
            progress(f"indexed {i} of {len(files)} files", i / max(len(files), 1))
        print(f"Indexed {len(files)} files, {words} words under {root}.")
        return 0
    print(f"unknown command {command!r}", file=sys.stderr)
    return 2


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
