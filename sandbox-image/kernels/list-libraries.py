#!/usr/bin/env python3
"""Write /opt/codebroker/libraries.json: the toolchain version and installed packages of every
sandbox language, as `{"<lang>": {"version": "...", "packages": [{"name", "version"}]}}`.

Run at image build time (`list-libraries.py OUT.json`); it fails when a toolchain is missing,
so it doubles as a smoke test of the language layers. Without an argument it prints the JSON.
"""

import importlib
import importlib.metadata
import json
import subprocess
import sys


def first_line(*cmd, prefix=""):
    """The first non-empty line a command prints (stdout, else stderr)."""
    try:
        p = subprocess.run(cmd, capture_output=True, text=True, timeout=300, stdin=subprocess.DEVNULL)
    except (OSError, subprocess.TimeoutExpired) as e:
        raise SystemExit(f"list-libraries: {' '.join(cmd)}: {e}")
    for stream in (p.stdout, p.stderr):
        for line in stream.splitlines():
            if line.strip():
                return prefix + line.strip()
    raise SystemExit(f"list-libraries: {' '.join(cmd)} printed nothing (exit {p.returncode})")


def dist_version(dist, name):
    """The distribution's version; Debian ships some with a placeholder 0.0.0 in their
    metadata, for those ask the module itself."""
    version = dist.version
    if version not in ("0.0.0", "0", "", None):
        return version
    tops = (dist.read_text("top_level.txt") or "").split() or [name.replace("-", "_")]
    for mod in tops:
        try:
            found = getattr(importlib.import_module(mod), "__version__", None)
        except Exception:
            continue
        if isinstance(found, str) and found:
            return found
    return version


def python_packages():
    seen = {}
    for dist in importlib.metadata.distributions():
        name = dist.metadata["Name"]
        if not name:
            continue
        key = name.lower().replace("_", "-")
        if key not in seen:
            seen[key] = {"name": name, "version": dist_version(dist, name)}
    return sorted(seen.values(), key=lambda p: p["name"].lower())


def r_packages():
    script = (
        'ip <- installed.packages()[, c("Package", "Version"), drop = FALSE];'
        'write.table(ip, sep = "\\t", quote = FALSE, row.names = FALSE, col.names = FALSE)'
    )
    out = subprocess.run(
        ["Rscript", "-e", script], capture_output=True, text=True, check=True, timeout=300
    ).stdout
    pkgs = {}
    for line in out.splitlines():
        parts = line.split("\t")
        if len(parts) == 2:
            pkgs.setdefault(parts[0], {"name": parts[0], "version": parts[1]})
    return sorted(pkgs.values(), key=lambda p: p["name"].lower())


def php_extensions():
    code = 'foreach (get_loaded_extensions() as $e) { echo $e, "\\t", phpversion($e), "\\n"; }'
    out = subprocess.run(["php", "-r", code], capture_output=True, text=True, check=True, timeout=60).stdout
    exts = {}
    for line in out.splitlines():
        name, _, version = line.partition("\t")
        if name:
            exts.setdefault(name, {"name": name, "version": version})
    return sorted(exts.values(), key=lambda p: p["name"].lower())


def node_packages(root="/node_modules"):
    """The npm packages at /node_modules that were asked for (the lock's top level), not
    their dependencies."""
    import os

    top = os.path.join(root, ".package-lock.json")
    try:
        with open(top, encoding="utf-8") as f:
            lock = json.load(f)
    except OSError:
        return []
    pkgs = []
    for path, meta in lock.get("packages", {}).items():
        name = path[len("node_modules/"):] if path.startswith("node_modules/") else None
        if name and "/node_modules/" not in name and not meta.get("dev") and meta.get("version"):
            pkgs.append({"name": name, "version": meta["version"]})
    with open("/node-libraries.json", encoding="utf-8") as f:
        wanted = set(json.load(f)["dependencies"])
    return sorted((p for p in pkgs if p["name"] in wanted), key=lambda p: p["name"].lower())


def command_line_tools():
    """The document converters code reaches through a shell (bash, or a subprocess)."""
    return [
        {"name": "libreoffice", "version": first_line("soffice", "--version")},
        {"name": "pandoc", "version": first_line("pandoc", "--version")},
        {"name": "poppler-utils", "version": first_line("pdftoppm", "-v")},
    ]


def main():
    node = first_line("node", "--version", prefix="Node.js ")
    libs = {
        "py": {"version": "Python " + sys.version.split()[0], "packages": python_packages()},
        "js": {"version": node, "packages": node_packages()},
        "ts": {"version": first_line("esbuild", "--version", prefix="esbuild ") + f" ({node})", "packages": node_packages()},
        "c": {"version": first_line("gcc", "--version"), "packages": []},
        "cpp": {"version": first_line("g++", "--version"), "packages": []},
        "java": {"version": first_line("javac", "-version"), "packages": []},
        "php": {"version": first_line("php", "-r", 'echo "PHP ", PHP_VERSION, "\\n";'), "packages": php_extensions()},
        "rs": {"version": first_line("rustc", "--version"), "packages": []},
        "go": {"version": first_line("go", "version"), "packages": []},
        "d": {"version": first_line("gdc", "--version"), "packages": []},
        "f90": {"version": first_line("gfortran", "--version"), "packages": []},
        "r": {"version": first_line("Rscript", "-e", "cat(R.version.string, '\\n')"), "packages": r_packages()},
        "bash": {"version": first_line("bash", "--version"), "packages": command_line_tools()},
    }
    text = json.dumps(libs, indent=2) + "\n"
    if len(sys.argv) > 1:
        with open(sys.argv[1], "w", encoding="utf-8") as f:
            f.write(text)
    else:
        sys.stdout.write(text)


if __name__ == "__main__":
    main()
