#!/bin/sh
# Writes the lock: requirements/{eval,test,serve,triton}.txt from pyproject.toml and pins.in, hashed, for
# CPython 3.11 on x86_64 Linux. Called by `make lock` (which adds --upgrade); extra arguments go to
# every `uv pip compile` (e.g. --upgrade-package xgrammar). eval.txt (every extra) is resolved first
# and the smaller sets are resolved under it, so a package has one version in all three files.
set -eu
cd "$(dirname "$0")/.."
UV=${LOCK_UV:-uv}
# The CPU build of torch the lock is resolved against: the machine's own wheels where pip is told of
# some (PIP_FIND_LINKS), else PyTorch's CPU index.
if [ -n "${PIP_FIND_LINKS:-}" ]; then
    TORCH_SOURCE="--find-links $PIP_FIND_LINKS"
else
    TORCH_SOURCE="--extra-index-url https://download.pytorch.org/whl/cpu --index-strategy unsafe-best-match"
fi
common="--python-version 3.11 --python-platform x86_64-manylinux_2_28 --generate-hashes --no-header
        --no-emit-package torch --no-emit-package triton -c requirements/pins.in $TORCH_SOURCE"
# shellcheck disable=SC2086
"$UV" pip compile -q pyproject.toml --extra test --extra plots --extra eval $common "$@" -o requirements/eval.txt
# shellcheck disable=SC2086
"$UV" pip compile -q pyproject.toml --extra test --extra plots $common -c requirements/eval.txt "$@" -o requirements/test.txt
# shellcheck disable=SC2086
"$UV" pip compile -q pyproject.toml $common -c requirements/eval.txt "$@" -o requirements/serve.txt
# shellcheck disable=SC2086
"$UV" pip compile -q requirements/triton.in --python-version 3.11 --python-platform x86_64-manylinux_2_28 \
    --generate-hashes --no-header "$@" -o requirements/triton.txt
