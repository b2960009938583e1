#!/usr/bin/env python3
"""Checks fusedp's vcpkg files without the vcpkg tool: each is strict JSON (as python3 -m json.tool
reads it) and has the fields vcpkg requires, with the port's version equal to the header's.

usage: check_manifests.py <fusedp checkout>
"""
import json
import pathlib
import re
import sys

NAME = re.compile(r"^[a-z0-9]+(-[a-z0-9]+)*$")
VERSION_FIELDS = ("version", "version-semver", "version-date", "version-string")
MANIFEST_FIELDS = {"$schema", "$comment", "name", "port-version", "description", "homepage", "documentation",
                   "license", "supports", "maintainers", "dependencies", "default-features", "features",
                   "builtin-baseline", "overrides", "vcpkg-configuration", *VERSION_FIELDS}

errors = []


def fail(path, message):
    errors.append(f"{path}: {message}")


def load(path):
    try:
        with open(path, encoding="utf-8") as f:
            return json.load(f)
    except (OSError, ValueError) as e:
        fail(path, f"not valid JSON: {e}")
        return None


def check_dependencies(path, deps):
    if not isinstance(deps, list):
        fail(path, '"dependencies" must be a list')
        return []
    names = []
    for dep in deps:
        if isinstance(dep, str):
            names.append((dep, False))
        elif isinstance(dep, dict) and isinstance(dep.get("name"), str):
            unknown = set(dep) - {"name", "host", "features", "default-features", "platform", "version>=", "$comment"}
            if unknown:
                fail(path, f"dependency {dep['name']} has unknown fields {sorted(unknown)}")
            if "host" in dep and not isinstance(dep["host"], bool):
                fail(path, f"dependency {dep['name']}: \"host\" must be true or false")
            names.append((dep["name"], dep.get("host", False)))
        else:
            fail(path, f"a dependency must be a name or an object with a name: {dep!r}")
    for name, _ in names:
        if not NAME.match(name):
            fail(path, f"dependency name {name!r} is not a valid port name")
    return names


def check_manifest(path):
    m = load(path)
    if not isinstance(m, dict):
        if m is not None:
            fail(path, "must be a JSON object")
        return None
    unknown = set(m) - MANIFEST_FIELDS
    if unknown:
        fail(path, f"unknown fields {sorted(unknown)} (vcpkg rejects them)")
    if not isinstance(m.get("name"), str) or not NAME.match(m["name"]):
        fail(path, '"name" must be lowercase letters, digits and single hyphens')
    versions = [f for f in VERSION_FIELDS if f in m]
    if len(versions) != 1:
        fail(path, f"needs exactly one of {VERSION_FIELDS}, has {versions}")
    elif not isinstance(m[versions[0]], str) or not m[versions[0]]:
        fail(path, f'"{versions[0]}" must be a non-empty string')
    elif versions[0] == "version-semver" and not re.match(r"^\d+\.\d+\.\d+(-[0-9A-Za-z.-]+)?$", m[versions[0]]):
        fail(path, f'"version-semver" {m[versions[0]]!r} is not a semantic version')
    return m


def main():
    root = pathlib.Path(sys.argv[1]).resolve()
    header = (root / "include/fusedp/core/config.hpp").read_text(encoding="utf-8")
    parts = [re.search(rf"#define FUSEDP_VERSION_{p}\s+(\d+)", header) for p in ("MAJOR", "MINOR", "PATCH")]
    header_version = ".".join(p.group(1) for p in parts) if all(parts) else None

    port_dir = root / "ports/fusedp"
    port = check_manifest(port_dir / "vcpkg.json")
    if port is not None:
        path = port_dir / "vcpkg.json"
        if port.get("name") != "fusedp":
            fail(path, '"name" must be "fusedp", the port folder\'s name')
        version = next((port[f] for f in VERSION_FIELDS if f in port), None)
        if version != header_version:
            fail(path, f"version {version} differs from include/fusedp/core/config.hpp ({header_version})")
        for field in ("description", "license"):
            if not isinstance(port.get(field), str) or not port[field]:
                fail(path, f'"{field}" must be a non-empty string')
        if port.get("license") != "MIT":
            fail(path, '"license" must be "MIT", as LICENSE says')
        deps = dict(check_dependencies(path, port.get("dependencies", [])))
        for helper in ("vcpkg-cmake", "vcpkg-cmake-config"):
            if deps.get(helper) is not True:
                fail(path, f"the portfile uses {helper}: it must be a dependency with \"host\": true")
        if "zlib" not in deps:
            fail(path, "fusedp::fusedp links zlib: the port must depend on zlib")
    for name in ("portfile.cmake", "usage"):
        if not (port_dir / name).is_file():
            fail(port_dir / name, "missing")

    example = root / "tests/consumers/vcpkg"
    consumer = check_manifest(example / "vcpkg.json")
    if consumer is not None:
        names = [n for n, _ in check_dependencies(example / "vcpkg.json", consumer.get("dependencies", []))]
        if "fusedp" not in names:
            fail(example / "vcpkg.json", "the example must depend on fusedp")
    config = load(example / "vcpkg-configuration.json")
    if isinstance(config, dict):
        overlays = config.get("overlay-ports")
        if not isinstance(overlays, list) or not all(isinstance(o, str) for o in overlays):
            fail(example / "vcpkg-configuration.json", '"overlay-ports" must be a list of paths')
        elif not any((example / o / "fusedp" / "vcpkg.json").resolve() == (port_dir / "vcpkg.json")
                     for o in overlays):
            fail(example / "vcpkg-configuration.json", f"no overlay in {overlays} leads to {port_dir}")
    elif config is not None:
        fail(example / "vcpkg-configuration.json", "must be a JSON object")

    for e in errors:
        print(e, file=sys.stderr)
    if not errors:
        print(f"vcpkg manifests: port fusedp {header_version}, example and overlay configuration are valid")
    return 1 if errors else 0


if __name__ == "__main__":
    sys.exit(main())
