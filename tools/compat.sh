#!/usr/bin/env bash
# `make compat TORCH=2.14.1 PYTHON=3.11`: the default test suite on another torch / Python.
#
# Builds a side environment once (cached outside the repository, in
# $AOTGRAD_COMPAT_DIR, default ~/.cache/aotgrad/compat/torch-X-pyY) with that torch, the
# torchvision built for it, and the development tools at the versions of constraints.txt
# (torch and torchvision excepted: they follow the torch asked for), then runs pytest there
# on this checkout's src. Extra pytest arguments: PYTEST_ARGS="tests/test_x.py -x".
#
# A torch above this machine's pip cap (/etc/xdg/pip: torch<=2.14.1) is installed with the
# cap lifted for this one environment (PIP_CONSTRAINT=/dev/null); nothing else changes. Where
# no torchvision release for that torch exists yet, pip takes the newest that allows it.
set -euo pipefail
cd "$(dirname "$0")/.."
torch=${TORCH:?TORCH=2.x.y is required, e.g. make compat TORCH=2.14.1}
python=${PYTHON:-3.11}
root=${AOTGRAD_COMPAT_DIR:-$HOME/.cache/aotgrad/compat}
env="$root/torch-$torch-py$python"

minor=$(echo "$torch" | cut -d. -f2)
case "$torch" in 2.1[1-5].*) ;; *) echo "torch $torch is outside the supported window 2.11-2.15" >&2; exit 2;; esac
vision="0.$((minor + 15)).*"   # torchvision 0.26 is built for torch 2.11, 0.27 for 2.12, ...

interpreter() {
    command -v "python$python" 2>/dev/null && return
    for candidate in "$HOME"/.pyenv/versions/"$python".*/bin/"python$python"; do
        [ -x "$candidate" ] && echo "$candidate" && return
    done
    echo "no python$python found (on PATH or under ~/.pyenv/versions)" >&2
    exit 2
}

dev_requirements() {  # the dev extra of pyproject.toml, torchvision left out
    "$env/bin/python" - <<'PY'
import re
import tomllib
with open("pyproject.toml", "rb") as f:
    project = tomllib.load(f)["project"]
extras = project["optional-dependencies"]
def expanded(requirements):  # "aotgrad[backends]" names another extra: its requirements
    for requirement in requirements:
        own = re.fullmatch(r"aotgrad\[(\w+)\]", requirement)
        yield from expanded(extras[own[1]]) if own else (requirement,)
for requirement in expanded(project["dependencies"] + extras["dev"]):
    if not requirement.startswith(("torch", "torchvision")):
        print(requirement)
PY
}

if [ ! -f "$env/.installed" ] || [ constraints.txt -nt "$env/.installed" ]; then
    [ -x "$env/bin/python" ] || "$(interpreter)" -m venv "$env"
    # The tools at the team's versions; torch and torchvision as asked, setuptools as torch allows.
    grep -v -E '^(torch|torchvision|setuptools)==' constraints.txt > "$env/constraints.txt"
    pip=(env PIP_CONSTRAINT=/dev/null "$env/bin/python" -m pip install --quiet)
    "${pip[@]}" "torch==$torch"
    with_vision=("torchvision==$vision")
    "${pip[@]}" "torch==$torch" "${with_vision[@]}" || {
        echo "no torchvision $vision for torch $torch yet: whichever release pip finds that allows it (timm needs one)" >&2
        with_vision=()
    }
    # The dev extra without torchvision (which would pull another torch), then the rest.
    "${pip[@]}" -c "$env/constraints.txt" "torch==$torch" "${with_vision[@]}" --no-deps -e .
    "${pip[@]}" -c "$env/constraints.txt" "torch==$torch" "${with_vision[@]}" \
        $(dev_requirements)
    touch "$env/.installed"
fi

"$env/bin/python" -c "import sys, torch; print(f'torch {torch.__version__} on Python {sys.version.split()[0]}')"
# shellcheck disable=SC2086
exec env OMP_NUM_THREADS="${OMP_NUM_THREADS:-1}" PYTHONPATH="$PWD/src" \
    "$env/bin/python" -m pytest -p no:cacheprovider ${PYTEST_ARGS:-}
