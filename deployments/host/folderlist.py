"""A local model folder's listing: its files and sizes and its config.json, stdlib only, so the agent can run it
as the engine user in a child of its own (`python -I -S -c <this file's source> <folder> <max files>`): root never
reads a folder on an operator's word, and what is read is what the engine itself may read (store.inspect_local)."""
import json
import os
import sys


def listing(path: str, max_files: int) -> dict:
    """{"files": [[relative path, size], ...] sorted, "config": parsed config.json}; ValueError saying why not."""
    if not os.path.isdir(path):
        raise ValueError(f"{path} is not a folder this node's engines may read")
    config_path = os.path.join(path, "config.json")
    # A model folder has a config.json at its top: checked before walking, so a home folder is refused at once.
    if not os.path.isfile(config_path):
        raise ValueError(f"{path} has no config.json: not a model folder")
    files = []
    for folder, dirs, names in os.walk(path, onerror=_raise):  # links to folders are not followed
        dirs[:] = [d for d in dirs if d != ".partial"]
        for name in names:
            full = os.path.join(folder, name)
            if os.path.isfile(full):
                files.append([os.path.relpath(full, path), os.stat(full).st_size])
                if len(files) > max_files:
                    raise ValueError(f"{path} holds more than {max_files} files: not a model folder")
    try:
        with open(config_path, encoding="utf-8") as f:
            config = json.load(f)
    except (OSError, ValueError) as exc:
        raise ValueError(f"{config_path} is not valid JSON: {exc}") from exc
    return {"files": sorted(files), "config": config}


def _raise(exc: OSError) -> None:
    raise ValueError(f"cannot read {exc.filename}: {exc.strerror}")


if __name__ == "__main__":
    try:
        print(json.dumps(listing(sys.argv[1], int(sys.argv[2]))))
    except (OSError, ValueError) as exc:
        print(json.dumps({"error": str(exc)}))
