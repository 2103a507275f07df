#!/usr/bin/env bash
# Run the whole test suite (junit XML report in test-results.xml), then pack the code and the writeup PDF
# (writeup/writeup.pdf: the handout asks for it with the code) into cs336-spring2025-assignment-2-submission.zip.
# The zip is built even when tests fail, so that partial work can still be handed in; the script's exit
# status is the test run's. Left out: writeup/build/ (the writeup's staging directory), the git-ignored
# smoke-run results under .scratch/, caches, traces and files over 5 MB.
set -uo pipefail
cd "$(dirname "$0")"

usage() {
    cat <<'USAGE'
usage: bash test_and_make_submission.sh [--skip-tests]

Runs the test suite (~10 minutes on 2 CPU cores; junit report in test-results.xml), then writes
cs336-spring2025-assignment-2-submission.zip: the code and writeup/writeup.pdf, without caches,
traces, .scratch/ and files over 5 MB. The exit status is the test run's.

  --skip-tests   pack the zip without running the tests (exit status 0)
  -h, --help     show this message
USAGE
}

run_tests=1
for argument in "$@"; do
    case "$argument" in
        --skip-tests) run_tests=0 ;;
        -h|--help) usage; exit 0 ;;
        *) echo "unknown argument: $argument" >&2; usage >&2; exit 2 ;;
    esac
done

if [[ $run_tests == 1 ]]; then
    uv run pytest -v ./tests --junitxml=test-results.xml
    test_status=$?
    summary="Tests exited with status $test_status"
else
    test_status=0
    summary="Tests skipped (--skip-tests)"
fi

if [[ ! -f writeup/writeup.pdf ]]; then
    echo "warning: writeup/writeup.pdf is missing (build it: uv run python writeup/build.py)" >&2
fi
output=cs336-spring2025-assignment-2-submission.zip
rm -f "$output"
zip -q -r "$output" . \
    -x '*.git*' '.venv/*' '*/.venv/*' '*__pycache__*' '*.pytest_cache*' '*.egg-info*' \
       'build/*' 'dist/*' '*.pyc' '*.so' '*.pkl' '*.pickle' '*.pt' '*.pth' '*.ckpt' '*.safetensors' \
       '*.nsys-rep' '*.qdrep' '*.sqlite' '*.trace.json' '*.json.gz' 'traces/*' 'snapshots/*' \
       '*.zip' '*.tar' '*.tar.gz' '*.npy' '*.bin' '.gl/*' '.whl/*' \
       'writeup/build/*' '.scratch/*' \
    -x@<(find . -type f -size +5M -not -path './.git/*' -not -path './.venv/*' | sed 's|^\./||')
echo "$summary; wrote $output ($(du -h "$output" | cut -f1))"
exit "$test_status"
